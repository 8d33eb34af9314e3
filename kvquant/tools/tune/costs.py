"""What the tuner chooses from and what each choice costs: the menu, the base recipe, the fields that
put one tensor (keys or values) in a format, and the bytes / ``bits @16-bit`` it adds
(:func:`kvquant.memory.layer_bytes`, as ``kvquant eval`` counts them).

Example:
    >>> ref, costs = tensor_costs(DEFAULT_BASE, ("tcq2", "nuq4"), heads=3, head_dim=64, tokens=1087)
    >>> costs["key"]["nuq4"] > costs["key"]["tcq2"]                 # bytes a layer adds
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvquant.config import KVQuantConfig
from kvquant.formats import FORMAT_NAMES
from kvquant.memory import format_bits, layer_bytes, model_cache_bytes

# nuq2 / nuq3 are left out: tcq2 / tcq3 hold the same bits with less error (kvquant/formats/trellis.py)
MENU: tuple[str, ...] = ("tcq2", "tcq3", "nuq4", "int8")
TENSORS = ("key", "value")
QUANTIZED_NAMES = tuple(n for n in FORMAT_NAMES if n != "none")  # the formats a tensor can be tuned to
QUANTIZED = ", ".join(QUANTIZED_NAMES)
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


def kv_geometry_of(model_config: Any) -> tuple[int, int, int]:
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

    layers, heads, head_dim = kv_geometry_of(model_config)
    types, kwargs = get_layer_types_and_kwargs(model_config.get_text_config(decoder=True))
    windows = [kw.get("sliding_window") for kw in kwargs]
    total = model_cache_bytes(cfg, types, windows, tokens, 1, heads, head_dim, 2)
    return 16.0 * total / (tokens * layers * heads * head_dim * 2 * 2)
