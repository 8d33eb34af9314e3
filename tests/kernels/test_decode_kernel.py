"""``quantized_decode_attention`` (Triton) against ``quantized_decode_attention_ref`` (dequantize + fp32 torch).

Error bound. Both sides evaluate the same function of the same codes in fp32: the reference
dequantizes and multiplies, the kernel folds scales / zero points out of its dot products, sums in
another order and carries the fp32 operand of a folded dot as two fp16 halves (22 significant
bits; codes are exact in fp16). The difference is float rounding, relative ~1e-6 (about 120 dB
measured under the interpreter). We require SQNR >= 80 dB (relative RMS error <= 1e-4): margin for
the GPU's ``tf32x3`` dots and approximate ``exp2``, yet ~40 dB tighter than the quantization error
itself (int8 ~ 40 dB, int4 ~ 20 dB), so a wrong scale, zero point, nibble or token fails by far.
``lse`` is compared with an absolute tolerance of 1e-4.

Outputs are preallocated and poisoned with NaN before every kernel call: an element the kernel does
not write stays NaN and fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvquant.formats import QuantizedBlock, dequantize, format_spec, quantize
from kvquant.kernels import merge_attention, quantized_decode_attention, quantized_decode_attention_ref

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from kvquant.kernels.triton.decode_tiles import load_codes  # noqa: E402 - needs triton

MIN_SQNR_DB = 80.0
LSE_ATOL = 1e-4
FORMATS = ["none", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]


def _store(x, fmt, group, axis="token", scale_dtype=torch.float16, static=None):
    """Store buffers holding ``x[B, H, T, D]`` at buffer indices ``[0, T)`` (capacity T + 8, rounded
    up to whole key blocks), laid out as the cache's store lays them out."""
    b, h, t, d = x.shape
    spec = format_spec(fmt)
    g = group or d
    block = g if axis == "channel" else 1
    cap = -(-(t + 8) // block) * block
    width = d if spec.code_dtype is None else spec.code_width(d)
    codes = torch.zeros(b, h, cap, width, dtype=spec.code_dtype or x.dtype, device=x.device)
    scale = zero = None
    if static is not None:
        scale = static.to(scale_dtype).view(1, -1, 1, 1).to(x.device)
    elif spec.code_dtype is not None:
        cols = d // g if axis == "token" else d
        scale = torch.ones(b, h, cap // block, cols, dtype=scale_dtype, device=x.device)
        zero = torch.zeros_like(scale) if spec.has_zero else None
    if t:
        q = quantize(x, fmt, group_size=g, axis=axis, scale_dtype=scale_dtype, static_scale=static)
        codes[:, :, :t] = q.codes
        if static is None and scale is not None:
            scale[:, :, : t // block] = q.scale
            if zero is not None:
                zero[:, :, : t // block] = q.zero
    return codes, scale, zero


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (got.double() - ref.double()).pow(2).sum()
    signal = ref.double().pow(2).sum()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(signal / noise))


def run_both(
    q,
    k,
    v,
    *,
    k_fmt,
    v_fmt,
    start,
    end,
    k_group=None,
    v_group=None,
    k_axis="token",
    softcap=None,
    num_splits=None,
    scale_dtype=torch.float16,
    k_static=None,
    v_static=None,
):
    kst = _store(k, k_fmt, k_group, k_axis, scale_dtype, k_static)
    vst = _store(v, v_fmt, v_group, "token", scale_dtype, v_static)
    b, hq, d = q.shape
    kw = dict(
        k_fmt=k_fmt,
        v_fmt=v_fmt,
        k_group=k_group,
        v_group=v_group,
        k_axis=k_axis,
        start=start,
        end=end,
        scaling=d**-0.5,
        softcap=softcap,
    )
    out = torch.full((b, hq, d), float("nan"), device=q.device)
    lse = torch.full((b, hq), float("nan"), device=q.device)
    got_o, got_l = quantized_decode_attention(q, *kst, *vst, num_splits=num_splits, out=out, lse=lse, **kw)
    assert got_o.data_ptr() == out.data_ptr() and got_l.data_ptr() == lse.data_ptr()
    ref_o, ref_l = quantized_decode_attention_ref(q, *kst, *vst, **kw)
    return got_o, got_l, ref_o, ref_l


def assert_close(got_o, got_l, ref_o, ref_l):
    assert not torch.isnan(got_o).any() and not torch.isnan(got_l).any(), "unwritten (NaN-poisoned) outputs"
    empty = torch.isinf(ref_l)
    assert torch.equal(torch.isinf(got_l), empty)
    assert torch.all(got_o[empty] == 0) and torch.all(got_l[empty] < 0)
    if (~empty).any():
        assert sqnr_db(got_o, ref_o) >= MIN_SQNR_DB, f"SQNR {sqnr_db(got_o, ref_o):.1f} dB"
        assert torch.allclose(
            got_l[~empty], ref_l[~empty], rtol=0, atol=LSE_ATOL * max(1.0, ref_l[~empty].abs().max())
        )


def _inputs(b, hkv, gq, t, d, device, dtype=torch.float16, seed=0, qdtype=None):
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g, device=device) * 2
    k += torch.randn(b, hkv, 1, d, generator=g, device=device)  # channel outliers
    v = torch.randn(b, hkv, t, d, generator=g, device=device)
    q = torch.randn(b, hkv * gq, d, generator=g, device=device)
    return q.to(qdtype or dtype), k.to(dtype), v.to(dtype)


@triton.jit
def unpack_kernel(p_c, p_out, stride_t, stride_w, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  FP8: tl.constexpr):  # fmt: skip
    o_t = tl.arange(0, BT).to(tl.int64)
    b_c = load_codes(p_c, o_t, o_t < BT, stride_t, stride_w, BT, D, BITS, FP8)  # [BT, D]
    o_d = tl.arange(0, D)
    tl.store(p_out + o_t[:, None] * D + o_d[None, :], b_c)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"])
def test_code_unpacking_is_exact(fmt, device):
    """The kernel's in-register decoding of every byte value equals formats.dequantize with scale 1."""
    spec = format_spec(fmt)
    d = 64
    width = spec.code_width(d)
    vals = torch.arange(256, dtype=torch.int32)
    if fmt == "fp8_e4m3":
        vals = vals[(vals & 0x7F) != 0x7F]  # NaN codes are never produced
    elif fmt == "fp8_e5m2":
        vals = vals[(vals & 0x7C) != 0x7C]  # Inf / NaN codes are never produced
    gen = torch.Generator().manual_seed(0)
    extra = vals[torch.randint(0, vals.numel(), (16 * width - vals.numel(),), generator=gen)]
    seq = torch.cat([vals, extra])  # every allowed byte value at least once
    codes = seq[torch.randperm(seq.numel(), generator=gen)].to(torch.uint8).view(16, width)
    out = torch.empty(16, d, device=device)
    fp8 = {"fp8_e4m3": 1, "fp8_e5m2": 2}.get(fmt, 0)
    kernel_codes = (
        codes.view(torch.int8) if fmt == "int8" else codes
    )  # fp8 goes in as bytes, like the launcher
    unpack_kernel[(1,)](kernel_codes.to(device), out, width, 1, BT=16, D=d, BITS=spec.bits, FP8=fp8)
    ones = torch.ones(1, 1, 16, 1)
    zero = torch.zeros_like(ones) if spec.has_zero else None
    want = dequantize(QuantizedBlock(codes.view(spec.code_dtype)[None, None], ones, zero), fmt, head_dim=d)[
        0, 0
    ]
    assert torch.equal(out.cpu(), want)


# --------------------------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("t", "gq"), [(1, 8), (63, 3), (1025, 1)])
def test_every_format_and_length(fmt, t, gq, device):
    q, k, v = _inputs(2, 2, gq, t, 64, device, seed=t)
    start = torch.zeros(2, dtype=torch.long, device=device)
    assert_close(*run_both(q, k, v, k_fmt=fmt, v_fmt=fmt, start=start, end=t))


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "k_axis", "k_group"),
    [("int4", "int4", "channel", 32), ("int8", "int2", "token", None)],
)
def test_long_context_gqa8_padded(k_fmt, v_fmt, k_axis, k_group, device):
    t = 1056
    q, k, v = _inputs(2, 1, 8, t, 64, device, seed=5)
    start = torch.tensor([0, 77], device=device)
    got = run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, k_axis=k_axis, k_group=k_group, start=start, end=1025)
    assert_close(*got)


