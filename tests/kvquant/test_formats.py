"""The numeric spec: packing is exact, every element stays within the format's error bound."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant.formats import (
    FORMAT_NAMES,
    dequantize,
    error_bound,
    format_spec,
    lloyd_max_levels,
    pack_codes,
    quantize,
    round_to_dtype,
    unpack_codes,
)

QUANT_FORMATS = [f for f in FORMAT_NAMES if f != "none"]
# formats with a per-element bound (trellis codes trade errors between channels: tests/test_trellis.py)
BOUNDED_FORMATS = [f for f in QUANT_FORMATS if format_spec(f).kind != "trellis"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_is_exact_and_planar(bits):
    d = 64
    codes = torch.randint(0, 2**bits, (2, 3, 5, d), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, 3, 5, d * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # byte j: channel j low nibble, channel j + D/2 high nibble
        assert torch.equal(packed & 0xF, codes[..., : d // 2])
        assert torch.equal(packed >> 4, codes[..., d // 2 :])


def test_codes_match_the_formula():
    x = torch.tensor([[[[-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0, 3.0]]]])
    q = quantize(x, "int4", scale_dtype=torch.float32)
    assert q.zero.item() == -1.0 and q.scale.item() == pytest.approx(4 / 15)
    expected = torch.round((x - q.zero) / q.scale).to(torch.uint8)  # code = round((x - m) / s)
    assert torch.equal(unpack_codes(q.codes, 4), expected)
    q8 = quantize(x, "int8", scale_dtype=torch.float32)
    assert torch.equal(q8.codes, torch.round(x / (3 / 127)).to(torch.int8))


def _roundtrip(x, fmt, group_size, axis, scale_dtype):
    q = quantize(x, fmt, group_size=group_size, axis=axis, scale_dtype=scale_dtype)
    y = dequantize(q, fmt, head_dim=x.shape[-1], group_size=group_size, axis=axis)
    return q, y


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(BOUNDED_FORMATS),
    dtype=st.sampled_from(DTYPES),
    d=st.sampled_from([8, 16, 64]),
    t=st.integers(1, 9),
    g_div=st.sampled_from([1, 2, 4]),
    magnitude=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_within_half_step_token_axis(fmt, dtype, d, t, g_div, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, t, d, generator=gen) * magnitude).to(dtype)
    scale_dtype = torch.float32 if magnitude > 1e3 else torch.float16
    q, y = _roundtrip(x, fmt, d // g_div, "token", scale_dtype)
    bound = error_bound(q, fmt, x, group_size=d // g_div)
    err = (y - x.float()).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert torch.isfinite(q.scale.float()).all() and (q.scale.float() > 0).all()


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(["int4", "int2", "int8"]),
    dtype=st.sampled_from(DTYPES),
    blocks=st.integers(1, 3),
    g=st.sampled_from([2, 8, 32]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_within_half_step_channel_axis(fmt, dtype, blocks, g, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 2, blocks * g, 16, generator=gen) * 3).to(dtype)
    q, y = _roundtrip(x, fmt, g, "channel", torch.float16)
    assert q.scale.shape == (1, 2, blocks, 16)
    bound = error_bound(q, fmt, x, group_size=g, axis="channel")
    assert bool(((y - x.float()).abs() <= bound).all())


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_roundtrip_exactly(fmt, dtype):
    x = torch.zeros(1, 2, 3, 16, dtype=dtype)
    q, y = _roundtrip(x, fmt, None, "token", torch.float16)
    assert torch.equal(y, x.float())
    if format_spec(fmt).kind in ("codebook", "trellis"):  # no zero level: scale 0 marks the group
        assert (q.scale.float() == 0).all()
    else:
        assert (q.scale.float() == 1).all()  # never a zero scale


@pytest.mark.parametrize("fmt", BOUNDED_FORMATS)
@pytest.mark.parametrize("c", [0.3, -7.77, 1234.5, 1e-6])
def test_constant_vector_roundtrips_to_scale_dtype_rounding(fmt, c):
    """Integers: a constant vector comes back to fp16 rounding of the constant. fp8 codes round the
    constant divided by the stored scale, so it comes back to fp8 rounding (the format's bound)."""
    x = torch.full((1, 1, 2, 16), c)
    q, y = _roundtrip(x, fmt, None, "token", torch.float16)
    if fmt.startswith("fp8"):
        tol = error_bound(q, fmt, x)
    elif format_spec(fmt).kind == "codebook":  # max|x| lands on the top level: fp16 rounding of the scale
        tol = abs(c) * 2.0**-10 + 6e-8 * format_spec(fmt).qmax
    else:
        tol = abs(c) * 2.0**-10 + 6e-8  # fp16 rounding of c (plus its smallest subnormal)
    assert ((y - c).abs() <= tol).all(), (y - c).abs().max()


def test_huge_values_with_fp16_scales_raise_clear_error():
    x = torch.full((1, 1, 1, 8), 1e6)
    x[..., 0] = -1e6
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(x, "int4", scale_dtype=torch.float16)
    q, y = _roundtrip(x, "int4", None, "token", torch.float32)  # fp32 scales hold them
    assert (y - x).abs().max() <= q.scale.max() / 2 * (1 + 1e-6)


def test_tiny_values_underflow_to_smallest_subnormal_not_zero():
    x = torch.randn(1, 1, 4, 16) * 1e-9
    q, y = _roundtrip(x, "int8", None, "token", torch.float16)
    assert (q.scale.float() > 0).all()
    assert ((y - x).abs() <= error_bound(q, "int8", x)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_nan_inf_input_raises(fmt, bad):
    x = torch.randn(1, 1, 3, 16)
    x[0, 0, 1, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, fmt)


def test_round_to_dtype_directions():
    x = torch.tensor([0.1, -0.1, 1e-9, 70000.0])
    up = round_to_dtype(x, torch.float16, +1).float()
    down = round_to_dtype(x, torch.float16, -1).float()
    assert (up[:3] >= x[:3]).all() and (down[:3] <= x[:3]).all()
    assert up[2] > 0  # underflow rounds up to the smallest subnormal
    assert torch.isinf(up[3])  # overflow is reported as inf (and raised by quantize)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_static_scales_clip_and_dequantize(fmt):
    x = torch.randn(2, 3, 4, 16)
    static = x.abs().amax(dim=(0, 2, 3)) / format_spec(fmt).qmax  # [H]
    q = quantize(x, fmt, static_scale=static)
    assert q.scale.shape == (1, 3, 1, 1)
    y = dequantize(q, fmt, head_dim=16)
    assert ((y - x).abs() <= error_bound(q, fmt, x)).all()


def test_unknown_format_names_allowed_values():
    with pytest.raises(ValueError, match="format: unknown format 'int5'; allowed: none, int8"):
        quantize(torch.zeros(1, 1, 1, 8), "int5")


def _sqnr_db(x, y):
    return 10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()).item()


@pytest.mark.parametrize("amplitude", [10.0, 30.0, 100.0])
def test_wide_heads_with_outlier_channels_int8_preset_keeps_error_target(amplitude):
    """head_dim 256 with 4 large-magnitude channels. The error target: lose at most one bit
    (6 dB) of SQNR against the same data without outliers. One scale per head vector misses it;
    the int8 preset's default groups keep it."""
    from kvquant.config import KVQuantConfig

    torch.manual_seed(0)
    x = torch.randn(2, 4, 64, 256)
    x[..., torch.tensor([3, 77, 150, 201])] *= amplitude
    g, _ = KVQuantConfig.resolve("int8").group_sizes(256)
    _, y_preset = _roundtrip(x, "int8", g, "token", torch.float16)
    _, y_head = _roundtrip(x, "int8", None, "token", torch.float16)
    clean = torch.randn(2, 4, 64, 256)
    _, y_clean = _roundtrip(clean, "int8", None, "token", torch.float16)
    target = _sqnr_db(clean, y_clean) - 6.02
    assert _sqnr_db(x, y_preset) >= target
    assert _sqnr_db(x, y_head) < target


# ------------------------------------------------------------------------------------ formats as objects


def test_every_format_is_one_object_of_its_family():
    from kvquant.formats import FormatSpec

    for name in FORMAT_NAMES:
        spec = format_spec(name)
        assert isinstance(spec, FormatSpec) and spec.name == name and format_spec(name) is spec
        assert spec.kind in ("passthrough", "int_sym", "int_asym", "float", "codebook", "trellis")
        assert spec.has_scale == (name != "none")
        assert spec.elementwise == (spec.kind != "trellis")


def test_bytes_per_token_is_codes_plus_amortized_scales():
    int4, int2, nuq3 = format_spec("int4"), format_spec("int2"), format_spec("nuq3")
    assert format_spec("none").bytes_per_token(64, 64, "token", 2, fp_itemsize=4) == 64 * 4
    assert int4.bytes_per_token(64, 64, "token", 2) == 32 + 2 + 2  # codes + fp16 scale + zero point
    assert int4.bytes_per_token(64, 16, "token", 4) == 32 + 4 * 8
    assert int2.bytes_per_token(64, 32, "channel", 2) == 16 + 64 * 4 / 32  # KIVI keys: a row per block
    assert format_spec("int8").bytes_per_token(128, 128, "token", 2, static=True) == 128  # codes only
    assert nuq3.bytes_per_token(128, 32, "token", 1) == 48 + 4  # 8-bit scales, no zero point
    assert nuq3.bits_per_element(128, 32, "token", 1) == 3 + 8 / 32
    for name in FORMAT_NAMES[1:]:  # bits per element = bits + scale bits per group, on both axes
        spec = format_spec(name)
        per = 2 if spec.has_zero else 1
        for axis in ("token", "channel"):
            assert spec.bits_per_element(64, 16, axis, 2) == spec.bits + 16 * per / 16


def test_lookup_tables_where_a_kernel_needs_one():
    for name in ("fp8_e4m3", "fp8_e5m2"):
        spec = format_spec(name)
        lut = spec.lut()
        assert lut.shape == (256,) and lut.dtype == torch.float32
        codes = torch.arange(256, dtype=torch.uint8)
        assert torch.equal(lut.nan_to_num(7.0), codes.view(spec.code_dtype).float().nan_to_num(7.0))
    for name in ("nuq4", "nuq3", "nuq2"):
        spec = format_spec(name)
        lut = spec.lut()
        assert lut.shape == (16,) and torch.equal(lut[: 2**spec.bits], lloyd_max_levels(spec.bits))
        assert (lut[2**spec.bits :] == 0).all()
    for name in ("none", "int8", "int4", "int3", "int2", "tcq2", "tcq3"):
        assert format_spec(name).lut() is None


def test_triton_constants_and_fp8_layouts():
    assert format_spec("none").triton_constants() == (0, 16, 0.0, 0, 0)
    assert format_spec("int8").triton_constants() == (1, 8, 127.0, 0, 0)
    assert format_spec("int4").triton_constants() == (2, 4, 15.0, 0, 0)
    assert format_spec("fp8_e4m3").triton_constants() == (3, 8, 448.0, 3, 7)
    assert format_spec("fp8_e5m2").triton_constants() == (3, 8, 57344.0, 2, 15)
    for name in ("int3", "nuq4", "nuq2", "tcq2", "tcq3"):  # 3-bit planes, tables, states
        assert format_spec(name).triton_constants() is None


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp8_e4m3", "nuq3", "tcq2"])
def test_levels_of_codes_and_codes_of_levels_round_trip(fmt):
    """``encode_units`` / ``levels_of``: what quantize and dequantize do between scaling steps."""
    spec = format_spec(fmt)
    torch.manual_seed(0)
    y = torch.randn(6, 64) * (spec.qmax / 3 if spec.integer else 1.0)
    if spec.has_zero:
        y = y.abs()
    codes = spec.encode_units(y)
    assert codes.shape == y.shape
    again = spec.encode_units(spec.levels_of(codes))
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))  # levels are fixed points
    stored = pack_codes(codes, spec.bits) if spec.packed else codes
    assert torch.equal(spec.decode_codes(stored), spec.levels_of(codes))


