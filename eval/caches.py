"""The caches the harness compares, what they hold, and what their format costs in theory.

A cache spec is a string:

``dynamic``            transformers' ``DynamicCache`` (full precision: the baseline)
``<preset>`` / path    a :class:`~kvquant.KVQuantCache` from a kvquant preset name or a YAML file
``hf-quanto-int4``     transformers' ``QuantizedCache(backend="quanto", nbits=4)`` (also ``-int2``)
``hf-hqq-int4``        ``QuantizedCache(backend="hqq", nbits=4)`` (also ``-int2``; needs ``hqq``)
``hf-fp8``             ``QuantizedCache(backend="fp8")``: per-tensor float8_e4m3 (transformers >= 5.24)
``engine-fp8:PATH``    what a serving engine stores with the static fp8 KV scales of a compressed-tensors
                       checkpoint (a folder or ``.safetensors`` file, e.g. ``kvquant export vllm``): fp8
                       e4m3 codes of ``x / scale`` (fp32 scales, per tensor or per KV head), no sinks, no
                       full-precision window; every query reads every key / value as stored, its own
                       token included, as vLLM's paged attention reads its cache
``presets`` / ``peers`` / ``all``   every kvquant preset / every installed peer / dynamic+peers+presets

From Python, :meth:`CacheSpec.custom` wraps any cache factory (e.g. your own ``Cache`` subclass).

Peers use transformers' defaults (quanto / hqq: ``q_group_size=64``, ``residual_length=128``,
``axis=0``: one scale and one shift, in the model's dtype, per 64 consecutive elements of the
``[B, H, T, D]`` tensor, i.e. per head vector when ``head_dim`` is 64; the whole history is
re-quantized each time the 128-token full-precision residual fills).

Bytes held are counted from the tensors each cache holds after a run: ``KVQuantCache.nbytes()``
(codes, scales, zero points, full-precision tail and sink of valid tokens); for transformers' caches,
every tensor under each layer's ``keys``, ``values``, ``_quantized_keys`` and ``_quantized_values``,
quantized tensor subclasses unpacked into their inner tensors (quanto: packed ``_data``, ``_scale``,
``_shift``; hqq: the packed tensor and its ``meta`` scale / zero; fp8: codes + one fp32 scale).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.config import KVQuantConfig, preset_names

# (the byte counts are re-exported: kvquant.eval.caches is where callers look for them)
from kvquant.eval.cache_bytes import (  # noqa: F401
    HF_TENSORS,
    cache_nbytes,
    cache_nbytes_16bit,
    fp16_bytes_per_token,
    kv_geometry,
)
from kvquant.eval.config import EvalError

_PEERS = {
    # name: (backend, nbits, python module it needs)
    "hf-quanto-int4": ("quanto", 4, "optimum.quanto"),
    "hf-quanto-int2": ("quanto", 2, "optimum.quanto"),
    "hf-hqq-int4": ("hqq", 4, "hqq"),
    "hf-hqq-int2": ("hqq", 2, "hqq"),
    "hf-fp8": ("fp8", 8, None),
}
PEER_GROUP_SIZE = 64  # transformers' default q_group_size for quanto / hqq


def _module_available(name: str | None) -> bool:
    if name is None:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _hf_fp8_available() -> bool:
    from transformers import cache_utils

    return hasattr(cache_utils, "Fp8QuantizedLayer")


def available_peers() -> list[str]:
    """transformers' QuantizedCache variants usable here (backend installed)."""
    out = []
    for name, (backend, _, module) in _PEERS.items():
        ok = _hf_fp8_available() if backend == "fp8" else _module_available(module)
        if ok:
            out.append(name)
    return out


@dataclass
class CacheSpec:
    """One cache configuration the harness evaluates."""

    name: str
    kind: str  # "dynamic", "kvquant", "hf" or "custom"
    quant: KVQuantConfig | None = None
    backend: str | None = None
    nbits: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[Any], Any] | None = field(default=None, repr=False)

    @classmethod
    def custom(cls, name: str, factory: Callable[[Any], Any], **settings: Any) -> CacheSpec:
        """A spec for any cache: ``factory(model)`` returns a fresh cache; ``settings`` (JSON-able)
        describe it and, with the name, identify its record when a run resumes."""
        return cls(name, "custom", settings={"class": "custom", **settings}, factory=factory)

    @property
    def key(self) -> str:
        """Identity of the record in ``results.jsonl``: name + a hash of the resolved settings."""
        blob = json.dumps({"name": self.name, "kind": self.kind, "settings": self.settings}, sort_keys=True)
        return f"{self.name}@{hashlib.sha1(blob.encode()).hexdigest()[:8]}"

    def build(self, model: Any) -> Any:
        """A fresh, empty cache for ``model``."""
        from transformers import DynamicCache, QuantizedCache

        from kvquant import KVQuantCache

        config = model.config
        if self.kind == "dynamic":
            return DynamicCache(config=config)
        if self.kind == "kvquant":
            if self.settings.get("reads") == "stored":
                return engine_cache(config, self.quant)
            return KVQuantCache(model, self.quant)
        if self.kind == "custom":
            return self.factory(model)
        if self.backend == "fp8":
            return QuantizedCache(backend="fp8", config=config)
        return QuantizedCache(backend=self.backend, config=config, nbits=self.nbits)