@pytest.mark.parametrize("gq", [1, 3, 8])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gqa_ratios(fmt, gq, device):
    q, k, v = _inputs(1, 3, gq, 200, 32, device, seed=gq)
    start = torch.zeros(1, dtype=torch.long, device=device)
    assert_close(*run_both(q, k, v, k_fmt=fmt, v_fmt=fmt, start=start, end=200, num_splits=3))


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt"),
    [
        ("int8", "int4"),
        ("int4", "int2"),
        ("fp8_e4m3", "int8"),
        ("int2", "fp8_e5m2"),
        ("none", "int4"),
        ("int4", "none"),
    ],
)
def test_mixed_formats(k_fmt, v_fmt, device):
    q, k, v = _inputs(2, 2, 4, 150, 64, device, seed=3)
    start = torch.tensor([0, 17], device=device)
    assert_close(*run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, start=start, end=150))


@pytest.mark.parametrize(
    ("k_fmt", "k_group"),
    [("int4", 32), ("int2", 16), ("int8", 64), ("fp8_e4m3", 32), ("int4", 48), ("int4", 8)],
)
def test_channel_axis_keys(k_fmt, k_group, device):
    """KIVI keys: per-channel scales folded into q (G a multiple of 16) or per-element (48, 8)."""
    t = 192
    q, k, v = _inputs(2, 2, 3, t, 64, device, seed=k_group)
    start = torch.tensor([5, 40], device=device)  # not block aligned
    got = run_both(
        q, k, v, k_fmt=k_fmt, v_fmt="int4", k_group=k_group, k_axis="channel", start=start, end=t - 3
    )
    assert_close(*got)


