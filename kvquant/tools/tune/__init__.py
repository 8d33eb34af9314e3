"""``kvquant tune``: per-layer, per-K/V formats that meet a bits (or KL) budget with the least KL.

1. **Sensitivity, the way quality is measured.** Each calibration window (``prefix_len`` +
   ``score_len`` tokens) is prefilled once; then, for every layer, for keys and for values, and for
   every format of the menu, the ``score_len`` reference tokens are teacher-forced one at a time
   through a :class:`~kvquant.KVQuantCache` in which *only that tensor of that layer* is quantized
   (everything else full precision), and the mean KL divergence of the next-token distributions
   from the full-precision cache's is recorded. This is ``kvquant eval``'s decode mode (the prefill
   attends to full-precision K/V there too, so the prefix's keys / values are computed once and
   written into each cache, which is what the prefill would have written; a test checks the log-probs
   equal :func:`~kvquant.eval.decode.teacher_forced_logprobs`). The windows, and 10 probes, run as
   one batch. By default (``measure="all"``) every format of the menu is measured so;
   ``measure="scaled"`` (``len(formats)`` times faster, approximate) measures only the coarsest and
   scales the others by the stored error (:func:`tensor_sensitivity`). Measured, the KL is close to
   additive over tensors (SmolLM2, 3 bits: 0.0057 predicted, 0.0064 measured jointly).
2. **Cost, the way ``kvquant eval`` counts it.** The bytes each tensor's format adds to a layer after
   ``bits_tokens`` positions (default ``prefix_len + score_len - 1``, the end of an eval window):
   codes, scales, the sink / recent / residual tokens, every tensor counted at 16 bits
   (:func:`kvquant.memory.layer_bytes`). Bits = ``16 * bytes / fp16 bytes`` (``bits @16-bit``).
3. **Allocation.** A multiple-choice knapsack over the ``2 x layers`` tensors, KL assumed additive
   over tensors, solved exactly on the cost / KL Pareto front (not greedily): the least predicted KL
   within ``budget_bits``, or the fewest bits whose predicted KL is at most ``budget_kl``.
4. **Check.** With ``verify=True`` (the CLI's default) the chosen config and the best uniform
   configs of the menu within the same bits are measured jointly, in decode mode, on the
   calibration windows; if a uniform one measures lower, it is returned instead (with a note).

Pins: ``pinned={"key": {18: "nuq4"}}`` keeps those tensors in those formats (e.g. the retrieval
layers of ``kvquant calibrate --retrieval``, which KL on short windows does not see); their bytes
count against the budget, the allocation spreads the rest, and the uniform configs it is checked
against carry the same pins.

Per-head formats (``per_head=True``, ``kvquant tune --per-head``): the units are (layer, KV head)
pairs instead of layers: each head's key and value tensors are probed alone (the rest of its layer
and every other layer in full precision) and priced at ``1 / kv_heads`` of the layer's cost, and the
result holds head overrides (``layer_overrides: {i: {heads: {h: ...}}}``, stored by
:class:`~kvquant.cache.head_split.HeadSplitLayer`). ``kv_heads`` times the probes of a per-layer
run. A tensor whose format has more bits than the recent window's (``int8`` over ``nuq4``) gets its
recent window in that format too.

Example:
    >>> calib = prefill(model, windows, prefix_len=1024)          # windows: [W, 1024 + 64]
    >>> result = tune(model, calib, budget_bits=3.0)
    >>> print(result.table())
    >>> result.write_yaml("tuned.yaml")

The package: :mod:`~kvquant.tools.tune.kl` (calibration windows, decode-mode KL),
:mod:`~kvquant.tools.tune.costs` (menu, base recipe, bytes), :mod:`~kvquant.tools.tune.probes`
(sensitivities), :mod:`~kvquant.tools.tune.allocate` (the knapsack), :mod:`~kvquant.tools.tune.search`
(:func:`tune` and its result).
"""

from kvquant.tools.tune.allocate import Plan, allocate
from kvquant.tools.tune.costs import DEFAULT_BASE, MENU, TENSORS, config_bits, tensor_costs, tensor_fields
from kvquant.tools.tune.kl import Calibration, decode_kl, decode_logprobs, prefill
from kvquant.tools.tune.probes import (
    SCALING_POWER,
    load_sensitivity,
    probe_config,
    save_sensitivity,
    stored_error,
    tensor_sensitivity,
)
from kvquant.tools.tune.search import (
    TuneResult,
    build_config,
    check_base,
    check_formats,
    check_pins,
    pins_from_config,
    tune,
)

__all__ = [
    "Plan",
    "allocate",
    "DEFAULT_BASE",
    "MENU",
    "TENSORS",
    "config_bits",
    "tensor_costs",
    "tensor_fields",
    "Calibration",
    "decode_kl",
    "decode_logprobs",
    "prefill",
    "SCALING_POWER",
    "load_sensitivity",
    "probe_config",
    "save_sensitivity",
    "stored_error",
    "tensor_sensitivity",
    "TuneResult",
    "build_config",
    "check_base",
    "check_formats",
    "check_pins",
    "pins_from_config",
    "tune",
]
