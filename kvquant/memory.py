"""Bytes a cache config holds, from the config alone (no model weights, no tensors).

``layer_bytes`` predicts exactly what ``QuantizedKVLayer.nbytes()`` reports after ``tokens``
positions (no left padding, no crop): quantized store, full-precision tail and sinks, all a function
of the context length — not a constant per token. ``format_bytes_per_token`` is the format alone
(codes + scales + zero points), the number to hold the store against.

Example:
    >>> cfg = KVQuantConfig.resolve("int4")
    >>> format_bytes_per_token(cfg, heads=3, head_dim=64)       # K + V, one layer, one sequence
    216.0
    >>> layer_bytes(cfg, tokens=2048, batch=1, heads=3, head_dim=64, fp_itemsize=2)["total"]
"""

from __future__ import annotations

import dataclasses

from kvquant.config import KVQuantConfig
from kvquant.formats import format_spec


def _scale_itemsize(cfg: KVQuantConfig) -> int:
    return cfg.torch_scale_dtype.itemsize


def tensor_bytes_per_token(cfg: KVQuantConfig, which: str, head_dim: int, fp_itemsize: int) -> float:
    """Bytes per token and head for K (``which="key"``) or V in the store (scales amortized)."""
    fmt = cfg.key_format if which == "key" else cfg.value_format
    spec = format_spec(fmt)
    if spec.kind == "passthrough":
        return float(head_dim * fp_itemsize)
    codes = spec.code_width(head_dim)
    if cfg.static_scales is not None:
        return float(codes)
    kg, vg = cfg.group_sizes(head_dim)
    per_scale = _scale_itemsize(cfg) * (2 if spec.has_zero else 1)
    if which == "key" and cfg.key_axis == "channel":
        return codes + head_dim * per_scale / kg  # one row of D scales per block of kg tokens
    g = kg if which == "key" else vg
    return codes + (head_dim // g) * per_scale


def format_bytes_per_token(cfg: KVQuantConfig, heads: int, head_dim: int, fp_itemsize: int = 2) -> float:
    """K + V bytes per token of one layer for one sequence, the format alone (no tail / sinks)."""
    per_head = tensor_bytes_per_token(cfg, "key", head_dim, fp_itemsize)
    per_head += tensor_bytes_per_token(cfg, "value", head_dim, fp_itemsize)
    return heads * per_head


def _store_tensor_bytes(cfg, which, begin, end, batch, heads, head_dim, fp_itemsize) -> int:
    if end <= begin:
        return 0
    fmt = cfg.key_format if which == "key" else cfg.value_format
    spec = format_spec(fmt)
    if spec.kind == "passthrough":
        return batch * heads * (end - begin) * head_dim * fp_itemsize
    codes = batch * heads * (end - begin) * spec.code_width(head_dim)
    if cfg.static_scales is not None:
        return codes + heads * _scale_itemsize(cfg)
    kg, vg = cfg.group_sizes(head_dim)
    n_tensors = 2 if spec.has_zero else 1
    if which == "key" and cfg.key_axis == "channel":
        rows, cols = -(-end // kg) - begin // kg, head_dim
    else:
        rows, cols = end - begin, head_dim // (kg if which == "key" else vg)
    return codes + batch * heads * rows * cols * _scale_itemsize(cfg) * n_tensors


def layer_bytes(
    cfg: KVQuantConfig,
    tokens: int,
    batch: int,
    heads: int,
    head_dim: int,
    fp_itemsize: int,
    sliding_window: int | None = None,
) -> dict[str, int]:
    """Bytes one layer holds after ``tokens`` positions: ``store``, ``tail``, ``sink``, ``total``.

    ``cfg`` is the layer's resolved config (``KVQuantConfig.for_layer``); ``fp_itemsize`` the
    model dtype's bytes (full-precision tail / sink tokens are kept in it).
    """
    block = cfg.key_group_size if cfg.key_axis == "channel" else 1
    store_end = max(tokens - cfg.residual_length, 0) // block * block
    tail = tokens - store_end
    store_begin = 0
    sink_held = min(cfg.sink_tokens, tokens)
    if sliding_window is not None:
        keep_from = max(tokens - (sliding_window - 1), 0)
        store_begin = min(keep_from, store_end)
        if keep_from >= cfg.sink_tokens:
            sink_held = 0
    main_end = max(store_end - cfg.recent_length, store_begin)  # then the recent window, its own formats
    store = sum(
        _store_tensor_bytes(cfg, which, store_begin, main_end, batch, heads, head_dim, fp_itemsize)
        for which in ("key", "value")
    )
    if cfg.recent_length:
        recent = dataclasses.replace(
            cfg, key_format=cfg.recent_key_format, value_format=cfg.recent_value_format, static_scales=None
        )
        store += sum(
            _store_tensor_bytes(recent, which, main_end, store_end, batch, heads, head_dim, fp_itemsize)
            for which in ("key", "value")
        )
    if store_end > 0 and cfg.smoothing != "none":  # per-(row, head) channel mean (and std) of K
        store += batch * heads * head_dim * _scale_itemsize(cfg) * (2 if cfg.smoothing == "channel" else 1)
    fp_token = batch * heads * head_dim * fp_itemsize * 2  # K and V
    out = {"store": store, "tail": tail * fp_token, "sink": sink_held * fp_token}
    out["total"] = sum(out.values())
    return out


def model_cache_bytes(
    cfg: KVQuantConfig,
    layer_types: list[str],
    sliding_windows: list[int | None],
    tokens: int,
    batch: int,
    heads: int,
    head_dim: int,
    fp_itemsize: int,
) -> int:
    """Total bytes of a :class:`~kvquant.KVQuantCache` over all layers (``dummy`` layers hold none)."""
    n = len(layer_types)
    total = 0
    for i, (kind, window) in enumerate(zip(layer_types, sliding_windows, strict=True)):
        if kind == "dummy":
            continue
        total += layer_bytes(cfg.for_layer(i, n), tokens, batch, heads, head_dim, fp_itemsize, window)[
            "total"
        ]
    return total
