"""The Triton ``quantize_append`` writes int3, the codebooks (scale search in the kernel) and fp8 scales.

Both sides start from the same poisoned buffers (codes 0xA5, scales / zero points NaN) and are
compared over the whole buffers, so a stray or missing write fails. int3 codes and every fp8 scale
are bit-identical to :func:`kvquant.kernels.quantize_append_ref` (integer arithmetic only). Codebook
codes and scales are bit-identical with fp16 / bf16 / fp8 scales (the rounding to the scale dtype
absorbs the last-bit differences of the kernel's sums, in another order than torch's); with fp32
scales the stored scales may differ by a few ulps, so there the test asserts scales within 1e-6
relative and every group's squared error equal to fp32 rounding (1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import QuantizedBlock, dequantize, format_spec, round_to_dtype
from kvquant.kernels import quantize_append, quantize_append_ref

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from kvquant.kernels.triton._common import round_to_scale_dtype  # noqa: E402 - needs triton

FP8 = torch.float8_e4m3fn
CODEBOOKS = ["nuq4", "nuq3", "nuq2"]


def _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, device, static=None):
    spec = format_spec(fmt)
    codes = torch.full((b, h, cap, spec.code_width(d)), 0xA5, dtype=torch.uint8, device=device)
    codes = codes.view(spec.code_dtype)
    if static is not None:
        return codes, static.clone(), None
    rows, cols = (cap // g, d) if axis == "channel" else (cap, d // g)
    scale = torch.full((b, h, rows, cols), float("nan"), dtype=torch.float32, device=device).to(scale_dtype)
    zero = torch.full_like(scale, float("nan")) if spec.has_zero else None
    return codes, scale, zero


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _run(x, fmt, g, axis, scale_dtype, index, cap, static=None):
    b, h, _, d = x.shape
    got = _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, x.device, static)
    want = _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, x.device, static)
    quantize_append(x, *got, index, fmt, g, axis)
    quantize_append_ref(x, *want, index, fmt, g, axis)
    return got, want


def _assert_equal(got, want, what=""):
    for name, a, e in zip(("codes", "scale", "zero"), got, want, strict=True):
        assert (a is None) == (e is None)
        if e is not None:
            assert torch.equal(_bits(a), _bits(e)), f"{name} differ {what}"


def _inputs(b, h, n, d, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n, d, generator=gen) * torch.logspace(-2, 2, n)[None, None, :, None]
    x[0, 0, 0] = 0.0  # an all-zero group
    return x.to(device, dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32, FP8])
@pytest.mark.parametrize(("axis", "g", "n", "index", "d"), [("token", 16, 37, 3, 64), ("token", 32, 5, 0, 32),
                                                            ("channel", 16, 32, 16, 16)])  # fmt: skip
def test_int3_codes_equal_reference(scale_dtype, axis, g, n, index, d, device):
    x = _inputs(2, 3, n, d, seed=n + d, device=device)
    if scale_dtype == FP8:
        x = x / 100  # 8-bit zero points hold small values only
    _assert_equal(*_run(x, "int3", g, axis, scale_dtype, index, cap=index + n + 16), f"int3 {scale_dtype}")


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_scales_equal_reference(fmt, device):
    """float8_e4m3fn scales (and zero points) rounded outward in the kernel, bit for bit."""
    x = _inputs(2, 2, 21, 32, seed=7, device=device) / 50  # inside the 8-bit scales' range
    _assert_equal(*_run(x, fmt, 16, "token", FP8, 2, cap=30), fmt)
    _assert_equal(*_run(x[:, :, :16], fmt, 16, "channel", FP8, 16, cap=48), f"{fmt} channel")


def test_static_fp8_scale_is_read(device):
    static = (torch.rand(1, 3, 1, 1) * 0.05 + 0.01).to(FP8).to(device)
    x = torch.randn(2, 3, 9, 32, device=device) * 4
    got, want = _run(x, "int8", 32, "token", FP8, 4, cap=16, static=static)
    _assert_equal(got, want)
    assert torch.equal(_bits(got[1]), _bits(static))


@pytest.mark.parametrize("fmt", CODEBOOKS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize(("g", "n", "index", "d"), [(16, 19, 3, 64), (32, 6, 0, 32), (16, 11, 5, 16)])
def test_codebook_codes_equal_reference(fmt, scale_dtype, g, n, index, d, device):
    x = _inputs(2, 3, n, d, seed=n + d + g, dtype=torch.bfloat16, device=device)
    if scale_dtype == FP8:
        x = x / 50
    got, want = _run(x, fmt, g, "token", scale_dtype, index, cap=index + n + 8)
    _assert_equal(got, want, f"{fmt} {scale_dtype} G={g}")
    assert torch.all(got[1][0, 0, index] == 0)  # the all-zero group stores scale 0


@pytest.mark.parametrize("fmt", CODEBOOKS)
def test_codebook_fp32_scales_equal_error(fmt, device):
    """fp32 scales: the search's sums differ from torch's in the last bit; same error per group."""
    n, d, g = 29, 64, 16
    x = _inputs(2, 2, n, d, seed=3, device=device)
    got, want = _run(x, fmt, g, "token", torch.float32, 0, cap=n)
    s_got, s_want = got[1].float(), want[1].float()
    assert torch.allclose(s_got, s_want, rtol=1e-6, atol=0)
    err = []
    for codes, scale in ((got[0], s_got), (want[0], s_want)):
        xr = dequantize(QuantizedBlock(codes, scale, None), fmt, head_dim=d, group_size=g)
        err.append((xr - x.float()).square().view(2, 2, n, d // g, g).sum(-1))  # [B, H, n, D/G]
    assert torch.allclose(err[0], err[1], rtol=1e-5, atol=1e-30)
    same = (_bits(got[0]) == _bits(want[0])).float().mean()
    assert same > 0.99  # the codes themselves differ only where a scale did


@triton.jit
def _round_kernel(p_x, p_up, p_down, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(p_x + o)
    tl.store(p_up + o, round_to_scale_dtype(x, 3, True))
    tl.store(p_down + o, round_to_scale_dtype(x, 3, False))


def test_e4m3_directed_rounding_matches_the_spec(device):
    """Every float8_e4m3fn value, its neighbours' midpoints, values an ulp off, zeros, overflow, NaN."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()  # [n] ascending
    mids = (grid[1:] + grid[:-1]) / 2
    xs = torch.cat([grid, mids, grid.nextafter(grid + 1), grid.nextafter(grid - 1), mids.nextafter(mids + 1)])
    xs = torch.cat([xs, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.5, -449.0, 1e6, float("nan")])])
    n = triton.next_power_of_2(xs.numel())
    x = torch.cat([xs, torch.zeros(n - xs.numel())]).to(device)
    up, down = torch.full_like(x, -1.0), torch.full_like(x, -1.0)
    _round_kernel[(1,)](x, up, down, N=n)
    for got, direction in ((up, +1), (down, -1)):
        want = round_to_dtype(x.cpu(), FP8, direction)
        assert torch.equal(_bits(got.cpu().to(FP8)), _bits(want)), f"direction {direction}"