@pytest.mark.parametrize(("k_group", "v_group"), [(16, 32), (32, 16), (64, 16)])
def test_channel_groups_token_axis(k_group, v_group, device):
    q, k, v = _inputs(2, 2, 2, 100, 64, device, seed=k_group + v_group)
    start = torch.zeros(2, dtype=torch.long, device=device)
    for k_fmt, v_fmt in [("int4", "int8"), ("fp8_e5m2", "int2")]:
        got = run_both(
            q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, start=start, end=100
        )
        assert_close(*got)


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "group", "qdtype"),
    [
        ("int4", "int4", 64, torch.float16),
        ("int8", "fp8_e4m3", 16, torch.bfloat16),
        ("int3", "nuq3", 32, torch.float32),
    ],
)
def test_channel_groups_fold_their_scales(k_fmt, v_fmt, group, qdtype, device):
    """Per-token scales per channel group (the int4 / int8 / fp8 presets' keys and values) fold out of
    one dot per group (mode 3) instead of a dequantized fp32 tile (mode 2): groups of >= 16 channels
    that divide the head; the result is the reference's, queries of every dtype (bf16 / fp32: split)."""
    from kvquant.kernels.triton.decode_launch import kernel_operand as _operand

    d = 128
    q, k, v = _inputs(2, 2, 3, 70, d, device, seed=group, qdtype=qdtype)
    start = torch.tensor([0, 9], device=device)
    kst, vst = _store(k, k_fmt, group), _store(v, v_fmt, group)
    assert (
        _operand(*kst, k_fmt, group, "token", d)[1] == 3 and _operand(*vst, v_fmt, group, "token", d)[1] == 3
    )
    assert _operand(*_store(k, k_fmt, 8), k_fmt, 8, "token", d)[1] == 2  # below tl.dot's 16
    got = run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, k_group=group, v_group=group, start=start, end=70)
    assert_close(*got)


