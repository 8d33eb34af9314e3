"""The C kernels on the formats they gained for issue 13: trellis decode (tcq2 / tcq3, alone and
mixed with the other formats), codebook, fp8 and trellis quantize-and-append. Each against its torch twin
(``decode_attention_torch``, :func:`kvquant.formats.quantize`) on odd shapes, outputs poisoned with
NaN before the call; and through :mod:`kvquant.kernels.ops`, which now names ``cpu`` for them."""

import os
import shutil

import pytest
import torch

import kvquant.kernels.cpu as native
import kvquant.kernels.cpu.build as build
from kvquant.formats import format_spec, quantize
from kvquant.formats.trellis import trellis_decode
from kvquant.kernels import ops
from kvquant.kernels.chunked import decode_attention_torch
from kvquant.kernels.reference import dense_decode_attention_ref, merge_attention

pytestmark = pytest.mark.skipif(not native.native_available(), reason="no C compiler: torch path only")


def _store(fmt, x, group, scale_dtype=torch.float16):
    block = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    return block.codes, block.scale, block.zero


def _close(got, ref):
    """Same values up to fp32 summation order and the kernel's exp (relative error < 2e-7): the
    bound the integer formats are held to (test_cpu.py)."""
    (go, gl), (ro, rl) = got, ref
    assert not torch.isnan(go).any() and not torch.isnan(gl).any()
    scale = ro.abs().max().clamp_min(1e-6)
    assert ((go - ro).abs().max() / scale).item() <= 2e-5
    finite = torch.isfinite(rl)
    assert torch.equal(finite, torch.isfinite(gl))
    assert (gl[finite] - rl[finite]).abs().max().item() <= 2e-5 * max(1.0, rl[finite].abs().max().item())


def _decode(k_fmt, v_fmt, *, d, t=77, b=2, hkv=3, g=3, k_group=None, v_group=None, scale_dtype=torch.float16,
            n_fp=0, seed=0, threads=None):  # fmt: skip
    """Native decode of a random store against the torch twin (merged with the fp tokens)."""
    torch.manual_seed(seed)
    k, v = torch.randn(b, hkv, t, d) * 1.5 + 0.2, torch.randn(b, hkv, t, d)
    q = torch.randn(b, hkv * g, d)
    k_group, v_group = k_group or d, v_group or d
    kp, vp = _store(k_fmt, k, k_group, scale_dtype), _store(v_fmt, v, v_group, scale_dtype)
    start = torch.tensor([0, 19, 5, t][:b])  # rows start at different buffer indices
    args = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, k_axis="token", start=start, end=t, scaling=d**-0.5)  # fmt: skip
    ref = decode_attention_torch(q, *kp, *vp, **args)
    fp = {}
    if n_fp:
        fk, fv = torch.randn(b, hkv, n_fp, d), torch.randn(b, hkv, n_fp, d)
        valid = torch.rand(b, n_fp) > 0.3
        valid[:, -1] = True
        dense = dense_decode_attention_ref(q, fk, fv, valid, args["scaling"])
        ref = merge_attention([ref[0], dense[0]], [ref[1], dense[1]])
        fp = dict(fp_k=fk, fp_v=fv, fp_valid=valid)
    out = torch.full((b, hkv * g, d), float("nan"))  # poisoned: an unwritten element fails
    lse = torch.full((b, hkv * g), float("nan"))
    got = native.decode_attention_native(q, *kp, *vp, **args, **fp, threads=threads, out=out, lse=lse)
    assert got[0].data_ptr() == out.data_ptr()
    _close(got, ref)
    return (q, *kp, *vp), args, fp, ref


# ------------------------------------------------------------------------------------ trellis decode


