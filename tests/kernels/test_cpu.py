"""The native CPU decode kernel (kernels/cpu/decode_cpu.c) against its torch twin
(``decode_attention_torch``): every quantized format, odd shapes, GQA ratios, left padding,
static scales, per-channel keys, softcap, split-KV threads; outputs poisoned with NaN before each
call. Plus the fallback when no compiler is found."""

import logging

import pytest
import torch

import kvquant.kernels.cpu as native
import kvquant.kernels.cpu.build as build
from kvquant.formats import format_spec, quantize
from kvquant.kernels import ops
from kvquant.kernels.chunked import decode_attention_torch
from kvquant.kernels.hadamard import rotate_ref

pytestmark = pytest.mark.skipif(not native.native_available(), reason="no C compiler: torch path only")

QUANTIZED = ["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "nuq4", "nuq3", "nuq2"]


def _buffers(fmt, b, h, d, cap, group, scale_dtype):
    """Empty store buffers (codes 0, scales 1, zero points 0) for ``cap`` tokens, token axis."""
    spec = format_spec(fmt)
    codes = torch.zeros(b, h, cap, spec.code_width(d), dtype=spec.code_dtype)
    scale = torch.ones(b, h, cap, d // group, dtype=scale_dtype)
    return codes, scale, torch.zeros_like(scale) if spec.has_zero else None


def _store(fmt, x, group, axis="token", static=None):
    block = quantize(x, fmt, group_size=group, axis=axis, static_scale=static)
    return block.codes, block.scale, block.zero


def _compare(q, k_parts, v_parts, threads=None, **args):
    ref_out, ref_lse = decode_attention_torch(q, *k_parts, *v_parts, **args)
    b, hq, d = q.shape
    out = torch.full((b, hq, d), float("nan"))  # poisoned: an unwritten element fails
    lse = torch.full((b, hq), float("nan"))
    got_out, got_lse = native.decode_attention_native(
        q, *k_parts, *v_parts, threads=threads, out=out, lse=lse, **args
    )
    assert got_out.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # both fp32; they differ in summation order and in exp (a polynomial, relative error < 2e-7)
    scale = ref_out.abs().max().clamp_min(1e-6)
    assert ((got_out - ref_out).abs().max() / scale).item() <= 2e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    assert (got_lse[finite] - ref_lse[finite]).abs().max().item() <= 2e-5 * max(
        1.0, ref_lse.abs().max().item()
    )
    return got_out, got_lse


@pytest.mark.parametrize("k_fmt", QUANTIZED)
@pytest.mark.parametrize("v_fmt", ["int4", "int2", "fp8_e4m3", "nuq3"])
def test_every_format_pair_matches_the_torch_twin(k_fmt, v_fmt):
    torch.manual_seed(0)
    b, h, g, d, t = 2, 2, 3, 64, 63
    k, v = torch.randn(b, h, t, d) * 2 + 0.3, torch.randn(b, h, t, d)
    q = torch.randn(b, h * g, d)
    start = torch.tensor([0, 7])  # the second row is left-padded
    args = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=32, v_group=64, k_axis="token", start=start, end=t, scaling=d**-0.5)  # fmt: skip
    _compare(q, _store(k_fmt, k, 32), _store(v_fmt, v, 64), **args)


@pytest.mark.parametrize(
    "d, g, t, k_group, v_group",
    [
        (16, 1, 1, 16, 8),
        (64, 8, 1025, 64, 16),
        (128, 3, 100, 32, 128),
        (256, 1, 33, 256, 64),
        (48, 2, 17, 16, 48),
        (24, 3, 70, 8, 24),  # not a multiple of 16: the AVX2 path (int4 / int2 / int3 planes: row by row)
        (80, 3, 45, 16, 40),  # AVX2: int4 planes in 8-channel chunks, int2 / int3 planes row by row
        (20, 2, 37, 4, 20),  # not a multiple of 8: the portable C path on every CPU
    ],
)
@pytest.mark.parametrize("fmt", ["int4", "int2", "int8", "nuq4", "int3", "fp8_e4m3", "nuq2", "nuq3"])
def test_odd_shapes_and_gqa_ratios(d, g, t, k_group, v_group, fmt):
    if fmt in ("int2", "nuq2") and d % 4 or fmt in ("int3", "nuq3") and d % 8:
        pytest.skip("int2 packs 4 channels per byte, int3 8")
    torch.manual_seed(1)
    b, h = 3, 2
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    q = torch.randn(b, h * g, d)
    start = torch.tensor([0, t // 2, t - 1])
    args = dict(k_fmt=fmt, v_fmt=fmt, k_group=k_group, v_group=v_group, k_axis="token", start=start, end=t, scaling=0.2)  # fmt: skip
    _compare(q, _store(fmt, k, k_group), _store(fmt, v, v_group), **args)


def test_channel_axis_keys_static_scales_and_softcap():
    torch.manual_seed(2)
    b, h, g, d, t = 2, 2, 4, 64, 96
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    q = torch.randn(b, h * g, d) * 3
    start = torch.tensor([5, 40])  # not multiples of the 32-token key blocks
    args = dict(k_fmt="int4", v_fmt="int2", k_group=32, v_group=64, k_axis="channel", start=start, end=t, scaling=0.125)  # fmt: skip
    _compare(q, _store("int4", k, 32, "channel"), _store("int2", v, 64), **args)
    _compare(q, _store("int4", k, 32, "channel"), _store("int2", v, 64), softcap=2.0, **args)
    static = torch.tensor([0.05, 0.04])  # one calibrated scale per KV head
    args = dict(args, k_fmt="int8", v_fmt="fp8_e4m3", k_axis="token")
    _compare(q, _store("int8", k, 64, static=static), _store("fp8_e4m3", v, 64, static=static), **args)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_split_kv_threads_agree(threads):
    torch.manual_seed(3)
    b, h, g, d, t = 2, 3, 3, 64, 1025
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    q = torch.randn(b, h * g, d)
    start = torch.tensor([0, 600])  # the second row lies wholly in the later splits
    args = dict(k_fmt="int4", v_fmt="int4", k_group=64, v_group=64, k_axis="token", start=start, end=t, scaling=0.125)  # fmt: skip
    _compare(q, _store("int4", k, 64), _store("int4", v, 64), threads=threads, **args)


def test_empty_rows_give_zeros_and_minus_inf():
    torch.manual_seed(4)
    k, v = torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16)
    q = torch.randn(2, 2, 16)
    args = dict(k_fmt="int4", v_fmt="int4", k_group=16, v_group=16, k_axis="token", start=torch.tensor([8, 3]), end=8, scaling=0.25)  # fmt: skip
    out, lse = native.decode_attention_native(q, *_store("int4", k, 16), *_store("int4", v, 16), **args)
    assert torch.equal(out[0], torch.zeros(2, 16)) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


def test_nan_query_poisons_its_row_like_torch():
    k, v = torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    q = torch.randn(1, 2, 16)
    q[0, 1, 3] = float("nan")
    args = dict(k_fmt="int8", v_fmt="int8", k_group=16, v_group=16, k_axis="token", start=torch.tensor([0]), end=40, scaling=0.25)  # fmt: skip
    out, lse = native.decode_attention_native(q, *_store("int8", k, 16), *_store("int8", v, 16), **args)
    ref, _ = decode_attention_torch(q, *_store("int8", k, 16), *_store("int8", v, 16), **args)
    assert torch.isnan(ref[0, 1]).all() and torch.isnan(out[0, 1]).all()
    assert torch.isfinite(out[0, 0]).all()


def test_bad_buffers_and_formats_get_one_clear_error():
    k = torch.randn(1, 1, 4, 16)
    parts = _store("int4", k, 16)
    args = dict(k_fmt="int4", v_fmt="int4", k_group=16, v_group=16, k_axis="token", start=torch.tensor([0]), end=4, scaling=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="out: expected a contiguous float32 tensor"):
        native.decode_attention_native(torch.randn(1, 1, 16), *parts, *parts, out=torch.empty(1, 16), **args)
    with pytest.raises(ValueError, match="k_fmt / v_fmt / head_dim"):
        native.decode_attention_native(torch.randn(1, 1, 16), k, None, None, k, None, None, **dict(args, k_fmt="none", v_fmt="none"))  # fmt: skip


def test_without_a_compiler_attention_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("CC", "no-such-compiler-kvquant")
    monkeypatch.setenv("KVQUANT_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvquant"):
        assert not native.native_available()
    assert "no C compiler" in caplog.text and "torch path" in caplog.text
    with pytest.raises(RuntimeError, match="unavailable"):
        native.decode_attention_native(torch.randn(1, 1, 16), *[None] * 6, k_fmt="int4", v_fmt="int4", k_group=16, v_group=16, k_axis="token", start=torch.tensor([0]), end=0, scaling=1.0)  # fmt: skip
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("KVQUANT_NATIVE", "0")
    monkeypatch.delenv("CC")
    assert not native.native_available()
    assert build._state["error"] == "disabled by KVQUANT_NATIVE=0"


def test_the_build_is_cached_by_source_flags_and_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("KVQUANT_CACHE", str(tmp_path))
    assert native.native_available()
    built = list((tmp_path / "native").glob("decode_cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(build, "_state", {})
    assert native.native_available()  # a second process reuses the file
    assert built[0].stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "native").iterdir()] == [built[0].name]  # no temp files left


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_scales_are_read_in_their_stored_dtype(scale_dtype, axis):
    torch.manual_seed(5)
    b, h, g, d, t = 1, 2, 2, 64, 64
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    q = torch.randn(b, h * g, d)
    kq = quantize(k, "int4", group_size=16 if axis == "channel" else 32, axis=axis, scale_dtype=scale_dtype)
    vq = quantize(v, "int2", group_size=32, scale_dtype=scale_dtype)
    assert kq.scale.dtype == scale_dtype
    args = dict(k_fmt="int4", v_fmt="int2", k_group=16 if axis == "channel" else 32, v_group=32, k_axis=axis, start=torch.tensor([3]), end=t, scaling=0.125)  # fmt: skip
    _compare(q, (kq.codes, kq.scale, kq.zero), (vq.codes, vq.scale, vq.zero), **args)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_token_scales_folded_are_read_in_their_stored_dtype(scale_dtype, strided, groups):
    """The fold of the token-axis scales out of the dots (one per token, or 2 and 4 groups per row:
    the block's scales converted as one run): int4 keys with zero points, nuq4 values without, 61
    tokens from 3 (whole and partial 16- and 8-token blocks), and scales that are every other
    element of a wider buffer (the token by token fallback)."""
    torch.manual_seed(6)
    b, h, g, d, t = 2, 2, 3, 64, 61
    k, v = torch.randn(b, h, t, d) * 3, torch.randn(b, h, t, d)
    k[..., : d // 2] *= 8  # (groups whose scales differ)
    q = torch.randn(b, h * g, d)
    gs = d // groups
    kq = quantize(k, "int4", group_size=gs, scale_dtype=scale_dtype)
    vq = quantize(v, "nuq4", group_size=gs, scale_dtype=scale_dtype)
    k_parts, v_parts = [kq.codes, kq.scale, kq.zero], [vq.codes, vq.scale, vq.zero]
    if strided:  # [B, H, T, groups] views with a token stride of 2 groups
        for parts, i in ((k_parts, 1), (k_parts, 2), (v_parts, 1)):
            parts[i] = torch.cat([parts[i], torch.full_like(parts[i], float("nan"))], -1)[..., :groups]
        assert k_parts[1].stride(2) == 2 * groups
    args = dict(k_fmt="int4", v_fmt="nuq4", k_group=gs, v_group=gs, k_axis="token", start=torch.tensor([3, 0]), end=t, scaling=0.125)  # fmt: skip
    _compare(q, k_parts, v_parts, **args)


# ------------------------------------------------------------------------------------ quantize-and-append


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [None, 16])
def test_native_quantize_is_bit_exact_with_the_torch_spec(fmt, scale_dtype, group):
    torch.manual_seed(6)
    b, h, n, d = 2, 3, 37, 64
    x = torch.randn(b, h, n, d) * torch.logspace(-6, 3, n)[None, None, :, None]  # tiny .. large rows
    x[0, 0, 0] = 0.25  # a constant group: scale 1 by the spec
    x[1, 2, 5, :16] = 0.0
    x[1, 1, 7] = 3e-8  # scales / zero points underflow to fp16 subnormals
    codes, scale, zero = _buffers(fmt, b, h, d, 64, group or d, scale_dtype)
    index = 5
    assert native.quantize_into(x, codes, scale, zero, index, fmt)
    ref = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    assert torch.equal(codes[:, :, index : index + n], ref.codes)
    assert torch.equal(scale[:, :, index : index + n], ref.scale)
    if ref.zero is not None:
        assert torch.equal(zero[:, :, index : index + n], ref.zero)
    assert (codes[:, :, :index] == 0).all() and (codes[:, :, index + n :] == 0).all()


def test_native_quantize_refuses_what_the_spec_refuses():
    buffers = _buffers("int4", 1, 1, 16, 8, 16, torch.float16)
    bad = torch.randn(1, 1, 2, 16)
    bad[0, 0, 1, 3] = float("nan")
    assert not native.quantize_into(bad, *buffers, 0, "int4")  # the caller's torch path raises
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(bad, "int4")
    huge = torch.full((1, 1, 1, 16), 1e6)
    huge[..., 0] = -1e6
    assert not native.quantize_into(huge, *buffers, 0, "int4")  # scale beyond fp16
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(huge, "int4")
    # formats / layouts it does not write: the ops take another backend
    assert ops.backend_for("quantize_append", fmt="fp8_e4m3", head_dim=16, static_scale=True) != "cpu"
    assert ops.backend_for("quantize_append", fmt="nuq4", head_dim=16, group_size=4, axis="channel") != "cpu"
    assert ops.backend_for("quantize_append", fmt="int4", head_dim=16, group_size=4, axis="channel") == "cpu"


@pytest.mark.parametrize("fmt", ["int2", "int3", "int4", "int8"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_native_quantize_along_the_channel_axis_is_the_spec_bit_for_bit(fmt, scale_dtype):
    """KIVI's keys: one scale (and zero point) per channel of a block of G tokens, blocks written at
    a block index past the start; buffers poisoned (codes 0xA5, scales NaN) outside the rows written."""
    torch.manual_seed(11)
    b, h, g, d, blocks = 2, 3, 16, 80, 3  # 80: int4 planes of 40, int2 of 20, int3 of 20 + 10 bytes
    x = torch.randn(b, h, blocks * g, d) * 2.5 + 0.7
    x[0, 1, :g, 5] = 0.25  # a constant channel in a block: scale 1 by the spec
    x[1, 2, g : 2 * g, 7] = 3e-8  # statistics that underflow in the scale dtype
    spec = format_spec(fmt)
    cap = (blocks + 2) * g
    codes = torch.full((b, h, cap, spec.code_width(d)), 0xA5, dtype=torch.uint8)
    scale = torch.full((b, h, cap // g, d), float("nan")).to(scale_dtype)
    zero = torch.full_like(scale, float("nan")) if spec.has_zero else None
    assert native.quantize_into(x, codes.view(spec.code_dtype), scale, zero, g, fmt, g)
    ref = quantize(x, fmt, group_size=g, axis="channel", scale_dtype=scale_dtype)
    written = slice(g, (blocks + 1) * g)
    assert torch.equal(codes[:, :, written], ref.codes.view(torch.uint8))
    assert torch.equal(scale[:, :, 1 : blocks + 1].view(torch.uint8), ref.scale.view(torch.uint8))
    if spec.has_zero:
        assert torch.equal(zero[:, :, 1 : blocks + 1].view(torch.uint8), ref.zero.view(torch.uint8))
        assert zero[:, :, 0].float().isnan().all() and zero[:, :, blocks + 1 :].float().isnan().all()
    assert (codes[:, :, :g] == 0xA5).all() and (codes[:, :, (blocks + 1) * g :] == 0xA5).all()
    assert scale[:, :, 0].float().isnan().all() and scale[:, :, blocks + 1 :].float().isnan().all()
    bad = x.clone()
    bad[1, 0, 2 * g + 3, 9] = float("inf")
    assert not native.quantize_into(bad, codes.view(spec.code_dtype), scale, zero, 0, fmt, g)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(bad, fmt, group_size=g, axis="channel", scale_dtype=scale_dtype)
    with pytest.raises(
        ValueError, match="multiples of group_size 16"
    ):  # a part of a block: refused, not read past
        native.quantize_into(x[:, :, : g + 3], codes.view(spec.code_dtype), scale, zero, 0, fmt, g)


def _with_fp_tokens(fmts, groups, t, n, heads, start, valid, seed):
    """A store of ``t`` tokens (K / V formats ``fmts``, groups ``groups``) plus ``n`` full-precision
    tokens (``valid [B, n]`` or None): (the C kernel's out and lse, the reference's: the torch store
    partial merged with the dense one)."""
    from kvquant.kernels.reference import dense_decode_attention_ref, merge_attention

    torch.manual_seed(seed)
    b, (h, g), d = 2, heads, 64
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    fk, fv = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    q = torch.randn(b, h * g, d)
    args = dict(k_fmt=fmts[0], v_fmt=fmts[1], k_group=groups[0], v_group=groups[1], k_axis="token",
                start=torch.tensor(start), end=t, scaling=0.125)  # fmt: skip
    kp, vp = _store(fmts[0], k, groups[0]), _store(fmts[1], v, groups[1])
    s_out, s_lse = decode_attention_torch(q, *kp, *vp, **args)
    f_out, f_lse = dense_decode_attention_ref(q, fk, fv, valid, 0.125)
    ref, ref_lse = merge_attention([s_out, f_out], [s_lse, f_lse])
    out = torch.full_like(ref, float("nan"))
    got, lse = native.decode_attention_native(q, *kp, *vp, fp_k=fk, fp_v=fv, fp_valid=valid, out=out, **args)
    return (got, lse), (ref, ref_lse)


@pytest.mark.parametrize("with_mask", [True, False])
def test_full_precision_tokens_join_the_same_softmax(with_mask):
    torch.manual_seed(7)
    valid = torch.rand(2, 7) > 0.3 if with_mask else None
    if valid is not None:
        valid[:, -1] = True  # the new token always counts
    (got, _), (ref, _) = _with_fp_tokens(("int4", "nuq2"), (64, 32), 50, 7, (2, 3), [0, 9], valid, seed=7)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 2e-5


def test_full_precision_tokens_masked_for_a_whole_block():
    """Full-precision tokens masked for 8+ tokens in a row (a sliding window's start): a block with no
    weight at all, before and after the quantized tokens' scores, gives them no weight."""
    valid = torch.zeros(2, 21, dtype=torch.bool)
    valid[:, -1] = True  # only the new token
    valid[1, 3] = True
    (got, lse), (ref, ref_lse) = _with_fp_tokens(
        ("int8", "int4"), (64, 32), 30, 21, (1, 2), [0, 30], valid, seed=8
    )
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 2e-5
    assert (lse - ref_lse).abs().max().item() <= 2e-5 * ref_lse.abs().max().item()


@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx2"])
def test_the_portable_c_path_matches_too(flag, monkeypatch, tmp_path):
    """The kernel built without AVX-512 (the AVX2 path, what AMD EPYC runs) or without AVX2 (the
    portable loops, what other CPUs run): same results."""
    import os
    import shutil as sh

    monkeypatch.setenv("KVQUANT_CACHE", str(tmp_path))
    flags = (*build.CFLAGS, flag)
    cc = sh.which(os.environ.get("CC", "cc"))
    monkeypatch.setitem(build._state, "lib", build._load(build._build(cc, flags)))
    test_every_format_pair_matches_the_torch_twin("int4", "nuq3")
    test_every_format_pair_matches_the_torch_twin("int3", "fp8_e4m3")
    test_channel_axis_keys_static_scales_and_softcap()
    test_odd_shapes_and_gqa_ratios(24, 3, 70, 8, 24, "int2")
    test_odd_shapes_and_gqa_ratios(80, 3, 45, 16, 40, "int3")
    test_odd_shapes_and_gqa_ratios(16, 1, 1, 16, 8, "nuq4")
    test_scales_are_read_in_their_stored_dtype(torch.float8_e4m3fn, "channel")
    test_split_kv_threads_agree(2)
    test_full_precision_tokens_join_the_same_softmax(True)
    test_full_precision_tokens_masked_for_a_whole_block()
    test_native_quantize_is_bit_exact_with_the_torch_spec("int4", torch.float16, 16)
    test_native_quantize_is_bit_exact_with_the_torch_spec("int3", torch.bfloat16, None)
    for d in (6, 16, 24, 64, 80, 96, 192):  # the rotation's 16- and 8-lane passes, and the scalar loop
        x = torch.randn(37, d) * 3
        assert torch.equal(ops.rotate(x, backend="cpu"), rotate_ref(x))
    k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    mean = k.mean(2, keepdim=True)
    got_k, got_v = ops.rotate_pair(k, v, mean=mean, backend="cpu")
    assert torch.equal(got_k, rotate_ref(k - mean)) and torch.equal(got_v, rotate_ref(v))


def test_a_channel_axis_store_is_written_in_c_by_its_block():
    from kvquant.cache.store import TokenStore

    store = TokenStore("int4", 16, "channel", torch.float16)
    store.allocate(1, 2, 64, 64, torch.float32, torch.device("cpu"))
    x = torch.randn(1, 2, 32, 64)
    assert native.native_quantizes(store, x) and native.quantize_into_store(store, 16, x)
    ref = quantize(x, "int4", group_size=16, axis="channel")
    assert torch.equal(store.codes[:, :, 16:48], ref.codes)
    assert torch.equal(store.scale[:, :, 1:3], ref.scale) and torch.equal(store.zero[:, :, 1:3], ref.zero)