ENGINE_PREFIX = "engine-fp8:"


def engine_config(path: str | Path) -> KVQuantConfig:
    """The cache config of ``engine-fp8:PATH``: fp8 e4m3 keys and values with the checkpoint's static
    scales in fp32 (exactly the scale the engine divides by), no sinks, no full-precision tokens."""
    path = str(Path(path).expanduser().resolve())
    return KVQuantConfig(
        key_format="fp8_e4m3",
        value_format="fp8_e4m3",
        scale_dtype="float32",
        static_scales=path,
        name=f"{ENGINE_PREFIX}{path}",
    )


def engine_cache(config: Any, quant: KVQuantConfig) -> Any:
    """A :class:`~kvquant.KVQuantCache` of ``quant`` whose ``update`` returns every key / value as
    stored, the call's own tokens included (the prefill too): what an engine's attention reads back
    from its paged fp8 cache. (A plain KVQuantCache hands each call its own new tokens in full
    precision, as transformers' caches do.)"""
    from kvquant import KVQuantCache

    cache = KVQuantCache(config, quant, fused=False)
    original: Callable = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        original(key_states, value_states, layer_idx, *args, **kwargs)
        return cache.layers[layer_idx].read_history()

    cache.update = update
    return cache


def _engine_spec(spec: str) -> CacheSpec:
    path = spec[len(ENGINE_PREFIX) :]
    if not path:
        raise EvalError(
            f"cache {spec!r}: give the checkpoint folder or .safetensors file after {ENGINE_PREFIX!r}"
        )
    if not Path(path).expanduser().exists():
        raise EvalError(f"cache {spec!r}: no such checkpoint folder or file {path!r}")
    quant = engine_config(path)
    try:
        check_calibration_files(quant)
    except ValueError as exc:
        raise EvalError(f"cache {spec!r}: {exc}") from None
    settings = {"class": "KVQuantCache", "reads": "stored", **quant.to_dict()}
    return CacheSpec(quant.name, "kvquant", quant=quant, settings=settings)


def _one_spec(spec: str) -> CacheSpec:
    if spec.startswith(ENGINE_PREFIX):
        return _engine_spec(spec)
    if spec == "dynamic":
        return CacheSpec("dynamic", "dynamic", settings={"class": "DynamicCache"})
    if spec in _PEERS:
        backend, nbits, module = _PEERS[spec]
        if spec not in available_peers():
            need = "a transformers with the fp8 backend" if backend == "fp8" else f"the {module!r} package"
            raise EvalError(f"cache {spec!r}: needs {need}, which is not installed")
        settings = {"class": "QuantizedCache", "backend": backend}
        if backend != "fp8":
            settings.update(nbits=nbits, q_group_size=PEER_GROUP_SIZE, residual_length=128, axis=0)
        return CacheSpec(spec, "hf", backend=backend, nbits=nbits, settings=settings)
    try:
        quant = KVQuantConfig.resolve(spec)
    except ValueError as exc:
        allowed = (
            "dynamic, "
            + ", ".join(_PEERS)
            + f", {ENGINE_PREFIX}PATH, presets, peers, all, "
            + ", ".join(preset_names())
        )
        if spec.endswith((".yaml", ".yml")) or "/" in spec:
            raise EvalError(f"cache {spec!r}: {' '.join(str(exc).split())}") from None
        raise EvalError(
            f"cache: unknown cache or preset {spec!r}; allowed: {allowed}, or a YAML path"
        ) from None
    try:
        check_calibration_files(quant)
    except ValueError as exc:
        raise EvalError(f"cache {spec!r}: {exc}") from None
    return CacheSpec(
        quant.name, "kvquant", quant=quant, settings={"class": "KVQuantCache", **quant.to_dict()}
    )


def resolve_spec(spec: str) -> CacheSpec:
    """One cache spec (``dynamic``, a peer, a preset name or a YAML path; not a group), resolved.

    Example:
        >>> resolve_spec("int4").build(model)     # a fresh, empty KVQuantCache with the int4 preset
    """
    return _one_spec(str(spec).strip())


