"""Capacity planner: from a model config alone, how many sequences of what length fit in memory.

For every cache preset (and the full-precision reference) :func:`plan` gives the KV bytes one
sequence holds at a context (exactly what :meth:`KVQuantCache.nbytes` reports: sink and residual
tokens, sliding windows, partial KIVI blocks and per-layer overrides included, via
:func:`kvquant.memory.layer_bytes`), the max batch at that context and the max context at a given
batch, after the weights (parameter count estimated from the config) and an activation reserve.

A sequence passes through every shorter context on its way, and the bytes are not monotone in the
context (a KIVI block that fills is quantized and shrinks; sinks leave a sliding window), so the
capacity figures use the *peak* bytes over all contexts up to the one asked for.

The arithmetic lives here, below the harness (``kvquant sweep`` reads capacities from it) and the
tools; the ``kvquant plan`` command and its table are :mod:`kvquant.tools.plan`.

Example:
    >>> from kvquant.models import tiny_config
    >>> from kvquant.planning import plan
    >>> rows = plan(tiny_config("llama"), memory_bytes=2**30, context=256, presets=["int4"])
    >>> rows[0]["config"], rows[-1]["config"]
    ('int4', 'reference')
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from kvquant.config import KVQuantConfig, is_preset, preset_names
from kvquant.memory import groups_bytes, layer_groups

# (the inputs are re-exported: kvquant.planning is where callers look for them)
from kvquant.plan_inputs import (  # noqa: F401
    DEFAULT_RESERVE,
    DTYPE_BYTES,
    PlanError,
    dtype_bytes,
    load_config,
    parse_reserve,
    parse_size,
)

# ------------------------------------------------------------------------------------------ weights


def _head_dim(text: Any) -> int:
    hd = getattr(text, "head_dim", None)
    return hd if hd else text.hidden_size // text.num_attention_heads


def estimate_parameters(config: Any) -> int:
    """Parameter count of a decoder from its config: embedding, attention, MLP, norms, lm_head.

    Exact for llama / mistral / qwen2 / gemma2 / gemma3-style decoders; an estimate for others (MoE
    experts are counted as ``num_experts`` MLPs plus a router; vision towers are not counted).
    """
    text = config.get_text_config(decoder=True)
    h, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hd = _head_dim(text)
    mtype = getattr(text, "model_type", "")
    attn = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
    if getattr(text, "attention_bias", False):
        attn += heads * hd + 2 * kv_heads * hd + h
    elif mtype.startswith("qwen2"):  # q/k/v biases, none on o_proj
        attn += heads * hd + 2 * kv_heads * hd
    if mtype.startswith(("gemma3", "qwen3", "olmo2")):  # q / k norms
        attn += 2 * hd
    inter = text.intermediate_size
    mlp = 3 * h * inter  # gate, up, down
    if getattr(text, "mlp_bias", False):
        mlp += 2 * inter + h
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    if experts:
        moe_inter = getattr(text, "moe_intermediate_size", None) or inter
        mlp = experts * 3 * h * moe_inter + h * experts
    norms = (4 if mtype.startswith(("gemma2", "gemma3")) else 2) * h
    total = vocab * h + layers * (attn + mlp + norms) + h  # + final norm
    if not getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True)):
        total += vocab * h
    return int(total)


# ------------------------------------------------------------------------------------------ KV bytes


class _KVModel:
    """Per-layer geometry of a decoder's cache, grouped into identical (layer config, window) groups."""

    def __init__(self, config: Any, quant: KVQuantConfig, fp_itemsize: int, heads: int | None = None):
        from transformers.cache_utils import get_layer_types_and_kwargs

        text = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        self.heads = heads or getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = _head_dim(text)
        self.fp_itemsize = fp_itemsize
        self.types, self.windows = types, [kw.get("sliding_window") for kw in kwargs]
        self.quant = quant
        self.groups = layer_groups(quant, self.types, self.windows)
        self._bytes: dict[tuple[int, int], int] = {}  # (tokens, batch) -> bytes; searches revisit them

    def bytes(self, tokens: int, batch: int = 1) -> int:
        """Exact bytes of a KVQuantCache after ``tokens`` positions (``model_cache_bytes``, memoised)."""
        key = (tokens, batch)
        if key not in self._bytes:
            dims = (self.heads, self.head_dim, self.fp_itemsize)
            self._bytes[key] = groups_bytes(self.groups, tokens, batch, dims)
        return self._bytes[key]

    def held_elements(self, tokens: int, batch: int = 1) -> int:
        """K + V elements of the positions held (what ``fp16_bytes`` counts), for effective bits."""
        total = 0
        for cfg, window, count in self.groups:
            block = cfg.tail_block
            store_end = max(tokens - cfg.residual_length, 0) // block * block
            begin = 0 if window is None else min(max(tokens - (window - 1), 0), store_end)
            held = store_end - begin + tokens - store_end
            total += count * held * batch * self.heads * self.head_dim * 2
        return total

    def drop_points(self, limit: int) -> list[int]:
        """Contexts ``t <= limit`` where the bytes may fall below those at ``t - 1``.

        Between them the bytes never decrease: quantized blocks fill (KIVI: every ``block`` tokens
        past the residual), window starts cross a block, sinks leave a sliding window.
        """
        points: set[int] = set()
        for cfg, window, _ in self.groups:
            block = cfg.tail_block
            starts = [cfg.residual_length]
            if window is not None:
                starts.append(window - 1)
                if cfg.sink_tokens:
                    points.add(window - 1 + cfg.sink_tokens)
            if block > 1:
                for s in starts:
                    points.update(range(s + block, limit + 1, block))
        return sorted(p for p in points if 1 <= p <= limit)


