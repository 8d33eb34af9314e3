"""The tuner's sensitivities: the decode-mode KL with one tensor of one layer (or of one KV head)
quantized and everything else in full precision, many probes in one batch (:func:`_probe_batch`), or
scaled from the coarsest format by the stored error (:func:`tensor_sensitivity`).

Example:
    >>> sens = tensor_sensitivity(model, calib, DEFAULT_BASE, ("tcq2", "nuq4"))
    >>> sens["key"]["tcq2"][18]                                     # KL with only layer 18's keys in tcq2
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvquant.config import KVQuantConfig
from kvquant.memory import format_bits
from kvquant.tools.tune.costs import TENSORS, kv_geometry_of, tensor_fields
from kvquant.tools.tune.kl import Calibration, continue_kl


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
    kl = kl_per_prediction(calib.reference.repeat(g_count, 1, 1), continue_kl(model, grouped, cache))
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
    layers, kv_heads = kv_geometry_of(model.config)[:2]
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
