"""``quantize_append`` (Triton) writes exactly what ``quantize_append_ref`` / ``formats.quantize`` write.

Codes, scales and zero points are compared bit for bit, over the whole buffers: both sides start
from the same poisoned buffers (codes 0xA5, scales / zero points NaN), so an element the kernel
fails to write, or writes outside ``[index, index + n)``, fails too. No tolerance anywhere: the
kernel rounds half to even with floor arithmetic and encodes fp8 with integer arithmetic, exactly
like torch, also at exact ``.5`` ties (tested below).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant.formats import format_spec, quantize, unpack_codes
from kvquant.kernels import quantize_append, quantize_append_ref

pytest.importorskip("triton")

QUANT_FORMATS = ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]
SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, device, static=None):
    """Store buffers as TokenStore allocates them, poisoned."""
    spec = format_spec(fmt)
    codes = torch.full((b, h, cap, spec.code_width(d)), 0xA5, dtype=torch.uint8, device=device)
    codes = codes.view(spec.code_dtype)
    if static is not None:
        return codes, static.clone(), None
    rows, cols = (cap // g, d) if axis == "channel" else (cap, d // g)
    scale = torch.full((b, h, rows, cols), float("nan"), dtype=scale_dtype, device=device)
    zero = torch.full_like(scale, float("nan")) if spec.has_zero else None
    return codes, scale, zero


def _bits(t):
    if t is None:
        return None
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def _check(x, fmt, g, axis, scale_dtype, index, cap, static=None):
    b, h, _, d = x.shape
    got = _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, x.device, static)
    want = _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, x.device, static)
    quantize_append(x, *got, index, fmt, g, axis)
    quantize_append_ref(x, *want, index, fmt, g, axis)
    for name, a, e in zip(("codes", "scale", "zero"), got, want, strict=True):
        if e is None:
            assert a is None
            continue
        assert torch.equal(_bits(a), _bits(e)), (
            f"{name} differ for {fmt} {axis} G={g} {scale_dtype} {x.dtype}"
        )
    return got


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize(
    ("axis", "g", "n", "index"),
    [("token", None, 1, 0), ("token", None, 63, 7), ("token", 16, 37, 3), ("channel", 16, 32, 16)],
)
def test_codes_equal_reference(fmt, scale_dtype, axis, g, n, index, device):
    torch.manual_seed(n + index)
    dtype = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16, torch.float32: torch.float32}[
        scale_dtype
    ]
    x = (torch.randn(2, 3, n, 64, device=device) * 3).to(dtype)
    x[0, 0, 0, :] = 0.0  # a zero range -> scale 1
    g = 64 if g is None else g
    _check(x, fmt, g, axis, scale_dtype, index, cap=index + n + 16)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("d", [16, 128])
def test_head_dims_and_non_contiguous_input(fmt, d, device):
    torch.manual_seed(d)
    x = torch.randn(2, 5, 3, d, device=device, dtype=torch.float16).transpose(1, 2)  # [B, H, n, D] view
    assert not x.is_contiguous()
    _check(x, fmt, d, "token", torch.float16, index=2, cap=9)
    _check(x, fmt, d // 2 if d > 16 else d, "token", torch.float16, index=0, cap=5)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_static_scale_is_read_not_written(fmt, device):
    torch.manual_seed(1)
    h = 3
    static = (torch.rand(1, h, 1, 1, device=device) * 0.05 + 0.01).to(torch.float16)
    x = torch.randn(2, h, 9, 32, device=device) * 4  # some values clip at the static range
    codes, scale, _ = _check(x, fmt, 32, "token", torch.float16, index=4, cap=16, static=static)
    assert torch.equal(scale, static)
    q = quantize(x, fmt, scale_dtype=torch.float16, static_scale=static.flatten())
    assert torch.equal(_bits(codes[:, :, 4:13]), _bits(q.codes))


def _tie_rows(fmt: str, d: int) -> torch.Tensor:
    """Rows whose scaled values sit exactly on rounding ties, with a scale of exactly 1."""
    if fmt == "int8":  # amax 127 -> scale 1: y = k + 0.5
        row = torch.arange(d, dtype=torch.float32) - d / 2 + 0.5
        row[0] = 127.0
    elif fmt in ("int4", "int2"):  # min 0, max qmax -> zero 0, scale 1
        qmax = format_spec(fmt).qmax
        row = (torch.arange(d, dtype=torch.float32) % (2 * qmax)) / 2  # 0, .5, 1, 1.5, ...
        row[0], row[1] = 0.0, qmax
    else:  # fp8: amax = largest finite -> scale 1; midpoints between neighbouring fp8 values
        dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        last = 0x7E if fmt == "fp8_e4m3" else 0x7B  # largest finite: 448 / 57344
        vals = (
            torch.arange(0, last + 1, dtype=torch.uint8).view(dt).float()
        )  # positive finite values, ascending
        mids = (vals[:-1] + vals[1:]) / 2  # exact in fp32
        row = torch.cat([mids, -mids])[:d]
        row[0] = format_spec(fmt).qmax
    return row


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_exact_ties_round_half_to_even(fmt, device):
    d = 128
    x = _tie_rows(fmt, d).to(device).expand(1, 2, 3, d).contiguous()
    codes, scale, zero = _check(x, fmt, d, "token", torch.float32, index=0, cap=3)
    assert torch.all(scale == 1.0)
    if fmt in ("int4", "int2"):
        q = unpack_codes(codes, format_spec(fmt).bits).float()
        exp = torch.round(x)  # ties to even
        assert torch.equal(q, exp)


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(QUANT_FORMATS),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
    magnitude=st.sampled_from([1e-4, 1e-2, 1.0, 30.0, 3e3]),
    n=st.integers(1, 20),
    g_div=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_magnitudes(fmt, scale_dtype, magnitude, n, g_div, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(1, 2, n, 32, generator=gen) * magnitude
        + torch.randn(1, 2, n, 1, generator=gen) * magnitude
    )
    _check(x.to(device), fmt, 32 // g_div, "token", scale_dtype, index=1, cap=n + 2)


def test_passthrough_copies(device):
    x = torch.randn(1, 2, 5, 16, device=device, dtype=torch.bfloat16)
    codes = torch.zeros(1, 2, 8, 16, device=device, dtype=torch.bfloat16)
    quantize_append(x, codes, None, None, 3, "none", None)
    assert torch.equal(codes[:, :, 3:8], x) and not codes[:, :, :3].any()


def test_odd_head_dim_falls_back_to_reference(device):
    x = torch.randn(1, 2, 4, 24, device=device)
    got = _buffers("int4", 1, 2, 4, 24, 24, "token", torch.float16, device)
    with pytest.warns(UserWarning, match="torch reference"):
        quantize_append(x, *got, 0, "int4", None)
    q = quantize(x, "int4")
    assert torch.equal(got[0], q.codes) and torch.equal(got[1], q.scale)


def test_float8_scales_are_written_by_the_kernel(device):
    """float8_e4m3fn scales: rounded and stored by the kernel (no fallback, issue 13), the spec's bytes."""
    x = torch.randn(1, 2, 4, 32, device=device) / 50
    got = _buffers("int4", 1, 2, 4, 32, 32, "token", torch.float8_e4m3fn, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_append(x, *got, 0, "int4", None)
    q = quantize(x, "int4", scale_dtype=torch.float8_e4m3fn)
    assert torch.equal(got[0], q.codes) and torch.equal(got[1].float(), q.scale.float())


def test_rejects_bad_layouts(device):
    x = torch.randn(1, 2, 5, 16, device=device)
    codes, scale, zero = _buffers("int4", 1, 2, 16, 16, 16, "channel", torch.float16, device)
    with pytest.raises(ValueError, match="multiples of group_size"):
        quantize_append(x, codes, scale, zero, 0, "int4", 16, "channel")
    with pytest.raises(ValueError, match="capacity"):
        quantize_append(x, codes, scale, zero, 12, "int4", 16, "token")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_large(fmt, d):
    torch.manual_seed(d)
    x = torch.randn(8, 8, 1000, d, device="cuda", dtype=torch.bfloat16) * 5
    _check(x, fmt, d, "token", torch.float16, index=24, cap=1100)
    _check(x, fmt, 32, "token", torch.bfloat16, index=0, cap=1000)
    _check(x[:, :, :992], fmt, 32, "channel", torch.float16, index=32, cap=1024)


def test_package_flags():
    import kvquant.kernels as kk

    assert kk.HAS_TRITON
    assert kk.use_triton(torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"))
    if not torch.cuda.is_available():  # the conftest switched the interpreter on before the import
        assert kk.INTERPRET