@pytest.mark.parametrize("fmt", ["tcq1", "tcq2", "tcq3"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])  # (D % 64 == 0: read from the packed bytes)
def test_trellis_decode_matches_the_torch_twin(fmt, d):
    _decode(fmt, fmt, d=d, seed=d)
    _decode(fmt, fmt, d=d, k_group=d // 2, v_group=16, seed=d + 1)  # several scales per head


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt"),
    [
        ("tcq3", "tcq2"),
        ("tcq2", "tcq1"),
        ("tcq1", "nuq4"),
        ("tcq2", "nuq4"),
        ("nuq3", "tcq3"),
        ("int4", "tcq2"),
        ("tcq3", "fp8_e4m3"),
        ("tcq2", "int8"),
    ],
)
def test_trellis_mixed_with_every_family(k_fmt, v_fmt):
    _decode(k_fmt, v_fmt, d=64, k_group=32, seed=3)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_trellis_scales_in_their_stored_dtype(scale_dtype):
    _decode("tcq3", "tcq2", d=64, v_group=32, scale_dtype=scale_dtype, seed=4)


def test_trellis_with_full_precision_tokens_and_threads():
    _decode("tcq3", "tcq2", d=64, n_fp=5, seed=5)
    _decode("tcq2", "tcq3", d=128, t=1031, threads=3, n_fp=2, seed=6)  # split-KV, merged in C


@pytest.mark.parametrize("fmt", ["tcq2", "tcq3"])
def test_trellis_heads_not_a_multiple_of_16_or_8(fmt):
    _decode(fmt, fmt, d=24, g=2, seed=7)  # (D % 16: the AVX2 path, or row by row)
    _decode(fmt, "int4", d=8, g=1, t=5, seed=8)  # a head of little more than one state
    if fmt == "tcq2":  # (3-bit planes need D % 8 == 0)
        _decode(fmt, "nuq2", d=20, g=2, t=13, seed=13)  # D % 8: the row-by-row path on every CPU


@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx2"])
def test_the_builds_for_other_cpus_read_trellis_codes_too(flag, monkeypatch, tmp_path):
    """The kernel built without AVX-512 (the AVX2 path alone) or without AVX2 (the portable loops):
    same results, decode and quantize. (Trellis stores take the AVX2 path in every build with AVX2:
    the default build's AVX-512 head leaves them to it.)"""
    monkeypatch.setenv("KVQUANT_CACHE", str(tmp_path))
    cc = shutil.which(os.environ.get("CC", "cc"))
    lib = build._load(build._build(cc, (*build.CFLAGS, flag)))
    monkeypatch.setitem(build._state, "lib", lib)
    _decode("tcq3", "tcq2", d=64, v_group=32, n_fp=3, seed=9)
    _decode("tcq2", "nuq4", d=96, scale_dtype=torch.float8_e4m3fn, seed=10)
    _decode("tcq3", "tcq3", d=32, seed=12)
    test_codebook_quantize_matches_the_spec("nuq4", torch.float16, 96, 32)  # the scalar loops
    test_codebook_quantize_matches_the_spec("nuq2", torch.float8_e4m3fn, 64, 16)
    test_fp8_and_integer_quantize_are_bit_exact("fp8_e5m2", torch.bfloat16, 16)
    test_fp8_casts_round_to_nearest_even_with_saturation()
    test_trellis_quantize_matches_the_spec("tcq2", torch.float8_e4m3fn, 64, 32)
    test_trellis_quantize_matches_the_spec("tcq3", torch.float16, 96, None)


def test_ops_dispatch_names_cpu_for_trellis_decode():
    for fmt in ("tcq2", "tcq3"):
        assert ops.backend_for("decode_attention", fmt=fmt, head_dim=64) == "cpu"
        assert (
            ops.backend_for("decode_attention", k_fmt=fmt, v_fmt="nuq4", head_dim=96, fp_tokens=True) == "cpu"
        )
    assert ops.backend_for("decode_attention", fmt="tcq2", head_dim=1024) == "chunked"  # C: up to 512
    tensors, args, fp, ref = _decode("tcq3", "tcq2", d=64, n_fp=4, seed=11)
    _close(ops.decode_attention(*tensors, **args, **fp), ref)
    _close(ops.decode_attention(*tensors, **args, **fp, backend="cpu"), ref)


@pytest.mark.parametrize("d", [256, 512])
def test_trellis_decode_on_wide_heads(d):
    _decode("tcq2", "tcq3", d=d, t=21, hkv=1, g=3, v_group=64, seed=d)  # 512: codes unpacked to bytes first
    _decode(
        "tcq1", "tcq1", d=d, t=21, hkv=1, g=3, k_group=64, seed=d + 1
    )  # (the 1-bit bit string: D / 64 words)


