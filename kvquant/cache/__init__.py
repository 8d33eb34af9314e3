"""The quantized cache: :class:`KVQuantCache` and the layers and tiers it is made of.

- :mod:`kvquant.cache.kv_cache`: ``KVQuantCache`` (a ``transformers.Cache``)
- :mod:`kvquant.cache.factory`: ``make_layer``, the layer a model layer gets from its config
- :mod:`kvquant.cache.layer`: ``QuantizedKVLayer``, a pipeline of tiers
- :mod:`kvquant.cache.edits`: ``LayerEdits``, crop and the row edits of beam / batched search
- :mod:`kvquant.cache.sliding`: ``SlidingKVLayer``, which drops what no later query sees
- :mod:`kvquant.cache.state_checks`: what an ``update`` accepts
- :mod:`kvquant.cache.head_split`: ``HeadSplitLayer``, a layer whose KV heads differ in format
- :mod:`kvquant.cache.segments`: the tiers (sinks, main store, recent window, tail)
- :mod:`kvquant.cache.store`: ``TokenStore``, the buffers a kernel reads in place
- :mod:`kvquant.cache.view`: ``KVView``, what the ``kvquant`` attention receives
"""

from kvquant.cache.factory import KV_LAYERS, make_layer
from kvquant.cache.head_split import HeadSplitLayer, HeadSplitView
from kvquant.cache.kv_cache import KVQuantCache, load_static_scales
from kvquant.cache.layer import QuantizedKVLayer
from kvquant.cache.sliding import SlidingKVLayer
from kvquant.cache.view import KVView, QuantizedRead

__all__ = [
    "KV_LAYERS",
    "HeadSplitLayer",
    "HeadSplitView",
    "KVQuantCache",
    "KVView",
    "QuantizedKVLayer",
    "QuantizedRead",
    "SlidingKVLayer",
    "load_static_scales",
    "make_layer",
]
