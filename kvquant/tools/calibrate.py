"""Static per-(layer, head) scales for int8 / fp8 from a calibration pass.

Run the model over calibration text with a full-precision cache, take each layer's per-head
maximum ``|k|`` and ``|v|`` as the cache stores them (through the config's key transform: rotation
and smoothing, fitted per window as the cache fits it on a prompt), and divide by the format's largest
code. With ``static_scales: <file>`` in a config the store then holds codes
only: no per-token scales (values beyond the calibrated range are clipped).

Example:
    >>> ids = tok(text, return_tensors="pt").input_ids[:, :4096]
    >>> calibrate_static_scales(model, ids, KVQuantConfig.resolve("int8"), "int8-scales.pt")
    >>> cfg = KVQuantConfig(key_format="int8", value_format="int8", static_scales="int8-scales.pt")
    >>> cache = KVQuantCache(model.config, cfg)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from kvquant.config import KVQuantConfig
from kvquant.formats import format_spec
from kvquant.transforms import KeyTransform


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
