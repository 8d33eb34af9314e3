"""The tuner itself: :func:`tune` (sensitivities -> allocation -> config -> check), its result
(:class:`TuneResult`), the config an allocation becomes (:func:`build_config`) and the checks of its
arguments.

Example:
    >>> result = tune(model, prefill(model, ids, 1024), budget_bits=3.0)
    >>> result.write_yaml("tuned.yaml")
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvquant.config import KVQuantConfig
from kvquant.tools.tune.allocate import Plan, allocate
from kvquant.tools.tune.costs import (
    DEFAULT_BASE,
    MENU,
    QUANTIZED,
    QUANTIZED_NAMES,
    TENSORS,
    config_bits,
    kv_geometry_of,
    tensor_costs,
    tensor_fields,
)
from kvquant.tools.tune.kl import Calibration, decode_kl
from kvquant.tools.tune.probes import tensor_sensitivity


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
        raise ValueError(f"formats: empty; allowed: {QUANTIZED}")
    for f in formats:
        if f not in QUANTIZED_NAMES:
            raise ValueError(f"formats: invalid value {f!r}; allowed: {QUANTIZED}")
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
            if f not in QUANTIZED_NAMES:
                raise ValueError(f"pinned: invalid {t} format {f!r} at layer {i}; allowed: {QUANTIZED}")
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
    layers, heads, head_dim = kv_geometry_of(model.config)
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
    plan = Plan(layers, ref, fp16, costs, sens, pins, per)
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


def _verify(model, calib, base, formats, plan: Plan, result: TuneResult) -> None:  # noqa: ANN001
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