@pytest.mark.parametrize(("k_fmt", "v_fmt"), [("int8", "int8"), ("fp8_e4m3", "fp8_e5m2"), ("int8", "int4")])
def test_static_scales(k_fmt, v_fmt, device):
    q, k, v = _inputs(2, 2, 3, 90, 64, device, seed=7)
    ks = k.float().abs().amax(dim=(0, 2, 3)) / format_spec(k_fmt).qmax  # [Hkv] calibrated
    vs = v.float().abs().amax(dim=(0, 2, 3)) / format_spec(v_fmt).qmax if v_fmt != "int4" else None
    start = torch.tensor([0, 9], device=device)
    got = run_both(q, k, v, k_fmt=k_fmt, v_fmt=v_fmt, start=start, end=90, k_static=ks, v_static=vs)
    assert_close(*got)


@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_softcap(softcap, device):
    q, k, v = _inputs(2, 2, 2, 130, 64, device, seed=11)
    q = q * 4  # large scores, so the cap bites
    start = torch.tensor([0, 3], device=device)
    assert_close(*run_both(q, k, v, k_fmt="int4", v_fmt="int8", start=start, end=130, softcap=softcap))


@pytest.mark.parametrize("fmt", ["int8", "int2", "none"])
def test_left_padded_batch_and_empty_rows(fmt, device):
    t = 140
    q, k, v = _inputs(5, 2, 3, t, 64, device, seed=13)
    start = torch.tensor([0, 1, 63, t, t + 5], device=device)  # the last two rows see nothing
    got_o, got_l, ref_o, ref_l = run_both(q, k, v, k_fmt=fmt, v_fmt=fmt, start=start, end=t, num_splits=4)
    assert_close(got_o, got_l, ref_o, ref_l)
    assert torch.all(got_o[3:] == 0) and torch.all(got_l[3:] == float("-inf"))


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_num_splits(num_splits, device):
    q, k, v = _inputs(2, 2, 3, 300, 64, device, seed=num_splits)
    start = torch.tensor([0, 100], device=device)
    got = run_both(q, k, v, k_fmt="int4", v_fmt="int4", start=start, end=300, num_splits=num_splits)
    assert_close(*got)


@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["none", "int4"])
def test_dtypes(qdtype, fmt, device):
    q, k, v = _inputs(2, 2, 2, 70, 64, device, dtype=qdtype, seed=17)
    start = torch.zeros(2, dtype=torch.long, device=device)
    for scale_dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = run_both(q, k, v, k_fmt=fmt, v_fmt=fmt, start=start, end=70, scale_dtype=scale_dtype)
        assert_close(*got)


@pytest.mark.parametrize(("d", "t"), [(16, 40), (128, 70), (256, 40)])
def test_head_dims(d, t, device):
    q, k, v = _inputs(1, 2, 2, t, d, device, seed=d)
    start = torch.zeros(1, dtype=torch.long, device=device)
    for fmt in ("int4", "int2", "fp8_e4m3"):
        assert_close(*run_both(q, k, v, k_fmt=fmt, v_fmt=fmt, start=start, end=t))


def test_odd_head_dim_falls_back_to_reference(device):
    q, k, v = _inputs(1, 2, 2, 20, 24, device)
    start = torch.zeros(1, dtype=torch.long, device=device)
    with pytest.warns(UserWarning, match="torch reference"):
        assert_close(*run_both(q, k, v, k_fmt="int8", v_fmt="int8", start=start, end=20))