# ------------------------------------------------------------------------------------ quantize-and-append

SCALE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _rows(x, fmt, group, scale_dtype, index=5, cap=50):
    """Native quantize of ``x`` into poisoned buffers at ``index``; the written codes / scale / zero
    beside the spec's block (codes and scales as bytes where the dtype is 8-bit)."""
    spec = format_spec(fmt)
    b, h, n, d = x.shape
    g = group or d
    codes = torch.full((b, h, cap, spec.code_width(d)), 0xA5, dtype=torch.uint8)
    scale = torch.full((b, h, cap, d // g), float("nan")).to(scale_dtype)  # poisoned
    zero = torch.full_like(scale, float("nan")) if spec.has_zero else None
    assert native.quantize_into(x, codes.view(spec.code_dtype), scale, zero, index, fmt)
    assert (codes[:, :, :index] == 0xA5).all() and (codes[:, :, index + n :] == 0xA5).all()
    ref = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    got = (codes[:, :, index : index + n], scale[:, :, index : index + n], None if zero is None else zero[:, :, index : index + n])  # fmt: skip
    return got, ref


def _x(b, h, n, d, seed, scale_dtype):
    torch.manual_seed(seed)
    x = torch.randn(b, h, n, d) * torch.logspace(-3, 2, n)[None, None, :, None]  # small .. large rows
    x[0, 0, 0] = 0.25  # a constant row
    x[-1, -1, n // 2, :16] = 0.0  # an all-zero group (group 16): scale 0
    x[0, -1, 1, 5] = -7.5e-4
    if scale_dtype == torch.float8_e4m3fn:
        x = x.clamp(-40, 40)  # scales within e4m3's range
    return x


def _bytes(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("fmt", ["nuq4", "nuq3", "nuq2"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize(("d", "group"), [(64, None), (64, 16), (96, 32), (128, 64), (32, None)])
def test_codebook_quantize_matches_the_spec(fmt, scale_dtype, d, group):
    """Codes and scales equal the spec's, except where torch's vectorized sqrt lands one ulp off
    (quantize_cpu.c): such a group's scale may differ by one step of its dtype, its codes are those
    its own scale picks, and its squared error equals the spec's to fp32 rounding."""
    spec = format_spec(fmt)
    x = _x(2, 3, 37, d, d + spec.bits, scale_dtype)
    (codes, scale, _), ref = _rows(x, fmt, group, scale_dtype)
    equal = _bytes(scale) == _bytes(ref.scale)  # [B, H, n, D/G] groups with the spec's scale
    assert equal.float().mean() >= 0.97  # (on this data: all but a few fp32 groups)
    same = equal.all(-1)  # rows with every scale equal: every code equal
    assert torch.equal(codes[same], ref.codes[same])
    g = group or d

    def sq_err(c, s, xs):  # [D/G] squared error of each group
        v = spec.levels[spec.unpack(c).long()].view(-1, g) * s.float()[:, None]
        return (v - xs.view(-1, g)).square().sum(-1)

    for got_c, got_s, want_c, want_s, xs in zip(
        codes[~same], scale[~same], ref.codes[~same], ref.scale[~same], x[~same], strict=True
    ):
        assert ((got_s.float() - want_s.float()).abs() <= want_s.float() * 2**-7).all()  # a step at most
        assert torch.allclose(sq_err(got_c, got_s, xs), sq_err(want_c, want_s, xs), rtol=1e-4, atol=0)
    zero_row = scale[-1, -1, 37 // 2].float()
    if group == 16:
        assert zero_row[0] == 0  # the all-zero group: scale 0 (exact zeros)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", [None, 16])
def test_fp8_and_integer_quantize_are_bit_exact(fmt, scale_dtype, group):
    x = _x(2, 3, 33, 64, 20, scale_dtype)
    x[1, 0, 3, 7] = 1e-9  # fp8: subnormal codes, ties to even
    (codes, scale, zero), ref = _rows(x, fmt, group, scale_dtype)
    assert torch.equal(codes, ref.codes.view(torch.uint8))
    assert torch.equal(_bytes(scale), _bytes(ref.scale))
    if zero is not None:
        assert torch.equal(_bytes(zero), _bytes(ref.zero))


def test_fp8_casts_round_to_nearest_even_with_saturation():
    """Every e4m3 / e5m2 byte's value, the midpoints between neighbours and values beyond the range,
    through the kernel with scale 1 (max|x| = qmax): the cast torch makes."""
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        spec = format_spec(fmt)
        grid = torch.arange(256, dtype=torch.uint8).view(spec.code_dtype).float()
        grid = grid[torch.isfinite(grid)].unique()  # ascending
        mids = (grid[1:] + grid[:-1]) / 2
        vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
        vals = vals[vals.abs() <= spec.qmax]
        n = -(-vals.numel() // 64) * 64
        x = torch.zeros(n)
        x[: vals.numel()] = vals
        x = x.view(1, 1, -1, 64)
        x[..., 0] = spec.qmax  # scale 1 for every row
        (codes, scale, _), ref = _rows(x, fmt, None, torch.float32, index=0, cap=x.shape[2])
        assert (scale == 1).all() and torch.equal(codes, ref.codes.view(torch.uint8))


def test_quantize_refuses_what_the_spec_refuses():
    for fmt in ("nuq3", "fp8_e5m2", "int4"):
        spec = format_spec(fmt)
        codes = torch.zeros(1, 1, 4, spec.code_width(16), dtype=torch.uint8).view(spec.code_dtype)
        scale = torch.ones(1, 1, 4, 1, dtype=torch.float8_e4m3fn)
        zero = torch.zeros_like(scale) if spec.has_zero else None
        bad = torch.randn(1, 1, 2, 16)
        bad[0, 0, 1, 3] = float("inf")
        assert not native.quantize_into(bad, codes, scale, zero, 0, fmt)
        huge = torch.randn(1, 1, 1, 16) * 1e9  # a scale beyond e4m3's 448
        assert not native.quantize_into(huge, codes, scale, zero, 0, fmt)
        with pytest.raises(ValueError, match="scale_dtype"):
            quantize(huge, fmt, scale_dtype=torch.float8_e4m3fn)


def test_ops_dispatch_names_cpu_for_codebook_and_fp8_quantize():
    for fmt in ("nuq4", "nuq3", "nuq2", "fp8_e4m3", "fp8_e5m2"):
        for sd in SCALE_DTYPES:
            assert ops.backend_for("quantize_append", fmt=fmt, head_dim=64, scale_dtype=sd) == "cpu"
    assert (
        ops.backend_for("quantize_append", fmt="int8", head_dim=64, scale_dtype=torch.float8_e4m3fn) == "cpu"
    )
    assert (
        ops.backend_for("quantize_append", fmt="fp8_e4m3", head_dim=64, axis="channel", group_size=16)
        != "cpu"
    )
    x = _x(1, 3, 21, 64, 30, torch.float16)
    codes = torch.full((1, 3, 32, 32), 0xA5, dtype=torch.uint8)
    scale = torch.full((1, 3, 32, 2), float("nan"), dtype=torch.float16)
    ops.quantize_append(x, codes, scale, None, 4, fmt="nuq4", group_size=32)
    ref = quantize(x, "nuq4", group_size=32)
    assert torch.equal(codes[:, :, 4:25], ref.codes) and torch.equal(scale[:, :, 4:25], ref.scale)
    x[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ops.quantize_append(x, codes, scale, None, 4, fmt="nuq4", group_size=32)


def _threads_agree_then_refuse(fmt: str, seed: int, bad: float) -> None:
    """Rows split among threads give the spec's codes and scales; ``bad`` in the last row any thread
    quantizes refuses the whole call."""
    x = _x(2, 3, 300, 64, seed, torch.float16)  # enough rows for torch's thread count
    (codes, scale, _), ref = _rows(x, fmt, 32, torch.float16, cap=320)
    assert torch.equal(codes, ref.codes) and torch.equal(scale, ref.scale)
    x[1, 2, 299, 63] = bad
    codes = torch.zeros(2, 3, 300, 24, dtype=torch.uint8)
    assert not native.quantize_into(x, codes, torch.ones(2, 3, 300, 2, dtype=torch.float16), None, 0, fmt)


def test_codebook_quantize_split_among_threads_agrees():
    _threads_agree_then_refuse("nuq3", 40, float("nan"))


# ------------------------------------------------------------------------------------ trellis quantize


def _trellis_sq_err(fmt, codes, scale, x, g):
    """Squared error of each group ``[..., D/G]`` of ``x`` dequantized from packed codes and scales."""
    spec = format_spec(fmt)
    levels = trellis_decode(spec.unpack(codes), spec.bits)  # [..., D]
    v = levels.unflatten(-1, (-1, g)) * scale.float()[..., None]
    return (v - x.unflatten(-1, (-1, g))).square().sum(-1)


@pytest.mark.parametrize("fmt", ["tcq2", "tcq3"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize(("d", "group"), [(64, None), (64, 32), (64, 16), (128, 32), (96, 32), (32, 8)])
def test_trellis_quantize_matches_the_spec(fmt, scale_dtype, d, group):
    """Codes and scales of kvq_quantize_trellis equal the spec's (odd token count, batch 2, buffer
    index 5, strided inputs alike), except where torch's vectorized sqrt lands an ulp off
    (quantize_cpu.c): with fp32 scales a scale then differs by an ulp or two, its codes are those its
    own search scale gives and its squared error equals the spec's to fp32 rounding. The narrower
    scale dtypes absorb that ulp (on this data: every scale equal)."""
    spec = format_spec(fmt)
    g = group or d
    x = _x(2, 3, 13, d, d + 7 * spec.bits + g, scale_dtype)
    x[1, 0, 3, :g] = 0.0  # an all-zero group: scale 0
    (codes, scale, _), ref = _rows(x, fmt, group, scale_dtype)
    assert (scale[1, 0, 3, 0].float() == 0).item() and (ref.scale[1, 0, 3, 0].float() == 0).item()
    equal = _bytes(scale) == _bytes(ref.scale)  # [B, H, n, D/G]
    if scale_dtype != torch.float32:
        assert equal.all()
    else:
        assert equal.float().mean() >= 0.5  # (about a quarter of fp32 groups land an ulp away)
        s, want = scale.float(), ref.scale.float()
        assert ((s - want).abs() <= want * 2**-21).all()  # an ulp or two at most
    same = equal.all(-1)  # rows with every scale equal: every code equal
    assert torch.equal(codes[same], ref.codes[same])
    got_err = _trellis_sq_err(fmt, codes, scale, x, g)
    want_err = _trellis_sq_err(fmt, ref.codes, ref.scale, x, g)
    assert torch.allclose(got_err, want_err, rtol=1e-5, atol=0)
    # strided inputs: heads and tokens swapped in memory, and every other element of a wider row
    wide = torch.zeros(2, 3, 13, 2 * d)
    wide[..., ::2] = x
    for strided in (x.transpose(1, 2).contiguous().transpose(1, 2), wide[..., ::2]):
        (codes_s, scale_s, _), _ = _rows(strided, fmt, group, scale_dtype)
        assert torch.equal(codes_s, codes) and torch.equal(_bytes(scale_s), _bytes(scale))


def test_trellis_quantize_refuses_what_the_spec_refuses():
    """NaN / Inf input, a search or stored scale beyond fp8 e4m3 (448) or fp16 (65504): False from
    the kernel, the spec's ValueError through ops; a stored fp16 scale just above the top saturates
    as the spec's nearest-value rounding does."""
    for fmt in ("tcq2", "tcq3"):
        spec = format_spec(fmt)
        codes = torch.zeros(1, 1, 4, spec.code_width(32), dtype=torch.uint8)
        for scale_dtype, huge in ((torch.float8_e4m3fn, 1e3), (torch.float16, 1e5)):
            scale = torch.ones(1, 1, 4, 2, dtype=scale_dtype)
            torch.manual_seed(1)
            for value, match in (
                (float("nan"), "NaN or Inf"),
                (float("inf"), "NaN or Inf"),
                (None, "scale_dtype"),
            ):
                x = torch.randn(1, 1, 3, 32)
                if value is None:
                    x[0, 0, 2, 16:] *= huge  # the second group's scale beyond the dtype
                else:
                    x[0, 0, 2, 20] = value
                assert not native.quantize_into(x, codes, scale, None, 0, fmt)
                with pytest.raises(ValueError, match=match):
                    ops.quantize_append(x, codes, scale, None, 0, fmt=fmt, group_size=16)
        # fp16: search scales within the range, stretched scales above it: the spec keeps 65504
        x = torch.randn(1, 1, 3, 2, 16)
        x = (x * 6.4e4 / x.square().mean(-1, keepdim=True).sqrt()).flatten(-2)  # every group's RMS 64000
        (got_c, got_s, _), ref = _rows(x, fmt, 16, torch.float16, index=0, cap=3)
        assert (ref.scale == 65504).any() and torch.equal(got_s, ref.scale) and torch.equal(got_c, ref.codes)


def test_trellis_quantize_dispatch_and_threads():
    """ops names ``cpu`` for tcq2 / tcq3 at every written scale dtype and a head the kernel takes
    (at least one state, whole bytes of codes), and writes the spec's codes; rows split among
    threads agree, a bad value in the last row refuses the call."""
    for fmt in ("tcq2", "tcq3"):
        for sd in SCALE_DTYPES:
            assert ops.backend_for("quantize_append", fmt=fmt, head_dim=64, scale_dtype=sd) == "cpu"
    assert ops.backend_for("quantize_append", fmt="tcq2", head_dim=2) != "cpu"  # < one state
    assert ops.backend_for("quantize_append", fmt="tcq3", head_dim=12) != "cpu"  # 4.5 bytes of codes
    assert ops.backend_for("quantize_append", fmt="tcq3", head_dim=16) == "cpu"
    x = _x(1, 3, 21, 64, 50, torch.float8_e4m3fn)
    codes = torch.full((1, 3, 32, 16), 0xA5, dtype=torch.uint8)
    scale = torch.full((1, 3, 32, 2), float("nan")).to(torch.float8_e4m3fn)
    ops.quantize_append(x, codes, scale, None, 4, fmt="tcq2", group_size=32)
    ref = quantize(x, "tcq2", group_size=32, scale_dtype=torch.float8_e4m3fn)
    assert torch.equal(codes[:, :, 4:25], ref.codes) and torch.equal(
        _bytes(scale[:, :, 4:25]), _bytes(ref.scale)
    )
    _threads_agree_then_refuse("tcq3", 51, float("inf"))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_byte_decodes_to_its_value(fmt):
    """Each of the 256 bytes (subnormals, the largest values, signed zeros; NaN / Inf bytes apart)
    as keys and values: the C decode (AVX2: widened through fp16 bits, no table) equals the reference."""
    dtype = format_spec(fmt).code_dtype
    raw = torch.arange(256, dtype=torch.uint8)
    value = raw.view(dtype).float()
    finite = raw[value.isfinite()]  # [n] bytes whose value is finite
    g = torch.Generator().manual_seed(1)
    rows = finite[torch.randint(0, finite.numel(), (2, 2, 40, 64), generator=g)]
    rows.view(-1)[: finite.numel()] = finite  # every finite byte at least once
    codes = rows.view(dtype)
    scale = torch.full((2, 2, 40, 1), 2.0**-6, dtype=torch.float16)  # keeps scores finite
    q = torch.randn(2, 6, 64, generator=g)
    args = dict(k_fmt=fmt, v_fmt=fmt, k_group=64, v_group=64, k_axis="token", scaling=0.125)
    args.update(start=torch.tensor([0, 7]), end=40)
    got = ops.decode_attention(q, codes, scale, None, codes, scale, None, **args, backend="cpu")
    want = ops.decode_attention(q, codes, scale, None, codes, scale, None, **args, backend="reference")
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    nan = codes.clone()
    nan.view(torch.uint8)[0, 1, 5, 3] = 0x7F  # NaN in both fp8 formats: that row's output is NaN
    got = ops.decode_attention(q, nan, scale, None, codes, scale, None, **args, backend="cpu")
    assert got[0][0, 3:6].isnan().all() and not got[0][0, :3].isnan().any() and not got[0][1].isnan().any()
