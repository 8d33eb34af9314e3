"""Property-based: random cache configs and random states thrown at ``KVQuantCache.update``.

Each example either raises one clear ``ValueError`` / ``TypeError`` (its message starts with the
field it is about: ``name: ...``) or stores what it was given within the format's error bound:
every position the store quantized comes back within :func:`kvquant.formats.error_bound` of the
same tokens quantized by the spec (the store's codes are bit-identical to it), plus the rounding of
the states' dtype; sinks and the full-precision tail come back exactly.
"""

from __future__ import annotations

import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.formats import error_bound, format_spec, quantize

BOUNDED = ["none", "int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "nuq4", "nuq3", "nuq2"]
CLEAR = re.compile(r"^[a-z_\[\]0-9 ]+: ")  # 'field: what is wrong'


def _cfg(heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=64 * heads, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=64,
    )  # fmt: skip


def _stored_bound(x: torch.Tensor, fmt: str, group: int, axis: str, sdt: torch.dtype) -> torch.Tensor:
    if fmt == "none":
        return torch.zeros_like(x, dtype=torch.float32)
    q = quantize(x, fmt, group_size=group, axis=axis, scale_dtype=sdt)
    return error_bound(q, fmt, x, group_size=group, axis=axis)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    k_fmt=st.sampled_from(BOUNDED),
    v_fmt=st.sampled_from(BOUNDED),
    channel_keys=st.sampled_from([False, False, False, True]),
    k_group=st.one_of(st.none(), st.integers(1, 300)),
    v_group=st.one_of(st.none(), st.integers(1, 300)),
    residual=st.integers(0, 20),
    sinks=st.integers(0, 4),
    head_dim=st.sampled_from([64, 80, 96, 112, 128, 256]),
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    broken=st.sampled_from([None] * 6 + ["key_group_size", "residual_length", "dtype", "heads"]),
    scale_dtype=st.sampled_from(["float16", "float32"]),
    tokens=st.integers(1, 40),
    magnitude=st.sampled_from([1e-2, 1.0, 50.0, 1e6]),
    seed=st.integers(0, 2**16),
)
def test_update_is_refused_clearly_or_within_the_format_bound(
    k_fmt, v_fmt, channel_keys, k_group, v_group, residual, sinks, head_dim, batch, heads, dtype,
    broken, scale_dtype, tokens, magnitude, seed,
):  # fmt: skip
    if channel_keys and k_group is None:
        k_group = 8  # tokens per block: the channel axis needs one
    # one field made invalid in some examples: the refusal must name it
    if broken == "key_group_size":
        k_group = 0
    elif broken == "residual_length":
        residual = -1
    elif broken == "dtype":
        dtype = torch.float64
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, tokens + 1, head_dim, generator=gen, dtype=torch.float64) * magnitude
    k, v = x.to(dtype), (x.flip(-1) * 0.5).to(dtype)
    fields = dict(
        key_format=k_fmt, value_format=v_fmt, key_group_size=k_group, value_group_size=v_group,
        residual_length=residual, sink_tokens=sinks, scale_dtype=scale_dtype,
        key_axis="channel" if channel_keys else "token",
    )  # fmt: skip
    try:
        cfg = KVQuantConfig(**fields)
        cache = KVQuantCache(_cfg(heads), cfg)
        cache.update(k[:, :, :tokens], v[:, :, :tokens], 0)  # a prompt
        if broken == "heads":  # the decode step of another model
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        cache.update(k[:, :, tokens:], v[:, :, tokens:], 0)  # one decode step
    except (ValueError, TypeError) as exc:
        assert CLEAR.match(str(exc)), f"unclear message: {exc}"
        named = {"dtype": "key_states: dtype", "heads": "key_states: kv_heads"}.get(broken, broken)
        if broken is not None and not str(exc).startswith(("scale_dtype", "key_axis")):
            assert str(exc).startswith(named), (broken, str(exc))
        assert "\n" not in str(exc)
        return
    assert broken is None, f"{broken} was accepted"
    layer = cache.layers[0]
    n = tokens + 1
    stored = layer.store_end  # positions [0, stored) are quantized, the rest is the exact tail
    kg, vg = cfg.group_sizes(head_dim)
    sdt = cfg.torch_scale_dtype
    eps = torch.finfo(dtype).eps
    for got, want, fmt, group, axis in (
        (layer.keys, k, k_fmt, kg, cfg.key_axis),
        (layer.values, v, v_fmt, vg, "token"),
    ):
        assert got.shape == (batch, heads, n, head_dim) and got.dtype == dtype
        err = (got.double() - want.double()).abs()
        assert torch.equal(got[:, :, stored:], want[:, :, stored:])  # the tail: exact
        if sinks:
            assert torch.equal(got[:, :, : min(sinks, n)], want[:, :, : min(sinks, n)])
        if stored:
            part = want[:, :, :stored]
            bound = _stored_bound(part, fmt, group, axis, sdt).double()
            bound = bound + part.double().abs() * eps + bound * eps  # the states' dtype rounding
            excess = err[:, :, :stored] - bound
            assert bool((excess <= 1e-12).all()), (fmt, group, axis, excess.max().item())
    if stored and not format_spec(k_fmt).has_scale and not format_spec(v_fmt).has_scale:
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