def test_the_spec_imports_nothing_else_of_kvquant():
    """formats < kernels < cache ...: the spec never calls C, never reads the environment."""
    import ast
    from pathlib import Path

    import kvquant.formats

    folder = Path(kvquant.formats.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name == "kvquant" or name.startswith("kvquant."):
                    assert name.startswith("kvquant.formats"), f"{path.name} imports {name}"


def test_an_injected_encoder_searches_the_trellis_codes():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 5, 64)
    calls = []

    def encoder(y, bits):
        calls.append((tuple(y.shape), bits))
        from kvquant.formats.trellis import trellis_encode

        return trellis_encode(y, bits)

    got = quantize(x, "tcq3", encoder=encoder)
    want = quantize(x, "tcq3")
    assert calls == [((10, 64), 3)]
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("divisor", [7.0, 127.0, 448.0, 57344.0, 15.0, 1.510418])
def test_scale_division_is_correctly_rounded(divisor):
    """``div_rn``, the division behind every ``max / qmax`` scale: the fp32 nearest to the exact
    quotient on each device (CUDA divides by a Python scalar through its reciprocal, one ulp off for
    quotients such as 3 / 7; the GPU quantize kernels divide correctly rounded)."""
    from kvquant.formats.rounding import div_rn

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    x = torch.cat([torch.randn(4096) * 50, torch.arange(1, 4097, dtype=torch.float32) * divisor / 64])
    d32 = float(torch.tensor(divisor, dtype=torch.float32))  # the divisor as the fp32 tensors hold it
    want = (x.double() / d32).float()  # exact quotient, rounded once (fp64 holds it to > 2 * 24 + 2 bits)
    for dev in devices:
        assert torch.equal(div_rn(x.to(dev), divisor).cpu(), want)
