"""The Triton decode kernel reads int3, the codebooks and the trellis codes, and 8-bit scales.

Same contract and bound as ``test_decode_kernel.py`` (SQNR >= 80 dB against the dequantizing fp32
reference, ``lse`` within 1e-4, outputs NaN-poisoned): int3 codes are exact small integers;
codebook and trellis values come from an fp32 table, so those tiles are dequantized in fp32 and
dotted in fp32, the difference from the reference is float rounding alone. A wrong plane, table
entry, neighbour or scale byte moves the output by the quantization step (about 10-20 dB of SQNR),
far below the bound. Interpreter-sized shapes: head_dim 16 / 32 / 64, lengths not multiples of the
tile, batch 2 with different starts, GQA.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvquant.formats import QuantizedBlock, dequantize, format_spec, pack_codes, quantize
from kvquant.kernels import ops, quantized_decode_attention, quantized_decode_attention_ref

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from kvquant.kernels.triton.decode_tiles import load_levels  # noqa: E402 - needs triton

TABLE_FORMATS = ["int3", "nuq4", "nuq3", "nuq2", "tcq3", "tcq2", "tcq1"]
FP8_SCALES = torch.float8_e4m3fn
MIN_SQNR_DB = 80.0
LSE_ATOL = 1e-4


def _inputs(b, hkv, gq, t, d, device, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g) * 2 + torch.randn(b, hkv, 1, d, generator=g)  # outliers
    v = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hkv * gq, d, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _store(x, fmt, group, scale_dtype):
    """``(codes, scale, zero)`` holding ``x[B, H, T, D]`` at indices ``[0, T)`` of a store of T + 5."""
    b, h, t, d = x.shape
    q = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype, encoder=_search(fmt))
    if q.scale is None:
        return torch.cat([x, x.new_zeros(b, h, 5, d)], 2), None, None
    pad = [torch.cat([a, a[:, :, :5].clone().fill_(1)], 2) if a is not None else None for a in (q.codes, q.scale, q.zero)]  # fmt: skip
    return tuple(pad)


def _search(fmt):
    """The trellis search of ``ops.encode`` (C where built: the spec's codes, faster than torch's)."""
    return lambda y, bits: ops.encode(y, fmt)


def sqnr_db(got, ref):
    noise = (got.double() - ref.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def run_both(q, k, v, *, k_fmt, v_fmt, start, end, k_group=None, v_group=None, num_splits=None,
             scale_dtype=torch.float16):  # fmt: skip
    """(kernel out, lse, reference out, lse); the kernel's outputs preallocated and NaN-poisoned."""
    kst, vst = _store(k, k_fmt, k_group, scale_dtype), _store(v, v_fmt, v_group, scale_dtype)
    b, hq, d = q.shape
    kw = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, k_axis="token", start=start, end=end,
              scaling=d**-0.5)  # fmt: skip
    out = torch.full((b, hq, d), float("nan"), device=q.device)
    lse = torch.full((b, hq), float("nan"), device=q.device)
    got_o, got_l = quantized_decode_attention(q, *kst, *vst, num_splits=num_splits, out=out, lse=lse, **kw)
    assert got_o.data_ptr() == out.data_ptr() and got_l.data_ptr() == lse.data_ptr()
    return (got_o, got_l, *quantized_decode_attention_ref(q, *kst, *vst, **kw))


def assert_close(got_o, got_l, ref_o, ref_l):
    assert not torch.isnan(got_o).any() and not torch.isnan(got_l).any(), "unwritten (NaN-poisoned) outputs"
    empty = torch.isinf(ref_l)
    assert torch.equal(torch.isinf(got_l), empty)
    assert torch.all(got_o[empty] == 0)
    if (~empty).any():
        assert sqnr_db(got_o, ref_o) >= MIN_SQNR_DB, f"SQNR {sqnr_db(got_o, ref_o):.1f} dB"
        tol = LSE_ATOL * max(1.0, ref_l[~empty].abs().max())
        assert torch.allclose(got_l[~empty], ref_l[~empty], rtol=0, atol=tol)


@triton.jit
def levels_kernel(p_c, p_lut, p_out, stride_t, stride_w, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  LUT: tl.constexpr, M: tl.constexpr):  # fmt: skip
    o_t = tl.arange(0, BT).to(tl.int64)
    b_v = load_levels(p_c, p_lut, o_t, o_t < BT, stride_t, stride_w, BT, D, BITS, 0, LUT, M)  # [BT, D]
    o_d = tl.arange(0, D)
    tl.store(p_out + o_t[:, None] * D + o_d[None, :], b_v)


