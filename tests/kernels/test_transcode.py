"""``ops.transcode``: a store's rows into another store, what the recent window's oldest tokens cost
when they age into the main store.

The C call (one per K / V) equals its torch twin, ``quantize_append(dequantize(...).to(via))`` on the
reference backend, bit for bit: codes, scales and zero points, every pair of the formats the presets
chain (and a few more), the dtypes a layer holds its tokens in, fp16 / bf16 / fp8 scales; nothing
outside the destination range is touched; values the destination refuses raise its spec's error.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import format_spec, quantize
from kvquant.kernels import ops
from kvquant.kernels.cpu import native_available

needs_c = pytest.mark.skipif(not native_available(), reason="C kernels not built")

SOURCES = ["nuq4", "int4", "int8", "fp8_e4m3"]
TARGETS = ["nuq3", "nuq2", "tcq2", "tcq3", "tcq1", "int4", "int2", "fp8_e4m3", "nuq4"]


def _source(fmt, b, h, t, d, group, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g) * torch.linspace(0.1, 3, d)  # channels of other sizes
    q = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    return (q.codes, q.scale, q.zero, fmt, group, "token")


def _target(fmt, b, h, cap, d, group, scale_dtype):
    """Empty buffers as a store allocates them, poisoned: NaN scales, 0xAB codes."""
    spec = format_spec(fmt)
    codes = torch.full((b, h, cap, spec.code_width(d)), 0xAB, dtype=spec.code_dtype or torch.uint8)
    codes = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    codes = codes.view(spec.code_dtype) if spec.code_dtype is not None else codes
    scale = torch.full((b, h, cap, d // group), float("nan")).to(scale_dtype)
    zero = torch.full((b, h, cap, d // group), float("nan")).to(scale_dtype) if spec.has_zero else None
    return [codes, scale, zero, fmt, group, "token", False]


def _run(src, dst, i0, i1, index, via, d, backend):
    out = [t.clone() if isinstance(t, torch.Tensor) else t for t in dst]
    ops.transcode(src, i0, i1, tuple(out), index, via=via, head_dim=d, backend=backend)
    return out[:3]


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN poison compared as bytes


@needs_c
@pytest.mark.parametrize("via", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dst_fmt", TARGETS)
@pytest.mark.parametrize("src_fmt", SOURCES)
def test_c_equals_the_torch_twin_bit_for_bit(src_fmt, dst_fmt, via):
    d, b, h = 64, 2, 3
    for group, scale_dtype, (i0, i1), index in (
        (64, torch.float16, (3, 4), 7),
        (32, torch.float8_e4m3fn, (0, 5), 0),
        (16, torch.bfloat16, (6, 9), 2),
    ):
        src = _source(
            src_fmt, b, h, 9, d, 64 if src_fmt.startswith("nuq") else group, torch.float16, seed=group
        )
        dst = _target(dst_fmt, b, h, 12, d, group, scale_dtype)
        got = _run(src, dst, i0, i1, index, via, d, "cpu")
        want = _run(src, dst, i0, i1, index, via, d, "reference")
        for name, x, y in zip(("codes", "scale", "zero"), got, want, strict=True):
            assert _same(x, y), (src_fmt, dst_fmt, group, name)
        n = i1 - i0
        before, after = slice(0, index), slice(index + n, None)
        for part in (before, after):  # the poison outside [index, index + n) is untouched
            assert torch.equal(got[0][:, :, part], dst[0][:, :, part])
            assert torch.isnan(got[1][:, :, part].float()).all()


@pytest.mark.parametrize("dst_fmt", ["nuq2", "tcq2", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("src_fmt", ["nuq4", "int8"])
def test_triton_equals_the_torch_twin_bit_for_bit(src_fmt, dst_fmt):
    """On a GPU a transcode is the Triton dequantize kernel, then the quantize kernel (two launches)."""
    pytest.importorskip("triton")
    d, b, h = 64, 2, 3
    for group, scale_dtype, (i0, i1), index, via in (
        (64, torch.float16, (3, 4), 7, torch.float32),
        (32, torch.float8_e4m3fn, (0, 5), 0, torch.bfloat16),
    ):
        src = _source(src_fmt, b, h, 9, d, 64, torch.float16, seed=group)
        dst = _target(dst_fmt, b, h, 12, d, group, scale_dtype)
        got = _run(src, dst, i0, i1, index, via, d, "triton")
        want = _run(src, dst, i0, i1, index, via, d, "reference")
        for name, x, y in zip(("codes", "scale", "zero"), got, want, strict=True):
            assert _same(x, y), (src_fmt, dst_fmt, group, name)


@needs_c
def test_picks_the_c_call_on_cpu_and_composes_elsewhere():
    assert ops.backend_for("transcode", src_fmt="nuq4", dst_fmt="nuq2", head_dim=64) == "cpu"
    assert (
        ops.backend_for("transcode", src_fmt="nuq4", dst_fmt="nuq2", head_dim=64, dst_axis="channel")
        == "cpu+reference"
    )


@needs_c
def test_refused_values_raise_the_destination_spec_error():
    d = 64
    src = _source("int8", 1, 2, 4, d, d, torch.float32)
    src[1].mul_(1e35)  # rows of ~1e36: past fp16's range once rounded through it
    dst = _target("int4", 1, 2, 4, d, d, torch.float16)
    with pytest.raises(ValueError, match="NaN or Inf|scale"):
        ops.transcode(src, 0, 2, tuple(dst), 0, via=torch.float16, head_dim=d)


def test_bad_ranges_and_empty_moves():
    d = 16
    src = _source("int4", 1, 2, 4, d, d, torch.float16)
    dst = _target("int4", 1, 2, 4, d, d, torch.float16)
    with pytest.raises(ValueError, match="i0, i1"):
        ops.transcode(src, 3, 9, tuple(dst), 0, via=torch.float32, head_dim=d)
    ops.transcode(src, 2, 2, tuple(dst), 0, via=torch.float32, head_dim=d)  # nothing moves
    assert torch.isnan(dst[1].float()).all()


@needs_c
@pytest.mark.parametrize("dst_fmt", ["tcq3", "nuq2", "int4"])
def test_a_transcode_plan_moves_as_the_op_call_after_call(dst_fmt):
    """``plan_transcode`` (the two stores described once, a range per call): the same bytes as
    ``transcode``, one token per call as a decode step moves them; refused values raise the
    destination spec's error as there."""
    d = 64
    src = _source("nuq4", 2, 3, 12, d, d, torch.float16, seed=4)
    got = _target(dst_fmt, 2, 3, 16, d, d, torch.float16)
    want = [t.clone() if isinstance(t, torch.Tensor) else t for t in got]
    run = ops.plan_transcode(src, tuple(got), via=torch.float32, head_dim=d)
    for i in range(12):
        run(i, i + 1, 3 + i)
        ops.transcode(src, i, i + 1, tuple(want), 3 + i, via=torch.float32, head_dim=d, backend="reference")
    assert all(_same(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    run(5, 5, 0)  # an empty move writes nothing
    assert all(_same(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    bad = list(src)
    bad[1] = src[1].clone()
    bad[1][1, 2, 7] = float("inf")  # a source scale the destination cannot hold
    with pytest.raises(ValueError, match="NaN or Inf|scale"):
        ops.plan_transcode(tuple(bad), tuple(got), via=torch.float32, head_dim=d)(7, 8, 0)
