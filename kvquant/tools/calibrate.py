"""Calibration passes: static per-(layer, head) int8 / fp8 scales, and key maps.

**Static scales** (:func:`calibrate_static_scales`).

Run the model over calibration text with a full-precision cache, take each layer's per-head
maximum ``|k|`` and ``|v|`` as the cache stores them (through the config's key transform: rotation
and smoothing, fitted per window as the cache fits it on a prompt), and divide by the format's largest
code. With ``static_scales: <file>`` in a config the store then holds codes
only: no per-token scales (values beyond the calibrated range are clipped).

Example:
    >>> ids = tok(text, return_tensors="pt").input_ids[:, :4096]
    >>> calibrate_static_scales(model, ids, KVQuantConfig.resolve("int8"), "int8-scales.pt")
    >>> cfg = KVQuantConfig(key_format="int8", value_format="int8", static_scales="int8-scales.pt")
    >>> cache = KVQuantCache(model, cfg)

**Key maps** (:func:`calibrate_key_map`, :mod:`kvquant.key_map`): run the model over calibration
text and record, per layer and KV head, the second moments of the keys as the cache would transform
them (smoothed, not rotated; sinks excluded) and of the queries, each weighted by how much it moves
the attention output: a key ``j`` by ``sum_t p_tj^2 |v_j - o_t|^2`` over the queries ``t`` that see it
quantized (past the sinks and the ``residual_length`` newest tokens), a query by the same sum over
its keys. Those two moments give the map (:func:`kvquant.key_map.fit_key_map`).

    >>> maps = calibrate_key_map(model, ids, KVQuantConfig.resolve("nuq4"), "km.pt")
    >>> cache = KVQuantCache(model, dataclasses.replace(KVQuantConfig.resolve("nuq4"), key_map="km.pt"))
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from kvquant.attention import kvquant_attention_forward
from kvquant.config import KVQuantConfig
from kvquant.formats import format_spec
from kvquant.key_map import DEFAULT_EXPONENT, fit_key_map, save_key_map
from kvquant.transforms import KeyTransform

_RECORDER = "kvquant_key_map_recorder"
_QUERY_CHUNK = 128  # queries whose attention weights are formed at once


@torch.no_grad()
def calibrate_static_scales(
    model,
    input_ids: torch.Tensor,
    config: KVQuantConfig,
    out_path: str | Path | None = None,
    *,
    window: int = 1024,
    margin: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Per-(layer, head) static scales ``{"keys": [L, H], "values": [L, H]}`` (fp32).

    Args:
        input_ids: ``[1, N]`` calibration tokens, run in windows of ``window`` tokens.
        config: decides the formats (their largest code) and whether heads are rotated first.
        margin: multiplies the observed maximum (> 1 leaves headroom for unseen outliers).
    """
    for f in ("key_format", "value_format"):
        spec = format_spec(getattr(config, f))
        if not (spec.takes_static_scale and spec.has_scale):
            raise ValueError(f"{f}: static scales need int8 or fp8, got {getattr(config, f)!r}")
    if margin <= 0:
        raise ValueError(f"margin: must be > 0, got {margin}")
    text_config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    amax_k: list[torch.Tensor | None] = [None] * text_config.num_hidden_layers
    amax_v: list[torch.Tensor | None] = [None] * text_config.num_hidden_layers
    for start in range(0, input_ids.shape[1], window):
        chunk = input_ids[:, start : start + window].to(device)
        cache = DynamicCache(config=model.config)
        model(input_ids=chunk, cache=cache, use_cache=True)
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            k, v = layer.keys.float(), layer.values.float()  # [B, H, T, D]
            transform = KeyTransform(config.rotation, config.smoothing, config.torch_scale_dtype)
            own = (torch.arange(k.shape[2], device=k.device) >= config.sink_tokens).float()
            transform.fit(k, own.view(1, 1, -1, 1))  # sinks excluded, as the layer fits it
            k, v = transform.apply(k, v)
            mk, mv = k.abs().amax(dim=(0, 2, 3)).cpu(), v.abs().amax(dim=(0, 2, 3)).cpu()  # [H]
            amax_k[i] = mk if amax_k[i] is None else torch.maximum(amax_k[i], mk)
            amax_v[i] = mv if amax_v[i] is None else torch.maximum(amax_v[i], mv)
    heads = next(a.shape[0] for a in amax_k if a is not None)
    fill = torch.ones(heads)
    qk = format_spec(config.key_format).qmax
    qv = format_spec(config.value_format).qmax
    keys = torch.stack([(a if a is not None else fill) * margin / qk for a in amax_k])
    values = torch.stack([(a if a is not None else fill) * margin / qv for a in amax_v])
    keys, values = keys.clamp_min(1e-8), values.clamp_min(1e-8)  # a never-seen head: never a zero scale
    result = {"keys": keys, "values": values}
    if out_path is not None:
        torch.save(result, Path(out_path))
    return result


