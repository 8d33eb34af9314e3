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
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from kvquant.config import KVQuantConfig
from kvquant.formats import FORMAT_NAMES
from kvquant.memory import format_bits, layer_bytes, model_cache_bytes

# nuq2 / nuq3 are left out: tcq2 / tcq3 hold the same bits with less error (kvquant/formats/trellis.py)
MENU: tuple[str, ...] = ("tcq2", "tcq3", "nuq4", "int8")
TENSORS = ("key", "value")
_QUANTIZED_NAMES = tuple(n for n in FORMAT_NAMES if n != "none")  # the formats a tensor can be tuned to
_QUANTIZED = ", ".join(_QUANTIZED_NAMES)
# the recipe of the `*-recent` presets: 2-8 bit old tokens, a 64-token nuq4 window, 4 newest tokens
# and 4 sinks in full precision; 8-bit scales, one per 32 key channels / per value head
DEFAULT_BASE = KVQuantConfig(
    key_format="tcq3",
    value_format="tcq2",
    key_group_size=32,
    rotation="hadamard",
    smoothing="mean",
    scale_dtype="float8_e4m3",
    sink_tokens=4,
    residual_length=4,
    recent_length=64,
    recent_key_format="nuq4",
    recent_value_format="nuq4",
    name="tuned",
)


# ------------------------------------------------------------------------------ decode-mode KL


@dataclass
class Calibration:
    """Prefilled calibration windows: ``ids[W, P + D]``, the prefix's full-precision ``kv`` per
    layer (``None`` when a layer keeps fewer than ``P`` tokens, e.g. sliding windows: then every run
    prefills again), ``first`` (log-probs of prediction 0, ``[W, 1, V]``) and ``reference``
    (the full-precision cache's log-probs ``[W, D, V]``)."""

    ids: torch.Tensor
    prefix_len: int
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None
    first: torch.Tensor
    reference: torch.Tensor | None = field(default=None, repr=False)


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor, prefix_len: int) -> Calibration:
    """Prefill ``ids[W, P + D]``'s prefixes once (full precision) and decode the reference."""
    from transformers import DynamicCache

    if ids.dim() != 2 or not 0 < prefix_len < ids.shape[1]:
        raise ValueError(
            f"ids: expected [windows, tokens] with 0 < prefix_len ({prefix_len}) < tokens; got {tuple(ids.shape)}"
        )
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[:, :prefix_len].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].float().log_softmax(-1).cpu()
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if any(k is None or k.shape[-2] != prefix_len for k, _ in kv):
        kv = None
    calib = Calibration(ids, prefix_len, kv, first)
    calib.reference = _continue(model, calib, cache)
    return calib


def _continue(model: Any, calib: Calibration, cache: Any) -> torch.Tensor:
    """Teacher-force the scored tokens through ``cache`` (already holding the prefix): ``[W, D, V]``."""
    from kvquant.eval.decode import continued_logprobs

    return continued_logprobs(model, calib.ids, calib.prefix_len, cache, calib.first[:, 0])