def test_reference_matches_plain_attention_on_none(device):
    """The spec itself: on the `none` format the reference is ordinary softmax attention."""
    q, k, v = _inputs(2, 2, 3, 50, 32, device, dtype=torch.float32)
    start = torch.tensor([0, 10], device=device)
    o, lse = quantized_decode_attention_ref(q, k, None, None, v, None, None, k_fmt="none", v_fmt="none",
                                            k_group=None, v_group=None, k_axis="token", start=start, end=50,
                                            scaling=0.3)  # fmt: skip
    for b, s in enumerate(start.tolist()):
        kk = k[b, :, s:].repeat_interleave(3, dim=0)  # [Hq, T, D]
        vv = v[b, :, s:].repeat_interleave(3, dim=0)
        scores = torch.einsum("hd,htd->ht", q[b], kk) * 0.3
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1))
        torch.testing.assert_close(o[b], torch.einsum("ht,htd->hd", scores.softmax(-1), vv))


def test_merge_attention_combines_store_and_full_precision_tokens(device):
    """Kernel partial over the store + reference partial over fp tokens == attention over both."""
    q, k, v = _inputs(2, 2, 3, 96, 64, device, seed=21)
    start = torch.tensor([0, 30], device=device)
    kw = dict(k_fmt="none", v_fmt="none", k_group=None, v_group=None, k_axis="token", scaling=0.125)
    o1, l1 = quantized_decode_attention(q, k, None, None, v, None, None, start=start, end=64, **kw)
    zeros = torch.zeros(2, dtype=torch.long, device=device)
    o2, l2 = quantized_decode_attention_ref(
        q, k[:, :, 64:], None, None, v[:, :, 64:], None, None, start=zeros, end=32, **kw
    )
    o, lse = merge_attention([o1, o2], [l1, l2])
    ro, rl = quantized_decode_attention_ref(q, k, None, None, v, None, None, start=start, end=96, **kw)
    assert sqnr_db(o, ro) >= MIN_SQNR_DB
    torch.testing.assert_close(lse, rl, rtol=0, atol=LSE_ATOL)
    empty = torch.full_like(l1, float("-inf"))
    o3, l3 = merge_attention([o1, torch.zeros_like(o1)], [l1, empty])  # an empty part changes nothing
    torch.testing.assert_close(o3, o1)
    torch.testing.assert_close(l3, l1)
    o4, l4 = merge_attention([torch.zeros_like(o1)], [empty])
    assert torch.all(o4 == 0) and torch.all(l4 == float("-inf"))


