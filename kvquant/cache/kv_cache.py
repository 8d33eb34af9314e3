"""``KVQuantCache``: the drop-in quantized cache for Hugging Face decoder models.

Example:
    >>> from kvquant import KVQuantCache
    >>> from kvquant.models import load_model
    >>> model, tok = load_model()                              # embedded SmolLM2-135M-Instruct
    >>> cache = KVQuantCache(model, "int4")                    # preset, KVQuantConfig or YAML path
    >>> ids = tok("The KV cache", return_tensors="pt")
    >>> out = model.generate(**ids, cache=cache, max_new_tokens=16)
    >>> cache.effective_bits()                                 # ~4.5 bits per element
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer, get_layer_types_and_kwargs

from kvquant.cache.factory import KV_LAYERS, make_layer
from kvquant.config import KVQuantConfig
from kvquant.engine_scales import is_scales_checkpoint, read_scales
from kvquant.kernels import ops
from kvquant.layer_kinds import EMPTY, STATE, SUPPORTED
from kvquant.query_scales import query_channel_rms
from kvquant.retrieval_heads import retrieval_scores, top_heads, top_layers

_HYBRID_REASON = (
    " (a 'hybrid' layer runs attention and a recurrent state side by side in one cache layer, as "
    "Falcon-H1 and Zamba do; KVQuantCache has no layer holding both)"
)


def load_static_scales(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a calibration file (``kvquant calibrate``): ``{"keys": [L, H], "values": [L, H]}``; or
    the fp8 KV scales of a compressed-tensors checkpoint (a folder or ``.safetensors`` file, e.g. from
    ``kvquant export``: see :mod:`kvquant.engine_scales`), ``[L, 1]`` when every scale is per tensor."""
    path = Path(path)
    if is_scales_checkpoint(path):
        return read_scales(path)
    if not path.is_file():
        raise ValueError(f"static_scales: no such calibration file {str(path)!r}")
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or "keys" not in data or "values" not in data:
        raise ValueError(
            f"static_scales: {str(path)!r} is not a kvquant calibration file (needs 'keys', 'values')"
        )
    return data


def _smooths_by_queries(cfg: KVQuantConfig) -> bool:
    """Whether a layer config, or one of its head overrides, smooths keys by the queries' sizes."""
    return cfg.smoothing == "query" or any(h.get("smoothing") == "query" for h in cfg.heads.values())


def caches_latent(config: Any) -> bool:
    """Whether the model caches a compressed latent rather than per-head keys and values: multi-head
    latent attention (DeepSeek-V2 / V3, Kimi, GLM-4-MoE-Lite, ...: ``kv_lora_rank`` in the config).
    Such a model stores ``(latent [B, 1, T, kv_lora_rank], k_rope [B, 1, T, qk_rope_head_dim])`` and
    expands what the cache returns into keys and values itself, so the cache hands back tensors (the
    two streams, each of its own width, dequantized), never a view: the ``kvquant`` attention then
    attends over the expanded keys and values like ``sdpa``."""
    return bool(getattr(config, "kv_lora_rank", None))