class _MomentRecorder:
    """Sums of the weighted key / query second moments of each layer (see the module docstring)."""

    def __init__(self, config: KVQuantConfig, first_query: int):
        self.config = config
        self.first_query = first_query
        self.sums: dict[int, list[torch.Tensor]] = {}  # layer -> [C num, C den, Q num, Q den]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        with torch.no_grad():
            self.record(module.layer_idx, query, key, value, scaling, kwargs.get("sliding_window"))
        return kvquant_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def record(self, layer: int, query, key, value, scaling: float | None, window: int | None) -> None:
        cfg = self.config
        b, hq, n, d = query.shape
        hk = key.shape[1]
        g = hq // hk
        scaling = d**-0.5 if scaling is None else scaling
        k, v, q = key.float(), value.float(), query.float()
        pos = torch.arange(n, device=k.device)
        transform = KeyTransform("none", cfg.smoothing, cfg.torch_scale_dtype)
        transform.fit(k, (pos >= cfg.sink_tokens).float().view(1, 1, -1, 1))  # as the layer fits it
        ks = transform.apply(k, v, rotate=False)[0].float()  # [B, Hk, n, D]
        std = None if transform.stats is None else transform.stats[1]
        qs = q if std is None else q * std.float().repeat_interleave(g, 1)  # [B, Hq, n, D], as folded
        sums = self.sums.setdefault(
            layer, [torch.zeros(hk, d, d), torch.zeros(hk), torch.zeros(hk, d, d), torch.zeros(hk)]
        )
        kr = k.repeat_interleave(g, 1)
        vr = v.repeat_interleave(g, 1)
        for t0 in range(self.first_query, n, _QUERY_CHUNK):
            t = pos[t0 : t0 + _QUERY_CHUNK, None]  # [c, 1]
            scores = (q[:, :, t0 : t0 + _QUERY_CHUNK] @ kr.transpose(-1, -2)) * scaling  # [B, Hq, c, n]
            hidden = pos[None] > t
            if window is not None:
                hidden = hidden | (pos[None] <= t - window)
            p = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            o = p @ vr  # [B, Hq, c, D]
            spread = (
                vr.pow(2).sum(-1)[:, :, None] - 2 * o @ vr.transpose(-1, -2) + o.pow(2).sum(-1, keepdim=True)
            )
            quantized = (pos[None] >= cfg.sink_tokens) & (pos[None] < t - cfg.residual_length)  # [c, n]
            w = (p.pow(2) * spread.clamp_min(0)).masked_fill(~quantized, 0)  # [B, Hq, c, n]
            per_key = w.sum(2).view(b, hk, g, n).sum(2)  # [B, Hk, n]
            per_query = w.sum(-1)  # [B, Hq, c]
            qc = qs[:, :, t0 : t0 + _QUERY_CHUNK]  # [B, Hq, c, D]
            sums[0] += torch.einsum("bhj,bhjd,bhje->hde", per_key, ks, ks).cpu()
            sums[1] += per_key.sum((0, 2)).cpu()
            qm = torch.einsum("bhc,bhcd,bhce->hde", per_query, qc, qc)  # [Hq, D, D]
            sums[2] += qm.view(hk, g, d, d).sum(1).cpu()
            sums[3] += per_query.sum((0, 2)).view(hk, g).sum(1).cpu()

    def moments(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c_num, c_den, q_num, q_den = self.sums[layer]
        return c_num / c_den.clamp_min(1e-30)[:, None, None], q_num / q_den.clamp_min(1e-30)[:, None, None]


@torch.no_grad()
def calibrate_key_map(
    model,
    input_ids: torch.Tensor,
    config: KVQuantConfig,
    out_path: str | Path | None = None,
    *,
    window: int = 1024,
    exponent: float = DEFAULT_EXPONENT,
    meta: dict | None = None,
) -> dict[int, torch.Tensor]:
    """Key maps ``{layer: M [H_kv, D, D]}`` of ``model`` for caches of ``config`` (its smoothing,
    sinks and residual decide what is measured), from ``input_ids [1, N]`` run in windows of
    ``window`` tokens (queries from a quarter of each window on); written to ``out_path`` if given.

    Layers whose attention never ran (recurrent layers of hybrids) get no map. ``ValueError`` when
    the text is shorter than one window's queries."""
    from transformers import AttentionInterface

    first_query = max(1, min(window, input_ids.shape[1]) // 4)
    if input_ids.shape[1] <= first_query + config.sink_tokens + config.residual_length:
        raise ValueError(
            f"input_ids: {input_ids.shape[1]} calibration tokens are too few for a key map "
            f"(need more than {first_query + config.sink_tokens + config.residual_length})"
        )
    recorder = _MomentRecorder(config, first_query)
    AttentionInterface.register(_RECORDER, recorder)
    before = model.config._attn_implementation
    device = next(model.parameters()).device
    model.set_attn_implementation(_RECORDER)
    try:
        for start in range(0, input_ids.shape[1], window):
            chunk = input_ids[:, start : start + window]
            if chunk.shape[1] > first_query + config.sink_tokens + config.residual_length:
                model(input_ids=chunk.to(device), use_cache=False)
    finally:
        model.set_attn_implementation(before)
    maps = {i: fit_key_map(*recorder.moments(i), exponent=exponent) for i in sorted(recorder.sums)}
    if out_path is not None:
        info = {"tokens": int(input_ids.shape[1]), "window": window, "exponent": exponent}
        info.update(smoothing=config.smoothing, sink_tokens=config.sink_tokens)
        info.update(residual_length=config.residual_length, **(meta or {}))
        save_key_map(out_path, maps, info)
    return maps