@pytest.mark.parametrize("fmt", TABLE_FORMATS)
@pytest.mark.parametrize("d", [16, 64])
def test_values_before_scaling_are_exact(fmt, d, device):
    """In-register decoding (planes, table lookups, trellis states from the neighbours' codes) equals
    formats.dequantize with scale 1, for every code value in every channel position."""
    spec = format_spec(fmt)
    read = spec.triton_read()
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 2**spec.bits, (16, d), generator=gen, dtype=torch.uint8)
    codes[: 2**spec.bits, 0] = torch.arange(2**spec.bits, dtype=torch.uint8)  # every code at the seam
    packed = pack_codes(codes, spec.bits)  # [16, W]
    table = read.table.to(device) if read.table is not None else packed.to(device)
    out = torch.full((16, d), float("nan"), device=device)
    levels_kernel[(1,)](packed.to(device), table, out, packed.shape[1], 1, BT=16, D=d, BITS=read.bits,
                        LUT=read.lut, M=read.state_codes)  # fmt: skip
    ones = torch.ones(1, 1, 16, 1)
    zero = torch.zeros_like(ones) if spec.has_zero else None
    want = dequantize(QuantizedBlock(packed[None, None], ones, zero), fmt, head_dim=d)[0, 0]
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("fmt", TABLE_FORMATS)
@pytest.mark.parametrize(("d", "t", "gq"), [(16, 45, 3), (32, 70, 1), (64, 37, 4)])
def test_every_table_format(fmt, d, t, gq, device):
    q, k, v = _inputs(2, 2, gq, t, d, device, seed=t + d)
    start = torch.tensor([0, 11], device=device)
    assert_close(*run_both(q, k, v, k_fmt=fmt, v_fmt=fmt, start=start, end=t, num_splits=2))


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "k_group", "v_group"),
    [
        ("tcq2", "tcq2", 16, None),  # the tcq2-recent recipe: 8-bit key scales per 16 channels
        ("nuq4", "nuq4", 16, 32),
        ("tcq3", "int4", None, None),
        ("int3", "fp8_e4m3", 32, None),
        ("int8", "nuq2", None, 16),
    ],
)
def test_fp8_scales_and_groups(k_fmt, v_fmt, k_group, v_group, device):
    """Scales stored as float8_e4m3fn bytes (the ``*-recent`` presets), grouped or per head."""
    q, k, v = _inputs(2, 2, 2, 50, 32, device, seed=31)
    if format_spec(k_fmt).has_zero:
        k = k / 100  # 8-bit zero points hold small values only
    start = torch.tensor([3, 0], device=device)
    got = run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, start=start, end=50,
                   scale_dtype=FP8_SCALES)  # fmt: skip
    assert_close(*got)


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt"), [("tcq2", "nuq4"), ("nuq3", "int8"), ("int2", "tcq3"), ("none", "int3")]
)
def test_mixed_with_the_other_formats(k_fmt, v_fmt, device):
    q, k, v = _inputs(2, 1, 8, 41, 32, device, seed=41)  # GQA 8
    start = torch.tensor([0, 40], device=device)  # the second row sees one token
    assert_close(*run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, start=start, end=41))


def test_nothing_to_attend_and_bf16_queries(device):
    q, k, v = _inputs(3, 2, 2, 33, 16, device, dtype=torch.bfloat16, seed=5)
    start = torch.tensor([0, 33, 40], device=device)  # two rows see nothing
    got_o, got_l, ref_o, ref_l = run_both(q, k, v, k_fmt="tcq2", v_fmt="nuq2", start=start, end=33)
    assert_close(got_o, got_l, ref_o, ref_l)
    assert torch.all(got_o[1:] == 0) and torch.all(got_l[1:] == float("-inf"))


def test_the_bound_sees_a_wrong_neighbour(device):
    """The test's bound is tight enough to catch a state read from the wrong neighbours: the same
    codes decoded as if each channel's state were its own code alone (nuq-like) miss it by far."""
    q, k, v = _inputs(1, 1, 2, 20, 32, device, dtype=torch.float32, seed=3)
    start = torch.zeros(1, dtype=torch.long, device=device)
    got_o, _, ref_o, _ = run_both(q, k, v, k_fmt="tcq2", v_fmt="tcq2", start=start, end=20)
    block = quantize(v, "tcq2", encoder=_search("tcq2"))  # codes [1, 1, 20, 8]
    spec = format_spec("tcq2")
    own = spec.triton_read().table[spec.unpack(block.codes).long()]  # each code alone as the state
    wrong = own * block.scale.float()  # [1, 1, 20, 32]
    right = dequantize(block, "tcq2", head_dim=32)
    assert sqnr_db(wrong, right) < 20 and sqnr_db(got_o, ref_o) >= 80


# --------------------------------------------------------------------------------------------- GPU grid


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 1025, 32768])
@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "k_group", "scale_dtype"),
    [("tcq2", "tcq2", 32, FP8_SCALES), ("tcq3", "tcq3", None, torch.float16), ("tcq2", "nuq4", 32, FP8_SCALES),
     ("nuq4", "nuq4", 32, FP8_SCALES), ("int3", "nuq2", None, torch.bfloat16)],
)  # fmt: skip
def test_gpu_full_grid(d, t, k_fmt, v_fmt, k_group, scale_dtype):
    q, k, v = _inputs(8, 8, 4, t, d, "cuda", dtype=torch.bfloat16, seed=t + d)
    start = torch.randint(0, max(t // 8, 1), (8,), device="cuda")
    start[0] = 0
    got = run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, start=start, end=t,
                   scale_dtype=scale_dtype)  # fmt: skip
    assert_close(*got)