class _Peak:
    """Peak bytes over all contexts ``<= t`` at a fixed batch, for a monotone search."""

    def __init__(self, kv: _KVModel, batch: int, limit: int):
        self.kv, self.batch = kv, batch
        self.points = kv.drop_points(limit)
        running, self.before = 0, []
        for p in self.points:
            running = max(running, kv.bytes(p - 1, batch))
            self.before.append(running)

    def __call__(self, t: int) -> int:
        i = bisect.bisect_right(self.points, t)
        earlier = self.before[i - 1] if i else 0
        return max(self.kv.bytes(t, self.batch), earlier)


def max_context(kv: _KVModel, available: int, batch: int, limit: int) -> int:
    """Largest ``t <= limit`` whose peak bytes (over all contexts up to ``t``) fit in ``available``."""
    peak = _Peak(kv, batch, limit)
    if peak(limit) <= available:
        return limit
    lo, hi = 0, limit  # peak(lo) fits (peak(0) == 0), peak(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= available:
            lo = mid
        else:
            hi = mid
    return lo


def max_batch(kv: _KVModel, available: int, context: int) -> int:
    """Largest batch whose peak bytes up to ``context`` fit in ``available`` (bytes scale with batch)."""
    one = _Peak(kv, 1, context)(context)
    if one == 0:
        return -1  # unbounded (nothing cached)
    b = max(available // one, 0)
    # bytes are b x (one sequence), plus a per-layer constant with static scales: step down if needed
    while b and _Peak(kv, b, context)(context) > available:
        b -= 1
    return int(b)


# ------------------------------------------------------------------------------------------ tensor parallel


def tp_split(config: Any, tp: int) -> dict[str, int]:
    """How ``tp`` devices split a decoder's attention heads, as vLLM does it (``LlamaAttention`` in
    vllm/model_executor/models/llama.py, and the other models alike): the query heads must divide by
    ``tp``; KV heads are partitioned when there are at least ``tp`` of them (they must divide by
    ``tp``) and replicated when there are fewer (``tp`` must be a multiple of them): each device then
    holds ``max(1, kv_heads // tp)`` KV heads, each KV head on ``tp // kv_heads`` devices. Other
    splits are refused (``PlanError``), as vLLM refuses them.

    Example:
        >>> from kvquant.models import tiny_config
        >>> tp_split(tiny_config("llama", num_attention_heads=8, num_key_value_heads=2), 4)["kv_heads_per_device"]
        1
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp: expected an integer >= 1, got {tp!r}")
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp:
        raise PlanError(f"tp: {tp} devices do not divide the model's {heads} attention heads")
    if kv >= tp and kv % tp:
        raise PlanError(
            f"tp: {tp} devices do not divide the model's {kv} KV heads (engines partition KV heads "
            f"when tp <= {kv}, so it must divide them)"
        )
    if kv < tp and tp % kv:
        raise PlanError(
            f"tp: {tp} is not a multiple of the model's {kv} KV heads (engines replicate KV heads "
            f"when tp > {kv}, so it must be a multiple)"
        )
    return {
        "tp": tp,
        "kv_heads": kv,
        "kv_heads_per_device": max(1, kv // tp),
        "kv_replication": max(1, tp // kv),
        "attention_heads_per_device": heads // tp,
    }


# ------------------------------------------------------------------------------------------ the plan


def budget(
    config: Any,
    memory_bytes: int,
    weights_dtype: str | float = "bf16",
    reserve: str | int = DEFAULT_RESERVE,
    tp: int = 1,
) -> dict[str, Any]:
    """Weights, reserve and what remains for the KV cache, on one of ``tp`` devices (the weights
    split evenly over them: an estimate, replicated norms and KV projections are not counted twice)."""
    memory_bytes = parse_size(memory_bytes, "memory")
    params = estimate_parameters(config)
    wbytes = int(math.ceil(params * dtype_bytes(weights_dtype, "weights_dtype") / tp))
    rbytes = parse_reserve(reserve, memory_bytes)
    available = memory_bytes - wbytes - rbytes
    if available <= 0:
        raise PlanError(
            f"memory: {human_bytes(memory_bytes)} does not hold the weights ({human_bytes(wbytes)}, {params:,} params "
            f"at {weights_dtype}{f' over {tp} devices' if tp > 1 else ''}) plus the reserve ({human_bytes(rbytes)})"
        )
    text = config.get_text_config(decoder=True)
    return {
        "memory_bytes": memory_bytes,
        "parameters": params,
        "weights_dtype": str(weights_dtype),
        "weights_bytes": wbytes,
        "reserve": str(reserve),
        "reserve_bytes": rbytes,
        "available_bytes": available,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
    }


def plan(
    config: Any,
    memory_bytes: int | str,
    context: int,
    batch: int = 1,
    weights_dtype: str | float = "bf16",
    kv_dtype: str | int = "bf16",
    reserve: str | int = DEFAULT_RESERVE,
    presets: list[str | KVQuantConfig] | None = None,
    tp: int = 1,
) -> list[dict[str, Any]]:
    """One row per preset plus a ``reference`` row (no quantization, ``kv_dtype``).

    With ``tp`` devices (tensor parallel), ``memory_bytes`` is one device's memory and every byte
    figure is per device: its share of the weights and the KV heads it holds (:func:`tp_split`);
    max batch / max context are then those of the whole deployment (each sequence's KV is spread
    over the devices the same way). Rows also carry ``tp``, ``kv_heads_per_device`` and
    ``kv_replication``.

    Each row: ``config``, ``kv_bytes`` (one sequence at ``context``, exactly ``cache.nbytes()``),
    ``kv_bytes_peak`` (max over contexts up to ``context``), ``bytes_per_token``, ``effective_bits``,
    ``max_batch`` (at ``context``), ``max_context`` (at ``batch``; capped at the model's
    ``max_position_embeddings``, then ``max_context_capped`` is True), plus the budget figures.
    """
    if context < 1:
        raise PlanError(f"context: expected an integer >= 1, got {context!r}")
    if batch < 1:
        raise PlanError(f"batch: expected an integer >= 1, got {batch!r}")
    fp_itemsize = dtype_bytes(kv_dtype, "kv_dtype")
    if fp_itemsize != int(fp_itemsize):
        raise PlanError(f"kv_dtype: the cache keeps full-precision tokens in a float dtype, got {kv_dtype!r}")
    fp_itemsize = int(fp_itemsize)
    split = tp_split(config, tp)
    money = budget(config, memory_bytes, weights_dtype, reserve, tp)
    available = money["available_bytes"]
    limit_pos = money["max_position_embeddings"]
    names = list(preset_names()) if presets is None else list(presets)
    configs = []
    for p in names:
        if isinstance(p, KVQuantConfig):
            configs.append((p.name, p))
        elif not is_preset(p):
            raise PlanError(f"presets: unknown preset {p!r}; allowed: {', '.join(preset_names())}")
        else:
            configs.append((p, KVQuantConfig.from_preset(p)))
    ref_label = {1: "fp8", 2: "fp16/bf16", 4: "fp32"}.get(fp_itemsize, f"{fp_itemsize}-byte")
    configs.append(("reference", KVQuantConfig(key_format="none", value_format="none", name="reference")))
    rows = []
    for name, quant in configs:
        kv = _KVModel(config, quant, fp_itemsize, heads=split["kv_heads_per_device"])
        one = kv.bytes(context, 1)
        limit = limit_pos if limit_pos else max(context, batch) * 1024
        mctx = max_context(kv, available, batch, limit)
        elements = kv.held_elements(context, 1)
        rows.append(
            {
                "config": name,
                "label": f"{ref_label} ({kv_dtype})" if name == "reference" else name,
                "context": context,
                "batch": batch,
                "kv_bytes": one,
                "kv_bytes_peak": _Peak(kv, 1, context)(context),
                "bytes_per_token": one / context,
                "effective_bits": 8 * one / elements if elements else float("nan"),
                "max_batch": max_batch(kv, available, context),
                "max_context": mctx,
                "max_context_capped": bool(limit_pos) and mctx == limit_pos,
                **split,
                **money,
            }
        )
    return rows


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units, two decimals; plain bytes below 1 KiB)."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