@torch.no_grad()
def decode_logprobs(model: Any, calib: Calibration, quant: KVQuantConfig) -> torch.Tensor:
    """Log-probs ``[W, D, V]`` of the scored tokens with ``quant``'s cache in the loop (decode mode)."""
    from kvquant.cache import KVQuantCache

    cache = KVQuantCache(model, quant)
    if calib.kv is None:
        device = next(model.parameters()).device
        model(
            input_ids=calib.ids[:, : calib.prefix_len].to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    else:
        for i, (k, v) in enumerate(calib.kv):
            cache.update(k, v, i)
    return _continue(model, calib, cache)


def decode_kl(model: Any, calib: Calibration, quant: KVQuantConfig) -> float:
    """Mean KL (full precision || ``quant``) over the scored predictions, decode mode."""
    from kvquant.eval.quality import kl_per_prediction

    return kl_per_prediction(calib.reference, decode_logprobs(model, calib, quant)).mean().item()


# ------------------------------------------------------------------------------ formats and bytes


def tensor_fields(base: KVQuantConfig, which: str, fmt: str) -> dict[str, str]:
    """The override fields that put ``which``'s (``key`` / ``value``) old tokens in ``fmt``; the
    recent window follows when ``fmt`` has more bits than it."""
    out = {f"{which}_format": fmt}
    recent = getattr(base, f"recent_{which}_format")
    if base.recent_length and fmt != "none":
        probe = dataclasses.replace(base, layer_overrides={}, key_format=fmt, value_format=fmt)
        other = dataclasses.replace(probe, key_format=recent, value_format=recent)
        if format_bits(probe, which, 64) > format_bits(other, which, 64):
            out[f"recent_{which}_format"] = fmt
    return out


def _layer_cfg(base: KVQuantConfig, key: str, value: str) -> KVQuantConfig:
    fields = {**tensor_fields(base, "key", key), **tensor_fields(base, "value", value)}
    return dataclasses.replace(base, layer_overrides={}, **fields)


def _geometry(model_config: Any) -> tuple[int, int, int]:
    text = model_config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def tensor_costs(
    base: KVQuantConfig, formats: tuple[str, ...], heads: int, head_dim: int, tokens: int
) -> tuple[int, dict[str, dict[str, int]]]:
    """``(layer bytes with both tensors on base's formats, {tensor: {format: bytes added}})`` after
    ``tokens`` positions at 16 bits per full-precision element; a layer's bytes are the first plus
    one added cost per tensor (checked by the tests: the tensors' stores are independent)."""

    def size(k: str, v: str) -> int:
        return layer_bytes(_layer_cfg(base, k, v), tokens, 1, heads, head_dim, 2)["total"]

    ref = size(base.key_format, base.value_format)
    costs = {
        "key": {f: size(f, base.value_format) - ref for f in formats},
        "value": {f: size(base.key_format, f) - ref for f in formats},
    }
    return ref, costs


def config_bits(cfg: KVQuantConfig, model_config: Any, tokens: int) -> float:
    """``bits @16-bit`` of ``cfg``'s cache after ``tokens`` positions, as ``kvquant eval`` reports it
    (sliding-window layers hold their window only; the denominator is every layer at 16 bits)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    layers, heads, head_dim = _geometry(model_config)
    types, kwargs = get_layer_types_and_kwargs(model_config.get_text_config(decoder=True))
    windows = [kw.get("sliding_window") for kw in kwargs]
    total = model_cache_bytes(cfg, types, windows, tokens, 1, heads, head_dim, 2)
    return 16.0 * total / (tokens * layers * heads * head_dim * 2 * 2)


# ------------------------------------------------------------------------------ allocation


def allocate(
    items: list[dict[str, tuple[float, float]]],
    *,
    budget_cost: float | None = None,
    budget_kl: float | None = None,
) -> tuple[list[str], bool]:
    """Exact multiple-choice knapsack: one option per item, ``items[j][option] = (cost, kl)``.

    With ``budget_cost``: the least total KL whose total cost is at most it; with ``budget_kl``:
    the least cost whose KL is at most it (else the least KL there is). Returns
    ``(option per item, whether the budget is met)``; exactly one budget must be given.
    """
    if (budget_kl is None) == (budget_cost is None):
        raise ValueError("budget: give exactly one of budget_kl or budget_bits")
    if not items or any(not opts for opts in items):
        raise ValueError("allocate: every item needs at least one option")
    min_rest = np.cumsum([min(c for c, _ in opts.values()) for opts in items][::-1])[::-1].tolist() + [0.0]
    if budget_cost is not None and min_rest[0] > budget_cost + 1e-9:
        return [min(opts, key=lambda o: opts[o][0]) for opts in items], False
    costs, kls = np.zeros(1), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
    for j, opts in enumerate(items):
        names = list(opts)
        oc = np.array([opts[n][0] for n in names], dtype=np.float64)
        ok = np.array([opts[n][1] for n in names], dtype=np.float64)
        c = (costs[:, None] + oc[None]).ravel()
        k = (kls[:, None] + ok[None]).ravel()
        order = np.lexsort((k, c))  # by cost, then KL
        c, k = c[order], k[order]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], k[:-1]]))
        keep = k < best_before  # the Pareto front: strictly less KL than anything as cheap
        if budget_cost is not None:
            keep &= c + min_rest[j + 1] <= budget_cost + 1e-9
        idx = order[keep]
        back.append((idx // len(names), idx % len(names), names))
        costs, kls = c[keep], k[keep]
    if budget_cost is not None:
        pick, met = len(costs) - 1, True  # the front's KL falls as cost rises: the last is the best
    else:
        within = np.nonzero(kls <= budget_kl)[0]
        pick, met = (int(within[0]), True) if len(within) else (len(costs) - 1, False)
    choice: list[str] = []
    for prev, opt, names in reversed(back):
        choice.append(names[int(opt[pick])])
        pick = int(prev[pick])
    return choice[::-1], met


# ------------------------------------------------------------------------------ the search


@dataclass
class TuneResult:
    """What :func:`tune` found.

    ``formats[tensor][i]``: layer ``i``'s key / value format; ``sensitivity[tensor][fmt][i]``: the
    decode-mode KL with only that tensor of layer ``i`` in ``fmt``; ``bits``: ``bits @16-bit`` after
    ``bits_tokens`` positions; ``measured``: decode-mode KL on the calibration windows of the result
    and of the uniform configs it was checked against (``verify``).
    """

    config: KVQuantConfig
    formats: dict[str, list[str]]
    predicted_kl: float
    bits: float
    bits_tokens: int
    sensitivity: dict[str, dict[str, list[float]]]
    met: bool
    measured: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    pinned: dict[str, dict[int, str]] = field(default_factory=dict)
    kv_heads: int = 1  # units per layer: 1, or the KV heads of a per-head run

    def table(self) -> str:
        """One line per layer (per ``layer.head`` in a per-head run): its formats and the KL each
        tensor adds in them (``pinned``: kept in that format by the caller; ``-``: a format outside
        the measured menu)."""
        per = self.kv_heads
        lines = [("layer" if per == 1 else " head") + "  key   value   KL(key)   KL(value)"]
        for u, (k, v) in enumerate(zip(self.formats["key"], self.formats["value"], strict=True)):
            cells = []
            for t, f in (("key", k), ("value", v)):
                kl = self.sensitivity[t].get(f)
                cells.append(f"{kl[u]:8.5f}" if kl is not None else f"{'-':>8s}")
            pins = [t for t in TENSORS if u // per in self.pinned.get(t, {})]
            label = f"{u:5d}" if per == 1 else f"{f'{u // per}.{u % per}':>5s}"
            lines.append(
                f"{label}  {k:5s} {v:5s}  {cells[0]}  {cells[1]}"
                + (f"  pinned: {', '.join(pins)}" if pins else "")
            )
        return "\n".join(lines)

    def summary(self) -> str:
        mix = {t: ", ".join(f"{f} x{n}" for f, n in Counter(self.formats[t]).most_common()) for t in TENSORS}
        state = "meets" if self.met else "does NOT meet"
        unit = "" if self.kv_heads == 1 else " (per KV head)"
        out = (
            f"keys{unit}: {mix['key']}; values: {mix['value']}; {self.bits:.3f} bits @16-bit at "
            f"{self.bits_tokens} tokens; predicted KL {self.predicted_kl:.4g} (additive) — {state} the budget"
        )
        for t, layer_formats in self.pinned.items():
            out += f"\npinned {t}s: " + ", ".join(f"layer {i} {f}" for i, f in layer_formats.items())
        if self.measured:
            out += "\nmeasured on the calibration windows (decode mode): " + ", ".join(
                f"{name} KL {kl:.4g}" for name, kl in self.measured.items()
            )
        return "\n".join([out, *self.notes])

    def write_yaml(self, path: str | Path, header: str = "") -> str:
        """Write the config with ``header`` and the allocation as YAML comments; returns the text."""
        lines = [f"# {h}" if h else "#" for h in header.splitlines()]
        lines += ["# " + line for line in self.summary().splitlines()]
        lines += ["# " + line for line in self.table().splitlines()]
        text = "\n".join(lines) + "\n" + self.config.to_yaml()
        Path(path).write_text(text)
        return text


def _fields_over(base: KVQuantConfig, ref: KVQuantConfig, key: str, value: str) -> dict[str, str]:
    """The fields that turn ``ref`` (what a layer or head inherits) into ``key`` / ``value`` formats
    (a recent window that followed ``ref``'s format falls back to ``base``'s)."""
    fields = {**tensor_fields(base, "key", key), **tensor_fields(base, "value", value)}
    fields = {f: v for f, v in fields.items() if getattr(ref, f) != v}
    for t in TENSORS:
        rf = f"recent_{t}_format"
        if rf not in fields and getattr(ref, rf) != getattr(base, rf) and f"{t}_format" in fields:
            fields[rf] = getattr(base, rf)
    return fields


def build_config(
    base: KVQuantConfig, formats: dict[str, list[str]], name: str = "tuned", kv_heads: int = 1
) -> KVQuantConfig:
    """``base`` with each tensor's most common format as its default and the rest as overrides.
    ``formats[tensor]``: one per layer, or (``kv_heads`` > 1) one per KV head, ``i * kv_heads + h``:
    a layer then takes its heads' most common formats, and the heads that differ head overrides."""
    common = {t: Counter(formats[t]).most_common(1)[0][0] for t in TENSORS}
    top = {**tensor_fields(base, "key", common["key"]), **tensor_fields(base, "value", common["value"])}
    cfg = dataclasses.replace(base, layer_overrides={}, heads={}, name=name, **top)
    overrides: dict[int, dict[str, Any]] = {}
    for i in range(len(formats["key"]) // kv_heads):
        units = range(i * kv_heads, (i + 1) * kv_heads)
        layer = {t: Counter(formats[t][u] for u in units).most_common(1)[0][0] for t in TENSORS}
        fields: dict[str, Any] = _fields_over(base, cfg, layer["key"], layer["value"])
        layer_cfg = dataclasses.replace(cfg, **fields)
        heads = {
            h: over
            for h, u in enumerate(units)
            if (over := _fields_over(base, layer_cfg, formats["key"][u], formats["value"][u]))
        }
        if heads:
            fields["heads"] = heads
        if fields:
            overrides[i] = fields
    return dataclasses.replace(cfg, layer_overrides=overrides)


def _off(base: KVQuantConfig, which: str) -> dict[str, str]:
    """Fields that leave ``which`` unquantized (its recent window, which cannot be off: int8)."""
    return {f"{which}_format": "none", f"recent_{which}_format": "int8"}


def probe_config(
    base: KVQuantConfig, which: str, fmt: str, main_only: bool = False, head: int | None = None
) -> KVQuantConfig:
    """One layer's config with only ``which`` (``key`` / ``value``) quantized, in ``fmt``; with
    ``main_only`` only its main store (the recent window in int8); with ``head``, only that KV head's
    (the layer's other heads as the other tensor: off)."""
    other = "value" if which == "key" else "key"
    fields = tensor_fields(base, which, fmt)
    if main_only and base.recent_length:
        fields[f"recent_{which}_format"] = "int8"
    if head is None:
        return dataclasses.replace(base, layer_overrides={}, heads={}, **_off(base, other), **fields)
    off = {**_off(base, "key"), **_off(base, "value")}
    return dataclasses.replace(base, layer_overrides={}, **off, heads={head: {**_off(base, other), **fields}})


class _RowGroups(CacheLayerMixin):
    """A cache layer whose batch rows are split over several layers (``parts``: ``(start, stop,
    layer)``, contiguous, in order): each group of rows is stored in its own format."""

    is_sliding = False

    def __init__(self, parts: list[tuple[int, int, Any]]):
        super().__init__()
        self.parts = parts
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        outs = [
            layer.update(key_states[a:b], value_states[a:b], *args, **kwargs) for a, b, layer in self.parts
        ]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def get_seq_length(self) -> int:
        return self.parts[0][2].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0][2].get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1


@torch.no_grad()
def _probe_batch(
    model: Any,
    calib: Calibration,
    base: KVQuantConfig,
    jobs: list[tuple],
    main_only: bool = False,
) -> list[float]:
    """Decode-mode KL of each job ``(tensor, format, layer)`` or ``(tensor, format, layer, kv_head)``,
    all in one batch: job ``g`` owns rows ``g * W .. (g + 1) * W`` (the ``W`` windows), where only its
    tensor of its layer (of its head) is quantized."""
    from transformers import Cache, DynamicLayer

    from kvquant.cache.factory import make_layer
    from kvquant.eval.quality import kl_per_prediction

    w, g_count = calib.ids.shape[0], len(jobs)
    quantized: dict[int, dict[int, KVQuantConfig]] = {}
    for g, (which, fmt, i, *head) in enumerate(jobs):
        quantized.setdefault(i, {})[g] = probe_config(base, which, fmt, main_only, *head)

    def dense(k: torch.Tensor, v: torch.Tensor) -> Any:
        layer = DynamicLayer()
        layer.update(k, v)
        return layer

    layers = []
    for j, (k, v) in enumerate(calib.kv):
        if j not in quantized:
            layers.append(dense(k.repeat(g_count, 1, 1, 1), v.repeat(g_count, 1, 1, 1)))
            continue
        parts, g = [], 0
        while g < g_count:
            if g in quantized[j]:
                layer = make_layer(quantized[j][g], layer_idx=j, kv_heads=k.shape[1])
                layer.update(k, v)
                parts.append((g * w, (g + 1) * w, layer))
                g += 1
            else:
                stop = g
                while stop < g_count and stop not in quantized[j]:
                    stop += 1
                parts.append(
                    (g * w, stop * w, dense(k.repeat(stop - g, 1, 1, 1), v.repeat(stop - g, 1, 1, 1)))
                )
                g = stop
        layers.append(_RowGroups(parts))
    cache = Cache(layers=layers)
    grouped = Calibration(
        calib.ids.repeat(g_count, 1), calib.prefix_len, None, calib.first.repeat(g_count, 1, 1)
    )
    kl = kl_per_prediction(calib.reference.repeat(g_count, 1, 1), _continue(model, grouped, cache))
    return kl.view(g_count, -1).mean(-1).tolist()


@torch.no_grad()
def stored_error(
    calib: Calibration,
    base: KVQuantConfig,
    which: str,
    fmt: str,
    layer: int,
    main_only: bool = False,
    head: int | None = None,
) -> float:
    """Squared error of ``which`` (keys / values) of ``layer``'s prefix (of KV head ``head`` alone,
    when given) as the cache stores them in ``fmt`` (every tier: sinks, main store, recent window,
    residual), summed over the windows."""
    from kvquant.cache.factory import make_layer

    k, v = calib.kv[layer]
    cfg = probe_config(base, which, fmt, main_only, head)
    store = make_layer(cfg, layer_idx=layer, kv_heads=k.shape[1])
    store.update(k, v)
    keys, values = store.update(k[:, :, -1:], v[:, :, -1:])  # reads every stored token back
    got, want = (keys, k) if which == "key" else (values, v)
    err = (got[:, :, : want.shape[2]].float() - want.float()).pow(2)  # [W, H, P, D]
    return (err if head is None else err[:, head]).sum().item()


# KL of a tensor grows more slowly than the squared error of its stored prefix: on SmolLM2 (decode mode,
# 4 x (1,024 + 64) embedded-corpus windows, base tcq3v2-recent, every layer measured in every format)
# log(KL_f / KL_tcq2) / log(e_f / e_tcq2) over the 30 layers: keys tcq3 0.73, nuq4 0.58, int8 0.81;
# values 0.64 / 0.54 / 0.61; 0.70 fitted over all. An approximation: ``measure="all"`` is the reference
SCALING_POWER = 0.7


def tensor_sensitivity(
    model: Any,
    calib: Calibration,
    base: KVQuantConfig,
    formats: tuple[str, ...],
    *,
    measure: str = "all",
    group: int = 10,
    progress: bool = False,
    per_head: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """``{tensor: {format: [decode-mode KL with only that tensor of layer i in that format]}}``
    (``per_head``: of unit ``i * kv_heads + h``, KV head ``h`` of layer ``i``, alone).

    ``measure="all"``: every (layer, tensor, format) teacher-forced through the cache (decode mode),
    ``group`` probes per batch. ``measure="scaled"`` (``len(formats)`` times faster): each (layer,
    tensor) is measured so with its main store in the coarsest format of the menu (its recent window
    in int8), and its KL in format ``f`` is that KL times ``(e_f / e_coarse) ** SCALING_POWER``,
    ``e`` the squared error of the calibration prefix as the cache stores it (``e_f``: every tier,
    the recent window included; ``e_coarse``: the main store's alone).
    """
    from tqdm.auto import tqdm

    if measure not in ("scaled", "all"):
        raise ValueError(f"measure: invalid value {measure!r}; allowed: scaled, all")
    if calib.kv is None:
        raise ValueError("model: the tuner needs every layer to keep the whole prefix (no sliding windows)")
    layers, kv_heads = _geometry(model.config)[:2]
    units = (
        [(i, h) for i in range(layers) for h in range(kv_heads)]
        if per_head
        else [(i,) for i in range(layers)]
    )
    out = {t: {f: [0.0] * len(units) for f in formats} for t in TENSORS}
    coarse = min(formats, key=lambda f: format_bits(probe_config(base, "key", f), "key", 64))
    probed = formats if measure == "all" else (coarse,)
    jobs = [(t, f, *unit) for f in probed for t in TENSORS for unit in units]
    at = {unit: u for u, unit in enumerate(units)}
    batches = [jobs[a : a + group] for a in range(0, len(jobs), group)]
    scaled = measure == "scaled"
    for batch in tqdm(
        batches, desc=f"sensitivity (decode mode, {group} probes a batch)", disable=not progress
    ):
        for (t, f, *unit), kl in zip(batch, _probe_batch(model, calib, base, batch, scaled), strict=True):
            out[t][f][at[tuple(unit)]] = kl
    if scaled:
        for t in TENSORS:
            for u, (i, *head) in enumerate(units):
                ref = max(stored_error(calib, base, t, coarse, i, True, *head), 1e-30)
                kl = out[t][coarse][u]
                for f in formats:
                    out[t][f][u] = (
                        kl * (stored_error(calib, base, t, f, i, False, *head) / ref) ** SCALING_POWER
                    )
    return out


def save_sensitivity(path: str | Path, sensitivity: dict[str, dict[str, list[float]]]) -> None:
    """Write measurements as JSON (reload with :func:`load_sensitivity`)."""
    import json

    Path(path).write_text(json.dumps(sensitivity, indent=1))


def load_sensitivity(
    path: str | Path, formats: tuple[str, ...], layers: int
) -> dict[str, dict[str, list[float]]]:
    """Measurements written by :func:`save_sensitivity`; ``ValueError`` if they miss a format or
    layer. ``layers``: the units measured (layers, or layers x KV heads for a per-head run)."""
    import json

    data = json.loads(Path(path).read_text())
    for t in TENSORS:
        for f in formats:
            got = data.get(t, {}).get(f)
            if not isinstance(got, list) or len(got) != layers:
                raise ValueError(f"sensitivity: {str(path)!r} holds no {t} {f} for {layers} layers")
    return data


def check_base(base: KVQuantConfig | str | None) -> KVQuantConfig:
    """``base`` resolved (default :data:`DEFAULT_BASE`), its ``layer_overrides`` and
    ``retrieval_layers`` dropped (the tuner places every layer's formats itself; ``--pin`` keeps
    layers); ``ValueError`` naming ``base`` when the tuner cannot vary it per layer (per-channel keys)."""
    cfg = DEFAULT_BASE if base is None else KVQuantConfig.resolve(base)
    if cfg.key_axis != "token":
        raise ValueError(f"base: key_axis {cfg.key_axis!r}; the tuner needs 'token'")
    return dataclasses.replace(cfg, layer_overrides={}, heads={}, retrieval_layers=0, name="tuned")


def check_formats(formats: tuple[str, ...]) -> tuple[str, ...]:
    """The menu without repeats; ``ValueError`` naming the first format that is not a quantized one."""
    if not formats:
        raise ValueError(f"formats: empty; allowed: {_QUANTIZED}")
    for f in formats:
        if f not in _QUANTIZED_NAMES:
            raise ValueError(f"formats: invalid value {f!r}; allowed: {_QUANTIZED}")
    return tuple(dict.fromkeys(formats))


def check_pins(pinned: dict[str, dict[int, str]] | None, layers: int) -> dict[str, dict[int, str]]:
    """``{tensor: {layer: format}}`` checked: tensors ``key`` / ``value``, layers ``0..layers-1``,
    quantized formats; ``ValueError`` naming the first that is not."""
    out: dict[str, dict[int, str]] = {}
    for t, layer_formats in (pinned or {}).items():
        if t not in TENSORS:
            raise ValueError(f"pinned: invalid tensor {t!r}; allowed: key, value")
        for i, f in layer_formats.items():
            if not isinstance(i, int) or not 0 <= i < layers:
                raise ValueError(f"pinned: invalid {t} layer {i!r}; allowed: 0..{layers - 1}")
            if f not in _QUANTIZED_NAMES:
                raise ValueError(f"pinned: invalid {t} format {f!r} at layer {i}; allowed: {_QUANTIZED}")
        if layer_formats:
            out[t] = dict(sorted(layer_formats.items()))
    return out


def pins_from_config(cfg: KVQuantConfig) -> dict[str, dict[int, str]]:
    """The per-layer key / value formats of ``cfg``'s ``layer_overrides`` as pins (e.g. the output of
    ``kvquant calibrate --retrieval``); ``ValueError`` when it has none."""
    pins = {
        t: {int(i): ov[f"{t}_format"] for i, ov in cfg.layer_overrides.items() if f"{t}_format" in ov}
        for t in TENSORS
    }
    pins = {t: p for t, p in pins.items() if p}
    if not pins:
        raise ValueError(f"pin: config {cfg.name!r} has no layer_overrides with a key_format or value_format")
    return pins


def tune(
    model: Any,
    calib: Calibration,
    *,
    budget_bits: float | None = None,
    budget_kl: float | None = None,
    base: KVQuantConfig | str | None = None,
    formats: tuple[str, ...] = MENU,
    bits_tokens: int | None = None,
    verify: bool = True,
    sensitivity: dict[str, dict[str, list[float]]] | None = None,
    measure: str = "all",
    pinned: dict[str, dict[int, str]] | None = None,
    progress: bool = False,
    per_head: bool = False,
) -> TuneResult:
    """Per-layer key / value formats for ``calib``'s windows (see the module docstring).

    Args:
        budget_bits: largest ``bits @16-bit`` (everything the cache holds after ``bits_tokens``).
        budget_kl: largest predicted mean KL; the fewest bits meeting it. Exactly one budget.
        base: shared settings (rotation, smoothing, groups, scales, sinks, windows); default
            :data:`DEFAULT_BASE`. Its ``layer_overrides`` are ignored.
        formats: the menu, each a quantized format of :data:`kvquant.formats.FORMAT_NAMES`.
        bits_tokens: positions at which bits are counted (default: the end of a window).
        verify: measure the result and the best uniform configs within its bits jointly and keep
            the lowest (decode mode, calibration windows).
        sensitivity: reuse a previous result's measurements (same model, windows, base, menu).
        measure: ``scaled`` or ``all`` (see :func:`tensor_sensitivity`).
        pinned: ``{tensor: {layer: format}}`` kept as given (any quantized format); their bytes
            count against ``budget_bits``, their KL (when measured) against ``budget_kl``.
        per_head: allocate over (layer, KV head) pairs, not layers (see the module docstring);
            ``sensitivity`` then holds one value per pair.
    """
    base_cfg = check_base(base)
    formats = check_formats(formats)
    layers, heads, head_dim = _geometry(model.config)
    pins = check_pins(pinned, layers)
    tokens = calib.ids.shape[1] - 1 if bits_tokens is None else bits_tokens
    if tokens < 1:
        raise ValueError(f"bits_tokens: expected an integer >= 1, got {tokens}")
    priced = tuple(dict.fromkeys([*formats, *(f for p in pins.values() for f in p.values())]))
    ref, costs = tensor_costs(base_cfg, priced, heads, head_dim, tokens)
    fp16 = tokens * heads * head_dim * 2 * 2  # 16-bit K + V bytes of one layer
    sens = sensitivity or tensor_sensitivity(
        model, calib, base_cfg, formats, measure=measure, progress=progress, per_head=per_head
    )
    per = heads if per_head else 1  # units per layer
    plan = _Plan(layers, ref, fp16, costs, sens, pins, per)
    items = [
        {
            f: (costs[t][f] / per, plan.kl(t, f, u))
            for f in ((pins[t][u // per],) if u // per in pins.get(t, {}) else formats)
        }
        for u in range(layers * per)
        for t in TENSORS
    ]
    budget_cost = None if budget_bits is None else budget_bits * layers * fp16 / 16 - layers * ref
    choice, met = allocate(items, budget_cost=budget_cost, budget_kl=budget_kl)
    chosen = {t: choice[j::2] for j, t in enumerate(TENSORS)}
    cfg = build_config(base_cfg, chosen, kv_heads=per)
    result = TuneResult(
        cfg,
        chosen,
        plan.predicted(chosen),
        config_bits(cfg, model.config, tokens),
        tokens,
        sens,
        met,
        pinned=pins,
        kv_heads=per,
    )
    if not met:
        result.notes.append("the budget is out of the menu's reach: the nearest allocation is returned")
    if verify and met:
        _verify(model, calib, base_cfg, formats, plan, result)
    return result


@dataclass
class _Plan:
    """Costs and measured KL of allocations: ``layers`` layers of ``ref`` bytes (both tensors on the
    base's formats) plus each tensor's added cost; ``fp16``: one layer's 16-bit bytes."""

    layers: int
    ref: int
    fp16: int
    costs: dict[str, dict[str, int]]
    sens: dict[str, dict[str, list[float]]]
    pins: dict[str, dict[int, str]]
    per: int = 1  # units per layer (KV heads in a per-head run), each 1 / per of a layer's cost

    def kl(self, t: str, f: str, u: int) -> float:
        measured = self.sens[t].get(f)
        return measured[u] if measured is not None else 0.0  # a pin outside the menu: not measured

    def uniform(self, k: str, v: str) -> dict[str, list[str]]:
        """Every unit on ``k`` / ``v``, the pins excepted."""
        return {
            t: [self.pins.get(t, {}).get(u // self.per, f) for u in range(self.layers * self.per)]
            for t, f in (("key", k), ("value", v))
        }

    def bits(self, chosen: dict[str, list[str]]) -> float:
        added = sum(self.costs[t][f] for t in TENSORS for f in chosen[t]) / self.per
        return 16 * (self.layers * self.ref + added) / (self.layers * self.fp16)

    def predicted(self, chosen: dict[str, list[str]]) -> float:
        return sum(self.kl(t, f, i) for t in TENSORS for i, f in enumerate(chosen[t]))


def _verify(model, calib, base, formats, plan: _Plan, result: TuneResult) -> None:  # noqa: ANN001
    """Measure the result and the (up to two) best-predicted uniform configs within its bits (with
    the same pins); keep the lowest."""
    uniform = [(k, v, plan.uniform(k, v)) for k in formats for v in formats]
    within = sorted(
        (u for u in uniform if plan.bits(u[2]) <= result.bits + 1e-9), key=lambda u: plan.predicted(u[2])
    )
    result.measured["tuned"] = best = decode_kl(model, calib, result.config)
    for k, v, chosen in within[:2]:
        cfg = build_config(base, chosen, kv_heads=plan.per)
        label = f"uniform {k}/{v}" + (" with the pins" if plan.pins else "")
        kl = result.measured[label] = decode_kl(model, calib, cfg)
        if kl < best:
            best = kl
            result.config, result.formats = cfg, chosen
            result.predicted_kl = plan.predicted(chosen)
            result.bits = config_bits(cfg, model.config, result.bits_tokens)
            result.notes.append(f"the {label} measured lower than the allocation: returned instead")
