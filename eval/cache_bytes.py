"""Bytes a cache holds, counted from its tensors after a run: ``KVQuantCache.nbytes()`` (codes,
scales, zero points, full-precision tail and sinks of valid tokens), or for transformers' caches
every tensor under each layer's ``keys`` / ``values`` / ``_quantized_*`` (tensor subclasses unpacked);
also as a 16-bit model would hold them, and the model's KV geometry (see :mod:`kvquant.eval.caches`).

Example:
    >>> cache = KVQuantCache(model, "int8"); model(ids, cache=cache)
    >>> cache_nbytes(cache), cache_nbytes_16bit(cache)                 # bytes held (fp32 model / 16-bit)
"""

from __future__ import annotations

from typing import Any

import torch

HF_TENSORS = ("keys", "values", "_quantized_keys", "_quantized_values")  # what a transformers layer holds


def _tensor_bytes(obj: Any, fp32_size: int = 4) -> int:
    """Bytes of every plain tensor in ``obj`` (tensor subclasses, tuples, lists, dicts unpacked), float32
    elements counted at ``fp32_size`` bytes."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(type(obj), "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), fp32_size) for n in names)
        return obj.numel() * (fp32_size if obj.dtype == torch.float32 else obj.element_size())
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o, fp32_size) for o in obj)
    return 0


def _hf_bytes(cache: Any, fp32_size: int = 4) -> int:
    return sum(
        _tensor_bytes(getattr(layer, a, None), fp32_size) for layer in cache.layers for a in HF_TENSORS
    )


def cache_nbytes(cache: Any) -> int:
    """Bytes of the keys and values a cache holds (see the module docstring for how they are counted)."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    return _hf_bytes(cache)


def cache_nbytes_16bit(cache: Any) -> int:
    """The bytes :func:`cache_nbytes` counts, as a 16-bit model would hold them: what the cache keeps
    in a float32 model's dtype (full-precision tokens; transformers' QuantizedCache also its scales
    and shifts) at 2 bytes per element. Lets runs made in float32 for precision state the memory of
    a bf16 / fp16 deployment."""
    from kvquant import KVQuantCache
    from kvquant.cache import KV_LAYERS

    if not isinstance(cache, KVQuantCache):
        return _hf_bytes(cache, fp32_size=2)
    total = 0
    leaves = [leaf for layer in cache.layers if isinstance(layer, KV_LAYERS) for leaf in layer.leaves()]
    for layer in leaves:
        if not layer.is_initialized:
            continue
        parts = layer.nbytes()
        shrink = min(2, layer.tail.k.element_size()) / layer.tail.k.element_size()
        store = parts["store"]
        if layer.config.is_passthrough:
            store = int(store * shrink)
        total += store + int((parts["tail"] + parts["sink"]) * shrink)
    return total


def kv_geometry(model: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of the model's decoder."""
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv, head_dim


def fp16_bytes_per_token(model: Any) -> int:
    """K and V of one token over all layers in fp16."""
    layers, kv, head_dim = kv_geometry(model)
    return layers * kv * head_dim * 2 * 2
