"""``make_layer``: the cache layer a model layer gets, from its resolved config: plain, sliding, or
split by KV heads; ``KV_LAYERS``, the layer types of a :class:`~kvquant.KVQuantCache` that store
keys and values.

Example:
    >>> make_layer(KVQuantConfig.resolve("int4"), sliding_window=512).is_sliding
    True
"""

from __future__ import annotations

from kvquant.cache.head_split import HeadSplitLayer
from kvquant.cache.layer import QuantizedKVLayer
from kvquant.cache.sliding import SlidingKVLayer
from kvquant.config import KVQuantConfig
from kvquant.key_map import layer_map, load_key_map

KV_LAYERS = (QuantizedKVLayer, HeadSplitLayer)  # the layers of a KVQuantCache that store keys / values


def _plain_layer(config: KVQuantConfig, sliding_window: int | None, **kwargs) -> QuantizedKVLayer:
    if sliding_window is None:
        return QuantizedKVLayer(config, **kwargs)
    return SlidingKVLayer(config, sliding_window, **kwargs)


def make_layer(
    config: KVQuantConfig,
    sliding_window: int | None = None,
    *,
    layer_idx: int | None = None,
    kv_heads: int | None = None,
    **kwargs,
) -> QuantizedKVLayer | SlidingKVLayer | HeadSplitLayer:
    """The layer for model layer ``layer_idx``: sliding when ``sliding_window`` is set; with the
    config's key map for that layer (:func:`kvquant.key_map.load_key_map`, read once per file) when it
    has one, which needs ``layer_idx``; a :class:`~kvquant.cache.head_split.HeadSplitLayer` of
    ``kv_heads`` heads when the config has head overrides (``heads``), which needs ``kv_heads``."""
    if config.key_map is not None and "key_map" not in kwargs:
        if layer_idx is None:
            raise ValueError("layer_idx: a config with a key_map needs the layer's index to pick its map")
        kwargs["key_map"] = layer_map(load_key_map(config.key_map), layer_idx, config.key_map)
    if config.heads:
        if kv_heads is None:
            raise ValueError("kv_heads: a config with head overrides (heads) needs the layer's KV heads")
        groups = config.head_groups(kv_heads)
        if len(groups) > 1:
            return HeadSplitLayer(config, kv_heads, sliding_window, _plain_layer, **kwargs)
        config = groups[0][1]  # every head alike
    return _plain_layer(config, sliding_window, **kwargs)