def check_calibration_files(quant: KVQuantConfig) -> None:
    """Read a config's ``static_scales`` and ``key_map`` files (if any) now, before any slow work
    (``ValueError`` naming the file otherwise)."""
    check_static_scales(quant)
    if quant.key_map is not None:
        from kvquant.key_map import load_key_map

        load_key_map(quant.key_map)


def check_static_scales(quant: KVQuantConfig) -> None:
    """Read the calibration file of a config's ``static_scales`` (if any) now, before any slow work:
    ``ValueError`` naming the file when it is missing, unreadable or not a calibration file."""
    path = quant.static_scales
    if path is None:
        return
    from kvquant.cache import load_static_scales
    from kvquant.engine_scales import is_scales_checkpoint

    if is_scales_checkpoint(path):
        load_static_scales(path)  # ValueError naming what is missing
        return
    try:
        scales = load_static_scales(Path(path).expanduser())
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as exc:
        # torch.load's errors for a file that is not a torch archive (text, truncated, corrupt zip)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"static_scales: cannot read {str(path)!r} as a kvquant calibration file ({reason[:160]}); "
            "make one with kvquant calibrate"
        ) from None
    for part in ("keys", "values"):
        t = scales[part]
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(
                f"static_scales: {str(path)!r}: {part!r} must be a [layers, heads] float tensor; "
                "make the file with kvquant calibrate"
            )


def resolve_specs(specs: list[str]) -> list[CacheSpec]:
    """Expand groups, resolve every spec, put ``dynamic`` first, drop duplicates."""
    names: list[str] = []
    for raw in specs:
        for spec in str(raw).split(","):
            spec = spec.strip()
            if spec == "presets":
                names += preset_names()
            elif spec == "peers":
                names += available_peers()
            elif spec == "all":
                names += ["dynamic", *available_peers(), *preset_names()]
            elif spec:
                names.append(spec)
    out: dict[str, CacheSpec] = {"dynamic": _one_spec("dynamic")}
    for name in names:
        s = _one_spec(name)
        out.setdefault(s.key if s.kind != "dynamic" else "dynamic", s)
    return list(out.values())


def theoretical_bits(spec: CacheSpec, model: Any) -> float | None:
    """Bits per cached K/V element of the format alone (no full-precision sink / residual tokens),
    averaged over keys, values and layers (``None`` for custom caches)."""
    layers, kv_heads, head_dim = kv_geometry(model)
    dtype_bits = torch.finfo(model.dtype).bits
    if spec.kind == "custom":
        return None
    if spec.kind == "dynamic":
        return float(dtype_bits)
    if spec.kind == "hf":
        if spec.backend == "fp8":
            return 8.0
        return spec.nbits + 2 * dtype_bits / PEER_GROUP_SIZE  # scale + shift in the model's dtype
    from kvquant.memory import format_bits

    bits = []
    for i in range(layers):
        layer_cfg = spec.quant.for_layer(i, layers)
        for h in range(kv_heads):
            c = layer_cfg.for_head(h)
            bits += [format_bits(c, which, head_dim, dtype_bits // 8) for which in ("key", "value")]
    return sum(bits) / len(bits)


# ------------------------------------------------------------------------------------------ simulated


def simulate_quantization(cache: Any) -> Any:
    """Make ``cache.update`` return every key / value of the call quantize-dequantized, the call's own
    tokens included, so that one forward pass sees K/V as the cache would store them.

    KVQuantCache: the call's tokens go through a scratch full-attention layer of the same config
    (sinks and the ``residual_length`` most recent tokens of the call stay full precision, as they would
    be stored). transformers' QuantizedCache: its first update quantizes everything; the dequantized
    store is returned. DynamicCache: unchanged. Meant for one forward call on an empty cache.
    """
    from transformers import DynamicCache

    from kvquant import KVQuantCache
    from kvquant.cache import KV_LAYERS, make_layer

    original: Callable = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        k, v = original(key_states, value_states, layer_idx, *args, **kwargs)
        layer = cache.layers[layer_idx]
        if isinstance(cache, KVQuantCache):
            if not isinstance(layer, KV_LAYERS):
                return k, v
            scratch = make_layer(  # full attention (every token of the call kept), the same formats
                layer.config,
                kv_heads=key_states.shape[1],
                static_scales=layer.static_scales,
                key_map=layer.key_map,
                query_rms=layer.query_rms,
            )
            scratch.lazy_initialization(key_states, value_states)
            scratch.append(key_states, value_states, (kwargs.get("kwargs") or {}).get("position_ids"))
            return scratch.read_history()
        if getattr(layer, "_quantized_keys", None) is not None:
            return layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
        if isinstance(cache, DynamicCache):
            return k, v
        raise EvalError(f"simulated mode: no quantize-dequantize view for {type(cache).__name__}")

    cache.update = update
    return cache
