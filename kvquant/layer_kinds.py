"""The kinds of decoder layer that ``config.layer_types`` names, grouped by what a cache holds for them.

One list for the cache (which layers it builds), the planner (which layers hold keys and values) and
the retrieval probe (which layers return attention maps).

Example:
    >>> "sliding_attention" in ATTENTION, "conv" in STATE
    (True, True)
"""

from __future__ import annotations

# per-token keys and values: what the cache quantizes
ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")
# a state of fixed size (Mamba, gated DeltaNet, short convolutions: Qwen3-Next, Jamba, LFM2), kept
# as transformers keeps it, in full precision
STATE = ("linear_attention", "conv")
# nothing (a layer without attention)
EMPTY = ("dummy",)
SUPPORTED = ATTENTION + STATE + EMPTY
