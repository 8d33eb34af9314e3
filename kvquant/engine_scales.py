"""Static fp8 KV-cache scales as serving engines read them (compressed-tensors ``kv_cache_scheme``).

vLLM (and SGLang, per tensor) read calibrated KV-cache scales from a checkpoint whose ``config.json``
carries ``quantization_config = {"quant_method": "compressed-tensors", "config_groups": {},
"kv_cache_scheme": {...}}`` and whose safetensors hold, per attention layer ``i``,

``model.layers.{i}.self_attn.k_scale`` / ``v_scale``: fp32, shape ``(1,)`` (strategy ``tensor``) or
``(num_kv_heads, 1, 1)`` (strategy ``attn_head``), meaning ``x ~= fp8_e4m3(x / scale) * scale``:
``scale = amax / 448`` for a calibrated ``amax``.

This module is the one place that knows these names and shapes: it turns kvquant's per-(layer, head)
scales ``[L, H]`` into those tensors and the config fragment, and reads them back from a checkpoint
folder or safetensors file as ``{"keys": [L, H], "values": [L, H]}`` (a per-tensor scale repeated over
the heads), which is what ``KVQuantConfig.static_scales`` takes.

Example:
    >>> import torch
    >>> t = scale_tensors({"keys": torch.ones(2, 3), "values": torch.ones(2, 3)}, "attn_head")
    >>> sorted(t)[0], tuple(t["model.layers.0.self_attn.k_scale"].shape)
    ('model.layers.0.self_attn.k_scale', (3, 1, 1))
    >>> kv_cache_scheme("tensor")["strategy"]
    'tensor'
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

STRATEGIES = ("tensor", "attn_head")
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_NAME = "model.layers.{layer}.self_attn.{which}_scale"
_NAME_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    return strategy


def kv_cache_scheme(strategy: str) -> dict:
    """The ``kv_cache_scheme`` of a static, symmetric fp8 e4m3 cache (compressed-tensors
    ``QuantizationArgs`` fields)."""
    return {
        "num_bits": 8,
        "type": "float",
        "strategy": check_strategy(strategy),
        "dynamic": False,
        "symmetric": True,
    }


def quantization_config(strategy: str) -> dict:
    """``config.json``'s ``quantization_config``: no weight quantization (``config_groups`` empty,
    weights stored dense), fp8 KV cache with static scales."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(strategy),
    }


def reduce_scales(scales: dict[str, torch.Tensor], strategy: str) -> dict[str, torch.Tensor]:
    """``[L, H]`` per-head scales as the strategy keeps them, still ``[L, H]``: ``tensor`` takes each
    layer's largest head scale (the layer's amax / 448) for every head; ``attn_head`` keeps them."""
    check_strategy(strategy)
    out = {}
    for part in ("keys", "values"):
        s = scales[part].float()
        out[part] = s.amax(dim=1, keepdim=True).expand_as(s).clone() if strategy == "tensor" else s.clone()
    return out


def scale_tensors(scales: dict[str, torch.Tensor], strategy: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for per-(layer, head) scales ``{"keys": [L, H], "values": [L, H]}``:
    ``model.layers.{i}.self_attn.{k,v}_scale``, fp32, ``(1,)`` or ``(H, 1, 1)``."""
    reduced = reduce_scales(scales, strategy)
    out = {}
    for which, part in (("k", "keys"), ("v", "values")):
        for layer, row in enumerate(reduced[part]):  # [H]
            t = row[:1].clone() if strategy == "tensor" else row.reshape(-1, 1, 1).clone()
            out[SCALE_NAME.format(layer=layer, which=which)] = t.contiguous()
    return out


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def is_scales_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder or ``.safetensors`` file to read engine scales from (rather than a
    kvquant ``.pt`` calibration file)."""
    path = Path(path).expanduser()
    return path.is_dir() or path.suffix == ".safetensors"


def read_scales(path: str | Path) -> dict[str, torch.Tensor]:
    """``{"keys": [L, H], "values": [L, H]}`` (fp32) from a checkpoint folder (its safetensors index,
    or every ``*.safetensors``) or one safetensors file holding ``model.layers.{i}.self_attn.k_scale`` /
    ``v_scale``. A per-tensor scale ``(1,)`` is repeated over the heads; its head count comes from the
    per-head layers or, when all are per tensor, is 1 (``KVQuantCache`` then broadcasts it)."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    files = _safetensors_files(path)
    if not files:
        raise ValueError(f"static_scales: no safetensors file in {str(path)!r}")
    found: dict[tuple[str, int], torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ValueError(f"static_scales: {str(f)!r} is listed in the index but missing")
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _NAME_RE.match(name)
                if m:
                    found[(m.group(2), int(m.group(1)))] = st.get_tensor(name).float().flatten()
    if not found:
        raise ValueError(
            f"static_scales: {str(path)!r} holds no model.layers.<i>.self_attn.k_scale / v_scale tensors"
        )
    layers = max(i for _, i in found) + 1
    heads = max(t.numel() for t in found.values())
    out = {}
    for which, part in (("k", "keys"), ("v", "values")):
        rows = []
        for i in range(layers):
            t = found.get((which, i))
            if t is None:
                raise ValueError(
                    f"static_scales: {str(path)!r} has no {SCALE_NAME.format(layer=i, which=which)}"
                )
            if t.numel() not in (1, heads):
                raise ValueError(
                    f"static_scales: {SCALE_NAME.format(layer=i, which=which)} has {t.numel()} values; "
                    f"expected 1 (per tensor) or {heads} (per KV head)"
                )
            if not bool((t > 0).all() and t.isfinite().all()):
                raise ValueError(
                    f"static_scales: {SCALE_NAME.format(layer=i, which=which)} must be finite and > 0"
                )
            rows.append(t.expand(heads))
        out[part] = torch.stack(rows)  # [L, H]
    return out
