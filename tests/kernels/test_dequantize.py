"""``ops.dequantize``: a store's rows back to fp32, what a tier reads when its tokens move on.

The C kernel and the Triton kernel (under the interpreter here) equal the reference
(:func:`kvquant.formats.dequantize`) bit for bit on every format they read, every scale dtype, token
and channel axis, static scales, odd ranges inside the buffer; the cache's tiers read through them
(pass-through ``none`` and meta tensors take the reference).
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import FORMAT_NAMES, quantize
from kvquant.kernels import ops
from kvquant.kernels.cpu import native_available

HAS_C = native_available()
BACKENDS = ["cpu", "triton"]
QUANTIZED = [f for f in FORMAT_NAMES if f != "none"]
SCALE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _buffers(fmt, b, h, t, d, group, axis="token", scale_dtype=torch.float16, static=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g) * torch.linspace(0.1, 3, d)  # channels of other sizes
    if axis == "channel":
        x = x + torch.randn(1, h, 1, d, generator=g) * 4  # per-channel offsets, as keys have
    q = quantize(x, fmt, group_size=group, axis=axis, scale_dtype=scale_dtype, static_scale=static)
    return q.codes, q.scale, q.zero


def _needs(backend):
    if backend == "cpu" and not HAS_C:
        pytest.skip("C kernels not built")
    if backend == "triton":
        pytest.importorskip("triton")


def _both(codes, scale, zero, i0, i1, backend, **kw):
    got = ops.dequantize(codes, scale, zero, i0, i1, backend=backend, **kw)
    want = ops.dequantize(codes, scale, zero, i0, i1, backend="reference", **kw)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    return got, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_kernels_equal_the_reference_bit_for_bit(fmt, scale_dtype, backend):
    _needs(backend)
    d = 64
    for group, (i0, i1) in ((64, (0, 13)), (32, (5, 11)), (16, (12, 13))):
        codes, scale, zero = _buffers(fmt, 2, 3, 13, d, group, scale_dtype=scale_dtype, seed=group)
        got, want = _both(codes, scale, zero, i0, i1, backend, fmt=fmt, group=group, head_dim=d)
        assert torch.equal(got, want), (fmt, group, (got - want).abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int4", "int2", "int8"])
def test_channel_axis_keys_from_inside_a_block(fmt, backend):
    _needs(backend)
    d, group = 32, 5
    codes, scale, zero = _buffers(fmt, 1, 2, 20, d, group, axis="channel")
    for i0, i1 in ((0, 20), (3, 17), (7, 8), (10, 10)):
        got, want = _both(
            codes, scale, zero, i0, i1, backend, fmt=fmt, group=group, axis="channel", head_dim=d
        )
        assert torch.equal(got, want), (i0, i1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_static_scales(fmt, backend):
    _needs(backend)
    d = 128
    static = torch.tensor([0.02, 0.5, 3.0])
    codes, scale, zero = _buffers(fmt, 2, 3, 9, d, d, static=static)
    assert scale.shape == (1, 3, 1, 1)
    got, want = _both(codes, scale, zero, 2, 9, backend, fmt=fmt, group=d, head_dim=d)
    assert torch.equal(got, want)


def test_pass_through_meta_and_bad_ranges():
    x = torch.randn(1, 2, 6, 16, dtype=torch.bfloat16)
    assert ops.backend_for("dequantize", fmt="none", head_dim=16) == "reference"
    assert torch.equal(
        ops.dequantize(x, None, None, 1, 4, fmt="none", group=16, head_dim=16), x[:, :, 1:4].float()
    )
    meta = torch.empty(1, 2, 6, 8, dtype=torch.uint8, device="meta")
    sc = torch.empty(1, 2, 6, 1, dtype=torch.float16, device="meta")
    assert ops.dequantize(meta, sc, sc, 0, 6, fmt="int4", group=16, head_dim=16).shape == (1, 2, 6, 16)
    assert ops.dequantize(x, None, None, 9, 9, fmt="none", group=16, head_dim=16).shape == (1, 2, 0, 16)
    with pytest.raises(ValueError, match=r"i0, i1: need 0 <= i0 <= i1 <= 6"):
        ops.dequantize(x, None, None, 4, 7, fmt="none", group=16, head_dim=16)
    if HAS_C:
        assert ops.backend_for("dequantize", fmt="tcq2", head_dim=64) == "cpu"
        assert ops.backend_for("dequantize", fmt="nuq4", head_dim=1024) == "reference"