class KVQuantCache(Cache):
    """A ``transformers.Cache`` whose layers store keys / values quantized.

    Args:
        config: the model itself, or its config. Layer types (full, sliding, chunked, shared) are
            derived from the config exactly as ``DynamicCache(config=...)`` does. A config with
            ``retrieval_layers`` needs the model: it is probed once for the layers whose keys and
            values stay finer (:mod:`kvquant.retrieval_heads`; ``cache.retrieval_layers`` lists them).
        quant: a preset name (``"int4"``, ``"int8"``, ...), a :class:`KVQuantConfig`, a dict, or a
            YAML path. Defaults to ``"int4"``.
        initial_capacity: tokens each layer's store is first allocated for (grows by doubling).
        fused: hand the attention a view of the store (True) or dequantized tensors (False);
            ``None`` (default) decides per call: views exactly when the model's attention
            implementation is ``"kvquant"`` (the config object is the model's, so switching the
            model with :func:`kvquant.enable` is seen).

    Works with ``model.generate(..., cache=cache)`` (greedy, sampling, beam search, assisted
    decoding, batches with left padding) and with manual forward loops.
    """

    def __init__(
        self,
        config: Any,
        quant: KVQuantConfig | str | Path | dict | None = None,
        *,
        initial_capacity: int = 256,
        fused: bool | None = None,
    ):
        model_config = getattr(config, "config", config)  # accept the model too
        if not hasattr(model_config, "get_text_config"):
            raise ValueError(
                f"config: expected a transformers model config or model, got {type(config).__name__}"
            )
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused: expected True, False or None, got {fused!r}")
        if (
            isinstance(initial_capacity, bool)
            or not isinstance(initial_capacity, int)
            or initial_capacity < 1
        ):
            raise ValueError(f"initial_capacity: expected an integer >= 1, got {initial_capacity!r}")
        self.quant_config = KVQuantConfig.resolve(quant)
        decoder_config = model_config.get_text_config(decoder=True)
        self._decoder_config = decoder_config
        self._latent = caches_latent(decoder_config)
        self.fused = fused
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(decoder_config)
        num_layers = len(layer_types)
        scales = None
        if self.quant_config.static_scales is not None:
            scales = load_static_scales(self.quant_config.static_scales)
            heads = getattr(decoder_config, "num_key_value_heads", None) or decoder_config.num_attention_heads
            for part in ("keys", "values"):
                if scales[part].dim() == 2 and tuple(scales[part].shape) == (num_layers, 1):
                    scales[part] = scales[part].expand(num_layers, heads)  # one scale per layer
                if tuple(scales[part].shape) != (num_layers, heads):
                    raise ValueError(
                        f"static_scales: {part} of shape {tuple(scales[part].shape)} in the file; the model "
                        f"needs [layers, kv_heads] = [{num_layers}, {heads}]"
                    )
        if self.quant_config.key_map is not None and self._latent:
            raise ValueError(
                "key_map: not for multi-head latent attention models (the cache holds a compressed "
                "latent, not per-head keys); leave key_map unset"
            )
        for idx in self.quant_config.layer_overrides:
            if not -num_layers <= idx < num_layers:
                raise ValueError(
                    f"layer_overrides: layer {idx} does not exist; the model has {num_layers} layers "
                    f"(allowed: {-num_layers} .. {num_layers - 1})"
                )
        kv_heads = getattr(decoder_config, "num_key_value_heads", None) or decoder_config.num_attention_heads
        self.retrieval_heads: list[tuple[int, int]] = []
        self.retrieval_layers = self._find_retrieval_layers(config, num_layers, kv_heads)
        layer_configs = [self.quant_config.for_layer(i, num_layers) for i in range(num_layers)]
        query_rms = self._find_query_rms(config, layer_configs)
        layers = []
        for i, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer_kwargs, strict=True)):
            if layer_type not in SUPPORTED:
                arch = getattr(decoder_config, "model_type", "?")
                raise ValueError(
                    f"layer_types: {arch} layer {i} is {layer_type!r}; KVQuantCache supports "
                    f"{', '.join(SUPPORTED)}" + (_HYBRID_REASON if layer_type.startswith("hybrid") else "")
                )
            if layer_type in EMPTY:
                layers.append(DummyLayer())
                continue
            if layer_type in STATE:
                layers.append(LinearAttentionLayer(**kwargs))
                continue
            static = None if scales is None else (scales["keys"][i], scales["values"][i])
            layers.append(
                make_layer(
                    layer_configs[i],
                    sliding_window=kwargs.get("sliding_window"),
                    static_scales=static,
                    initial_capacity=initial_capacity,
                    layer_idx=i,
                    kv_heads=kv_heads,
                    query_rms=query_rms.get(i) if _smooths_by_queries(layer_configs[i]) else None,
                )
            )
        super().__init__(layers=layers)

    def _find_retrieval_layers(self, model: Any, num_layers: int, kv_heads: int) -> list[int]:
        """Probe ``model`` for ``quant_config.retrieval_layers`` layers (or, ``retrieval_unit: head``,
        that many layers' worth of KV heads: ``self.retrieval_heads``) and fold them into the config;
        where it cannot, warn why and keep every layer's formats (the config then says 0). Returns
        the layers holding them."""
        count = self.quant_config.retrieval_layers
        if not count or self._latent:
            return []
        why = None
        if not isinstance(model, torch.nn.Module):
            why = (
                f"{self.quant_config.name!r} keeps the keys and values of {count} retrieval layers in "
                f"{self.quant_config.retrieval_format}, found by probing the model; this cache got only its "
                "config. Pass the model: KVQuantCache(model, ...)"
            )
        else:
            try:
                scores = retrieval_scores(model)  # [L, Hq]
            except (ValueError, RuntimeError, TypeError, AttributeError) as err:
                why = (
                    f"probing {type(model).__name__} failed ({err}); set retrieval_layers: 0 to silence this"
                )
        if why is not None:
            warnings.warn(f"retrieval_layers: {why}; every layer keeps its formats", stacklevel=3)
            self.quant_config = dataclasses.replace(self.quant_config, retrieval_layers=0)  # what it holds
            return []
        if self.quant_config.retrieval_unit == "head":
            self.retrieval_heads = top_heads(scores, count * kv_heads, kv_heads)
            self.quant_config = self.quant_config.with_retrieval_heads(self.retrieval_heads, num_layers)
            return sorted({i for i, _ in self.retrieval_heads})
        found = [i for i in top_layers(scores, count) if scores[i].max() > 0]
        self.quant_config = self.quant_config.with_retrieval_layers(found, num_layers)
        return found

    def _find_query_rms(self, model: Any, layer_configs: list[KVQuantConfig]) -> dict[int, torch.Tensor]:
        """The query channel sizes ``{layer: [H_kv, D]}`` that ``smoothing: query`` weighs keys by,
        from one probe of ``model`` (:mod:`kvquant.query_scales`); where no layer asks for them, none;
        where they cannot be had, a warning, and those layers smooth as ``auto``."""
        if self._latent or not any(_smooths_by_queries(c) for c in layer_configs):
            return {}
        if not isinstance(model, torch.nn.Module):
            why = "this cache got only the model's config. Pass the model: KVQuantCache(model, ...)"
        else:
            try:
                return query_channel_rms(model)
            except (ValueError, RuntimeError, TypeError, AttributeError, KeyError) as err:
                why = f"probing {type(model).__name__} failed ({err})"
        warnings.warn(
            f"smoothing: {self.quant_config.name!r} weighs key channels by the model's query sizes, found "
            f"by probing the model; {why}; its layers smooth as 'auto'",
            stacklevel=3,
        )
        return {}

    def uses_views(self) -> bool:
        """Whether ``update`` hands out store views (the ``kvquant`` attention is active)."""
        if self._latent:  # the model post-processes what the cache returns
            return False
        if self.fused is not None:
            return self.fused
        return getattr(self._decoder_config, "_attn_implementation", None) == "kvquant"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new tokens of one layer (see :meth:`QuantizedKVLayer.update`).

        Non-finite keys / values raise ``ValueError``. On CPU the quantize op checks each flush; on
        CUDA the Triton writes only record a fault on the device (no host sync per flush), and it is
        raised here, at the first layer of the next forward pass, once per pass.
        """
        if (
            isinstance(layer_idx, bool)
            or not isinstance(layer_idx, int)
            or not 0 <= layer_idx < len(self.layers)
        ):
            raise ValueError(
                f"layer_idx: expected 0 .. {len(self.layers) - 1} (this model's layers), got {layer_idx!r}"
            )
        if layer_idx == 0:
            ops.raise_deferred()
        layer = self.layers[layer_idx]
        if isinstance(layer, KV_LAYERS):
            layer.return_view = self.uses_views()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def __repr__(self) -> str:
        return f"KVQuantCache(preset={self.quant_config.name!r}, layers={len(self.layers)})"

    def _kv_layers(self) -> list:
        return [layer for layer in self.layers if isinstance(layer, KV_LAYERS)]

    # ------------------------------------------------------------------------------------ memory

    def nbytes(self) -> int:
        """Bytes of the valid tokens held: codes, scales, zero points, full-precision tail and sinks."""
        return sum(sum(layer.nbytes().values()) for layer in self._kv_layers())

    def reserved_bytes(self) -> int:
        """Bytes allocated (capacity), which grows geometrically ahead of ``nbytes``."""
        return sum(layer.reserved_bytes() for layer in self._kv_layers())

    def fp16_bytes(self) -> int:
        """Bytes an fp16 cache would hold for the same positions."""
        return sum(layer.fp16_bytes() for layer in self._kv_layers())

    def effective_bits(self) -> float:
        """``16 * nbytes / fp16_bytes``: bits per cached element, everything included."""
        ref = self.fp16_bytes()
        return 16.0 * self.nbytes() / ref if ref else float("nan")

    def memory_report(self) -> list[dict[str, Any]]:
        """One row per layer: formats, held tokens, bytes by part, reserved bytes, effective bits."""
        rows = []
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, KV_LAYERS):
                continue
            parts = layer.nbytes()
            held, ref = sum(parts.values()), layer.fp16_bytes()
            key_format, value_format = layer.formats()
            rows.append(
                {
                    "layer": i,
                    "key_format": key_format,
                    "value_format": value_format,
                    "sliding_window": layer.sliding_window,
                    "tokens": layer.held_tokens(),
                    **{f"{k}_bytes": v for k, v in parts.items()},
                    "nbytes": held,
                    "reserved_bytes": layer.reserved_bytes(),
                    "effective_bits": 16.0 * held / ref if ref else float("nan"),
                }
            )
        return rows

    def format_memory_report(self) -> str:
        """The per-layer memory report as a markdown table."""
        rows = self.memory_report()
        head = "| layer | K | V | tokens | store B | fp tail B | sink B | nbytes | reserved | bits |"
        lines = [head, "|" + "---|" * 10]
        for r in rows:
            lines.append(
                f"| {r['layer']} | {r['key_format']} | {r['value_format']} | {r['tokens']} | {r['store_bytes']} "
                f"| {r['tail_bytes']} | {r['sink_bytes']} | {r['nbytes']} | {r['reserved_bytes']} "
                f"| {r['effective_bits']:.2f} |"
            )
        lines.append(
            f"| total | | | | | | | {self.nbytes()} | {self.reserved_bytes()} | {self.effective_bits():.2f} |"
        )
        return "\n".join(lines)