# --------------------------------------------------------------------------------------------- GPU grid


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("t", [1, 1025, 32768])
@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "k_axis", "k_group"),
    [(f, f, "token", None) for f in FORMATS + ["int3", "nuq4", "nuq3", "nuq2"]]
    + [("int4", "int2", "channel", 32), ("int2", "int2", "channel", 128), ("int8", "int4", "token", 32)]
    + [("nuq4", "int3", "token", 32)],  # the trellis codes: test_decode_tables.py (searched on the GPU)
)
def test_gpu_full_grid(d, t, k_fmt, v_fmt, k_axis, k_group):
    b, hkv, gq = 8, 8, 4
    t_alloc = -(-t // 128) * 128 if k_axis == "channel" else t
    q, k, v = _inputs(b, hkv, gq, t_alloc, d, "cuda", dtype=torch.bfloat16, seed=t + d)
    start = torch.randint(0, max(t // 8, 1), (b,), device="cuda")
    start[0] = 0
    for softcap in (None, 30.0):
        got = run_both(
            q,
            k,
            v,
            k_fmt=k_fmt,
            v_fmt=v_fmt,
            k_axis=k_axis,
            k_group=k_group,
            start=start,
            end=t,
            softcap=softcap,
        )
        assert_close(*got)


@pytest.mark.parametrize("t", [70, 5000])
def test_segments_and_masked_fp_tokens_in_one_call(device, t):
    """The store, a recent window (extra segment) and full-precision tokens under a mask with holes:
    one split launch each, one merge, equal to the references' partials merged by log-sum-exp. Row
    1 has every fp token masked, row 2 nothing at all to attend (out 0, lse -inf)."""
    if device.type == "cpu" and t > 100:
        pytest.skip("interpreter: small shapes")
    from kvquant.kernels.backend import SegmentRead
    from kvquant.kernels.reference import dense_decode_attention_ref

    b, hkv, gq, d, n_fp, n_rec = 3, 2, 4, 64 if device.type == "cpu" else 128, 9, 40
    q, k, v = _inputs(b, hkv, gq, t, d, device, dtype=torch.bfloat16, seed=t)
    _, rk, rv = _inputs(b, hkv, gq, n_rec, d, device, dtype=torch.bfloat16, seed=t + 1)
    _, fk, fv = _inputs(b, hkv, gq, n_fp, d, device, dtype=torch.bfloat16, seed=t + 2)
    valid = torch.rand(b, n_fp, generator=torch.Generator().manual_seed(t)) > 0.4
    valid[0, -1], valid[1:] = True, False
    valid = valid.to(device)
    kst, vst = _store(k, "int4", None, "token"), _store(v, "nuq4", None, "token")
    seg = SegmentRead(*_store(rk, "int8", None, "token"), *_store(rv, "int8", None, "token"), k_fmt="int8",
                      v_fmt="int8", k_group=None, v_group=None, k_axis="token",
                      start=torch.tensor([0, 5, n_rec], device=device), end=n_rec)  # fmt: skip
    kw = dict(k_fmt="int4", v_fmt="nuq4", k_group=None, v_group=None, k_axis="token", scaling=d**-0.5)
    start = torch.tensor([0, t // 2, t], device=device)
    out = torch.full((b, hkv * gq, d), float("nan"), device=device)
    lse = torch.full((b, hkv * gq), float("nan"), device=device)
    got = quantized_decode_attention(
        q,
        *kst,
        *vst,
        **kw,
        start=start,
        end=t,
        fp_k=fk,
        fp_v=fv,
        fp_valid=valid,
        extra=(seg,),
        out=out,
        lse=lse,
    )
    parts = [
        quantized_decode_attention_ref(q, *kst, *vst, **kw, start=start, end=t),
        quantized_decode_attention_ref(q, *seg.tensors(), **dict(kw, **seg.call_kwargs())),
        dense_decode_attention_ref(q, fk, fv, valid, kw["scaling"]),
    ]
    ref = merge_attention([o for o, _ in parts], [x for _, x in parts])
    assert_close(*got, *ref)
    assert torch.isinf(got[1][2]).all() and not torch.isinf(got[1][:2]).any()


@pytest.mark.parametrize("block_t", [16, 32, 128])
def test_block_t_override(block_t, device):
    """Tiles of another size cover the same tokens: same result as the reference (the launch knob
    the GPU sweep uses); a size the kernel cannot take is refused by name."""
    q, k, v = _inputs(2, 2, 3, 150, 64, device, seed=block_t)
    start = torch.tensor([0, 37], device=device)
    kst, vst = _store(k, "int4", 32), _store(v, "fp8_e4m3", None)
    kw = dict(k_fmt="int4", v_fmt="fp8_e4m3", k_group=32, v_group=None, k_axis="token", start=start, end=150,
              scaling=0.125)  # fmt: skip
    got = quantized_decode_attention(q, *kst, *vst, **kw, block_t=block_t, num_warps=4, num_stages=2)
    assert_close(*got, *quantized_decode_attention_ref(q, *kst, *vst, **kw))
    with pytest.raises(ValueError, match="block_t"):
        quantized_decode_attention(q, *kst, *vst, **kw, block_t=24)


def test_table_formats_build_without_pipelining():
    """The GPU measurements behind ``_num_stages``: table formats (codebooks, trellis) launch with one
    stage, formats read as plain codes keep Triton's default."""
    from kvquant.kernels.triton.decode_launch import pipeline_stages as _num_stages

    read = {f: format_spec(f).triton_read() for f in ("int4", "fp8_e4m3", "nuq4", "tcq3")}
    assert _num_stages(read["int4"], read["fp8_e4m3"]) is None
    assert _num_stages(read["nuq4"], read["int4"]) == 1
    assert _num_stages(read["int4"], read["tcq3"]) == 1
