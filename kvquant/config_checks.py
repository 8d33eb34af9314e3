"""The checks of a :class:`~kvquant.config.KVQuantConfig`'s fields, run once when it is made: each bad
value raises one ``ValueError`` naming the field, the value and what is allowed; the override maps
(``heads``, ``layer_overrides``) are checked by building each override's config.

Example:
    >>> KVQuantConfig(key_format="int5")
    Traceback (most recent call last):
    ValueError: key_format: invalid value 'int5'; allowed: none, int8, int4, ...
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvquant.formats import AXES, FORMAT_NAMES, SCALE_DTYPES, format_spec

ROTATIONS = ("none", "hadamard")
SMOOTHINGS = ("none", "mean", "channel", "auto", "query")
# fields a layer override may change (everything but the overrides themselves and the name)
_OVERRIDABLE = (
    "key_format",
    "value_format",
    "key_axis",
    "key_group_size",
    "value_group_size",
    "rotation",
    "smoothing",
    "sink_tokens",
    "residual_length",
    "quantize_block",
    "recent_length",
    "recent_key_format",
    "recent_value_format",
    "scale_dtype",
    "heads",
)
# what a head override may change: the same, but not the head overrides themselves
_HEAD_OVERRIDABLE = tuple(f for f in _OVERRIDABLE if f != "heads")
RETRIEVAL_UNITS = ("layer", "head")


def _bad(field_name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{field_name}: invalid value {value!r}; allowed: {allowed}")


def _check_overrides(cfg: Any, name: str, overrides: Any, allowed: tuple[str, ...], keys: str) -> None:
    """``overrides`` (``{index: {field: value}}``: ``heads``, ``layer_overrides``) checked: integer
    indices (``heads``: >= 0), mappings of ``allowed`` fields, values ``cfg`` accepts."""
    if not isinstance(overrides, dict):
        raise _bad(
            name,
            overrides,
            f"a mapping {{{'kv_head' if name == 'heads' else 'layer'}_index: {{field: value}}}}",
        )
    for idx, over in overrides.items():
        if not isinstance(idx, int) or isinstance(idx, bool) or (name == "heads" and idx < 0):
            raise _bad(name, idx, keys)
        if not isinstance(over, dict):
            raise _bad(f"{name}[{idx}]", over, "a mapping {field: value}")
        unknown = set(over) - set(allowed)
        if unknown:
            raise _bad(f"{name}[{idx}]", sorted(unknown)[0], ", ".join(allowed))
        dataclasses.replace(cfg, **{"layer_overrides": {}, "heads": {}, **over})  # validates the values


def check_fields(cfg: Any) -> None:
    """Every field of ``cfg`` (a ``KVQuantConfig``) checked; the first bad one raises."""
    for f in ("key_format", "value_format"):
        v = getattr(cfg, f)
        if v not in FORMAT_NAMES:
            raise _bad(f, v, ", ".join(FORMAT_NAMES))
    if cfg.key_axis not in AXES:
        raise _bad("key_axis", cfg.key_axis, ", ".join(AXES))
    for f in ("key_group_size", "value_group_size"):
        v = getattr(cfg, f)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise _bad(f, v, "a positive integer or null (whole head)")
    if cfg.key_axis == "channel" and cfg.key_group_size is None:
        raise _bad("key_group_size", None, "a positive integer (tokens per block) when key_axis is 'channel'")
    if cfg.key_axis == "channel" and format_spec(cfg.key_format).token_axis_only:
        raise _bad("key_axis", cfg.key_axis, f"'token' for the key_format {cfg.key_format}")
    if cfg.rotation not in ROTATIONS:
        raise _bad("rotation", cfg.rotation, ", ".join(ROTATIONS))
    if cfg.smoothing not in SMOOTHINGS:
        raise _bad("smoothing", cfg.smoothing, ", ".join(SMOOTHINGS))
    for f in ("sink_tokens", "residual_length", "recent_length"):
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _bad(f, v, "an integer >= 0")
    q = cfg.quantize_block
    if not isinstance(q, int) or isinstance(q, bool) or q < 1:
        raise _bad("quantize_block", q, "an integer >= 1")
    if q != 1 and cfg.key_axis == "channel":
        raise _bad(
            "quantize_block",
            q,
            "1 when key_axis is 'channel' (it quantizes key_group_size tokens at once)",
        )
    for f in ("recent_key_format", "recent_value_format"):
        v = getattr(cfg, f)
        if v not in FORMAT_NAMES or v == "none":
            raise _bad(f, v, ", ".join(n for n in FORMAT_NAMES if n != "none"))
    if cfg.recent_length and cfg.key_axis != "token":
        raise _bad("recent_length", cfg.recent_length, "0 when key_axis is 'channel'")
    if cfg.scale_dtype not in SCALE_DTYPES:
        raise _bad("scale_dtype", cfg.scale_dtype, ", ".join(SCALE_DTYPES))
    if cfg.key_map is not None and (not isinstance(cfg.key_map, str) or not cfg.key_map):
        raise _bad("key_map", cfg.key_map, "a shipped key map's name or a file path (a non-empty string)")
    if cfg.key_map is not None and cfg.smoothing == "query":
        raise _bad(
            "smoothing",
            cfg.smoothing,
            "none, mean, channel or auto with a key_map (a key map weighs the keys by the queries itself)",
        )
    if cfg.static_scales is not None:
        for f in ("key_format", "value_format"):
            if not format_spec(getattr(cfg, f)).takes_static_scale:
                raise _bad(f, getattr(cfg, f), "int8, fp8_e4m3, fp8_e5m2 or none when static_scales is set")
        if cfg.key_axis != "token":
            raise _bad("key_axis", cfg.key_axis, "'token' when static_scales is set")
    r = cfg.retrieval_layers
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise _bad("retrieval_layers", r, "an integer >= 0")
    if cfg.retrieval_format not in FORMAT_NAMES:
        raise _bad("retrieval_format", cfg.retrieval_format, ", ".join(FORMAT_NAMES))
    if r and cfg.key_axis == "channel" and format_spec(cfg.retrieval_format).token_axis_only:
        raise _bad(
            "retrieval_format",
            cfg.retrieval_format,
            "a format the channel axis can store (e.g. int4) when key_axis is 'channel'",
        )
    if cfg.retrieval_unit not in RETRIEVAL_UNITS:
        raise _bad("retrieval_unit", cfg.retrieval_unit, ", ".join(RETRIEVAL_UNITS))
    _check_overrides(cfg, "heads", cfg.heads, _HEAD_OVERRIDABLE, "KV head indices: integers >= 0")
    _check_overrides(
        cfg,
        "layer_overrides",
        cfg.layer_overrides,
        _OVERRIDABLE,
        "integer layer indices (negative counts from the end)",
    )
