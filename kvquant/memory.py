"""Bytes a cache config holds, from the config alone (no model weights, no data).

``layer_bytes`` predicts exactly what ``QuantizedKVLayer.nbytes()`` reports after ``tokens``
positions (no left padding, no crop) by running the layer itself on the ``meta`` device: the same
tier arithmetic, shapes only, nothing computed. The result is a function of the context length (tail,
sinks, recent window, block alignment), not a constant per token. ``format_bytes_per_token`` is the
format alone (codes + scales + zero points), the number to hold the store against.

Example:
    >>> cfg = KVQuantConfig.resolve("int4")
    >>> format_bytes_per_token(cfg, heads=3, head_dim=64)       # K + V, one layer, one sequence
    216.0
    >>> layer_bytes(cfg, tokens=2048, batch=1, heads=3, head_dim=64, fp_itemsize=2)["total"]
    455040
"""

from __future__ import annotations

import torch

from kvquant.cache.factory import make_layer
from kvquant.config import KVQuantConfig
from kvquant.formats import format_spec
from kvquant.layer_kinds import ATTENTION, EMPTY

_FP_DTYPES = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32, 8: torch.float64}


def tensor_bytes_per_token(cfg: KVQuantConfig, which: str, head_dim: int, fp_itemsize: int) -> float:
    """Bytes per token and head for K (``which="key"``) or V in the main store (scales amortized)."""
    kg, vg = cfg.group_sizes(head_dim)
    key = which == "key"
    return format_spec(cfg.key_format if key else cfg.value_format).bytes_per_token(
        head_dim,
        kg if key else vg,
        cfg.key_axis if key else "token",
        cfg.torch_scale_dtype.itemsize,
        static=cfg.static_scales is not None,
        fp_itemsize=fp_itemsize,
    )


def format_bits(cfg: KVQuantConfig, which: str, head_dim: int, fp_itemsize: int = 2) -> float:
    """Bits per element of K (``which="key"``) or V in the main store: codes + scales (+ zero points)
    amortized; the model dtype's bits for ``none``. The one bits formula (eval, tune, plan use it)."""
    return 8.0 * tensor_bytes_per_token(cfg, which, head_dim, fp_itemsize) / head_dim


def format_bytes_per_token(cfg: KVQuantConfig, heads: int, head_dim: int, fp_itemsize: int = 2) -> float:
    """K + V bytes per token of one layer for one sequence, the format alone (no tail / sinks)."""
    per_head = tensor_bytes_per_token(cfg, "key", head_dim, fp_itemsize)
    per_head += tensor_bytes_per_token(cfg, "value", head_dim, fp_itemsize)
    return heads * per_head


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
    static = None
    if cfg.static_scales is not None:  # one calibrated scale per head; only its size matters here
        static = (torch.ones(heads, device="meta"), torch.ones(heads, device="meta"))
    # (a key map adds no bytes to a cache: a model constant, like the weights)
    layer = make_layer(
        cfg, sliding_window, static_scales=static, initial_capacity=1, key_map=None, kv_heads=heads
    )
    if tokens > 0:
        kv = torch.empty(batch, heads, tokens, head_dim, dtype=_FP_DTYPES[fp_itemsize], device="meta")
        layer.lazy_initialization(kv, kv)
        layer.append(kv, kv)
    out = layer.nbytes()
    out["total"] = sum(out.values())
    return out


def layer_groups(
    cfg: KVQuantConfig, layer_types: list[str], sliding_windows: list[int | None]
) -> list[tuple[KVQuantConfig, int | None, int]]:
    """The layers of a cache as ``(layer config, sliding window, count)`` groups of identical layers
    (``dummy`` layers hold nothing and are left out), in order of first appearance. A config whose
    ``retrieval_layers`` are not resolved yet (the model not probed) counts them on its last
    attention layers.

    Example:
        >>> [(c.key_format, w, n) for c, w, n in layer_groups(KVQuantConfig(), ["full_attention"] * 3, [None] * 3)]
        [('int8', None, 3)]
    """
    n = len(layer_types)
    if cfg.retrieval_layers:
        # which layers a probe of the model picks is not known here: the last ones stand in (the
        # same bytes where the layers are alike)
        held = [i for i, kind in enumerate(layer_types) if kind in ATTENTION]
        cfg = cfg.with_retrieval_layers(held[-cfg.retrieval_layers :], n)
    groups: dict[tuple, list] = {}
    for i, (kind, window) in enumerate(zip(layer_types, sliding_windows, strict=True)):
        if kind in EMPTY:
            continue
        layer_cfg = cfg.for_layer(i, n)
        groups.setdefault((repr(layer_cfg), window), [layer_cfg, window, 0])[2] += 1
    return [(c, w, k) for c, w, k in groups.values()]


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
    groups = layer_groups(cfg, layer_types, sliding_windows)
    return groups_bytes(groups, tokens, batch, (heads, head_dim, fp_itemsize))


def groups_bytes(
    groups: list[tuple[KVQuantConfig, int | None, int]], tokens: int, batch: int, dims: tuple
) -> int:
    """:func:`model_cache_bytes` of a cache whose :func:`layer_groups` are ``groups``; ``dims``:
    ``(heads, head_dim, fp_itemsize)``. A caller that counts many contexts of one cache resolves its
    layers once.

    Example:
        >>> types, windows = ["full_attention"] * 2, [None, None]
        >>> groups = layer_groups(KVQuantConfig(), types, windows)
        >>> groups_bytes(groups, 100, 1, (2, 64, 2)) == model_cache_bytes(KVQuantConfig(), types, windows, 100, 1, 2, 64, 2)
        True
    """
    return sum(
        count * layer_bytes(layer_cfg, tokens, batch, *dims, window)["total"]
        for layer_cfg, window, count in groups
    )
