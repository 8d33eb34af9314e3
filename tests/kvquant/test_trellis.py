"""Trellis codes (tcq1 / tcq2 / tcq3): the Viterbi search is exact, the codes decode as the spec says, the
error is what vector quantization promises on Gaussian heads, and bad input gets one clear message."""

import itertools

import pytest
import torch

from kvquant import KVQuantConfig
from kvquant.formats import dequantize, error_bound, format_spec, lloyd_max_levels, quantize, unpack_codes
from kvquant.formats.trellis import (
    TRELLIS_STATE_BITS,
    _viterbi,
    trellis_decode,
    trellis_encode,
    trellis_encode_torch,
    trellis_states,
    trellis_table,
)
from kvquant.formats.trellis_tables import TABLES

# mean squared error per channel of the Lloyd-Max scalar codebook on a standard normal
LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454}


def _all_codes(bits: int, d: int) -> torch.Tensor:
    """Every code sequence of ``d`` channels, ``[2**(bits*d), d]``."""
    return torch.tensor(list(itertools.product(range(1 << bits), repeat=d)))


def test_tables_have_a_state_per_word_and_qmax_is_their_largest_entry():
    for bits, state_bits in TRELLIS_STATE_BITS.items():
        assert len(TABLES[bits]) == 2**state_bits and state_bits % bits == 0
        assert format_spec(f"tcq{bits}").qmax == max(abs(v) for v in TABLES[bits])
        assert format_spec(f"tcq{bits}").bits == bits


def test_states_are_the_circular_words_of_the_codes():
    codes = torch.tensor([[1, 2, 3, 0, 1, 2]])
    states = trellis_states(codes, 2)  # m = 4 codes per state, newest in the low bits
    assert states[0, 0].item() == 1 | 2 << 2 | 1 << 4 | 0 << 6  # b0, then b5, b4, b3 (wrapped)
    assert states[0, 5].item() == 2 | 1 << 2 | 0 << 4 | 3 << 6
    assert torch.equal(trellis_decode(codes, 2), trellis_table(2)[states])


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_viterbi_with_history_is_the_exact_optimum(bits):
    """Against brute force over every code sequence whose wrapped-around codes equal the history."""
    d = {1: 9, 2: 5, 3: 4}[bits]  # (2**(bits * d) sequences)
    m = TRELLIS_STATE_BITS[bits] // bits
    every = _all_codes(bits, d)  # [C, d]
    history = torch.zeros(every.shape[0], dtype=torch.long)  # the last m-1 codes, newest lowest
    for j in range(m - 1):
        history |= every[:, d - 1 - j] << (bits * j)
    decoded = trellis_decode(every, bits)  # [C, d]
    gen = torch.Generator().manual_seed(bits)
    y = torch.randn(6, d, generator=gen) * 1.3
    h = torch.randint(0, 1 << (bits * (m - 1)), (6,), generator=gen)
    states, least = _viterbi(y, trellis_table(bits), bits, h)
    got = (trellis_table(bits)[states] - y).pow(2).sum(1)
    assert torch.allclose(least, got, rtol=1e-5, atol=1e-6)  # the error it reports is the path's
    for i in range(6):
        allowed = history == h[i]
        best = (decoded[allowed] - y[i]).pow(2).sum(1).min()
        assert got[i].item() == pytest.approx(best.item(), rel=1e-5, abs=1e-6)
        codes = states[i] & ((1 << bits) - 1)
        assert torch.equal(trellis_states(codes, bits), states[i])  # a closed circle of states


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_encoder_finds_the_best_circle_on_short_heads(bits):
    """Below 64 channels every history is tried: the best of all circular code sequences."""
    d = {1: 10, 2: 6, 3: 4}[bits]
    decoded = trellis_decode(_all_codes(bits, d), bits)
    y = torch.randn(20, d, generator=torch.Generator().manual_seed(7))
    best = torch.stack([(decoded - row).pow(2).sum(1).min() for row in y])
    got = (trellis_decode(trellis_encode(y, bits), bits) - y).pow(2).sum(1)
    assert torch.allclose(got, best, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_two_pass_encoder_is_near_the_best_circle(bits):
    """From 64 channels on, two passes stand in for the 2**(L - k) constrained ones of the exact
    search. The second pass is closed on the m - 1 codes the first fixed at the seam: the more codes
    a state spans (tcq1: 7), the more that can cost (total error within 2% for tcq1, 1% otherwise)."""
    table = trellis_table(bits)
    y = torch.randn(100, 64, generator=torch.Generator().manual_seed(8))
    n_hist = table.numel() >> bits
    exact = (
        torch.stack(
            [
                (table[_viterbi(y, table, bits, torch.full((100,), h))[0]] - y).pow(2).sum(1)
                for h in range(n_hist)
            ]
        )
        .min(0)
        .values
    )
    got = (trellis_decode(trellis_encode(y, bits), bits) - y).pow(2).sum(1)
    assert bool((got >= exact - 1e-4).all())
    assert got.sum() <= (1.02 if bits == 1 else 1.01) * exact.sum()


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize(("n", "d"), [(1, 64), (37, 64), (5, 128), (9, 16), (3, 4), (300, 64)])
def test_c_encoder_gives_the_codes_of_its_torch_twin(bits, n, d):
    """The C encoder (CPU) against the torch twin, with the shipped table and with another one
    (training passes its own): the same codes, including where errors tie."""
    from kvquant.kernels.cpu import native_available, trellis_encode_native

    if not native_available():
        pytest.skip("no C compiler: the torch twin is the only encoder")
    gen = torch.Generator().manual_seed(n * d + bits)
    y = torch.randn(n, d, generator=gen)
    if d < TRELLIS_STATE_BITS[bits] // bits:  # shorter than one state: refused before any search
        with pytest.raises(ValueError, match="head_dim: trellis codes"):
            trellis_encode(y, bits)
        return
    y[0, : d // 2] = y[0, d // 2 :]  # a vector that repeats: equal costs along the circle
    other = torch.randn(2 ** TRELLIS_STATE_BITS[bits], generator=gen)
    for table in (trellis_table(bits), other):
        state_bits = TRELLIS_STATE_BITS[bits]
        native = trellis_encode_native(y, bits, state_bits, table, 64)
        assert torch.equal(native, trellis_encode_torch(y, bits, table))
    assert torch.equal(trellis_encode(y, bits), trellis_encode_torch(y, bits, trellis_table(bits)))


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_distortion_on_gaussian_heads_beats_the_best_scalar_codebook(bits):
    """Rotated head vectors are near Gaussian; there the trellis must come within 30% of the
    rate-distortion bound of a standard normal source (2**(-2 bits) per channel), scales included,
    and so beat the Lloyd-Max levels (the best a scalar codebook can do at these bits) by >= 10%."""
    x = torch.randn(1, 4, 512, 64, generator=torch.Generator().manual_seed(0))
    fmt = f"tcq{bits}"
    q = quantize(x, fmt)
    mse = (dequantize(q, fmt, head_dim=64) - x).pow(2).mean().item()
    assert mse < 1.3 * 2.0 ** (-2 * bits)
    assert mse < 0.9 * LLOYD_MAX_MSE[bits]
    if bits > 1:  # (no 1-bit codebook format)
        nuq = f"nuq{bits}"
        assert mse < 0.8 * (dequantize(quantize(x, nuq), nuq, head_dim=64) - x).pow(2).mean().item()
    assert lloyd_max_levels(bits).numel() == 2**bits


@pytest.mark.parametrize("fmt", ["tcq1", "tcq2", "tcq3"])
@pytest.mark.parametrize("group", [None, 16, 32])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float8_e4m3fn, torch.float32])
def test_codes_and_scales_decode_as_specified_and_keep_group_norms(fmt, group, scale_dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, 64, generator=gen) * torch.linspace(0.2, 3, 64)
    q = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    g = group or 64
    bits = format_spec(fmt).bits
    assert q.codes.shape == (2, 3, 7, 64 * bits // 8) and q.scale.shape == (2, 3, 7, 64 // g)
    assert q.scale.dtype == scale_dtype and q.zero is None
    levels = trellis_decode(unpack_codes(q.codes, bits), bits)  # the circle runs over the whole head
    expected = (levels.view(2, 3, 7, 64 // g, g) * q.scale.float()[..., None]).view(2, 3, 7, 64)
    y = dequantize(q, fmt, head_dim=64, group_size=g)
    assert torch.equal(y, expected)
    ratio = y.view(2, 3, 7, -1, g).norm(dim=-1) / x.view(2, 3, 7, -1, g).norm(dim=-1)
    step = {torch.float16: 2.0**-10, torch.float8_e4m3fn: 2.0**-3, torch.float32: 1e-6}[scale_dtype]
    assert bool(((ratio - 1).abs() <= step / 2 + 1e-5).all())  # scale rounded to nearest


@pytest.mark.parametrize("fmt", ["tcq1", "tcq2", "tcq3"])
def test_zeros_roundtrip_and_bad_input_raise_one_clear_message(fmt):
    zeros = torch.zeros(1, 2, 3, 16)
    q = quantize(zeros, fmt)
    assert torch.equal(dequantize(q, fmt, head_dim=16), zeros) and bool((q.scale.float() == 0).all())
    x = torch.randn(1, 1, 3, 16)
    x[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, fmt)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(torch.full((1, 1, 1, 16), 1e6), fmt, scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="axis: trellis format"):
        quantize(torch.randn(1, 1, 4, 16), fmt, axis="channel", group_size=4)
    with pytest.raises(ValueError, match="static_scale: only int8 and fp8"):
        quantize(torch.randn(1, 1, 4, 16), fmt, static_scale=torch.ones(1))
    with pytest.raises(ValueError, match="head_dim: trellis codes"):
        trellis_encode(torch.randn(2, 2), format_spec(fmt).bits)
    with pytest.raises(ValueError, match="no per-element error bound"):
        error_bound(q, fmt, zeros)


def test_config_takes_trellis_formats_on_the_token_axis_only():
    cfg = KVQuantConfig(key_format="tcq3", value_format="tcq2", recent_length=8, recent_value_format="tcq3")
    assert (cfg.key_format, cfg.value_format, cfg.recent_value_format) == ("tcq3", "tcq2", "tcq3")
    with pytest.raises(ValueError, match="key_axis: invalid value 'channel'; allowed: 'token'"):
        KVQuantConfig(key_format="tcq2", value_format="tcq2", key_axis="channel", key_group_size=8)
    with pytest.raises(ValueError, match="key_format: invalid value 'tcq2'"):
        KVQuantConfig(key_format="tcq2", value_format="int8", static_scales="x.pt")


def test_trellis_codes_lower_the_error_of_a_tiny_model_at_equal_bits():
    """The same recipe with trellis codes instead of Lloyd-Max levels (same bits per element, same
    scales): the decode-time KL against a full-precision cache drops."""
    from transformers import DynamicCache

    from kvquant import KVQuantCache
    from kvquant.eval.decode import teacher_forced_logprobs
    from kvquant.eval.quality import compare
    from kvquant.models import tiny_model

    model = tiny_model("llama", head_dim=64)  # heads as wide as real ones (the circle is the head)
    ids = torch.randint(0, 100, (2, 56), generator=torch.Generator().manual_seed(5))
    base = teacher_forced_logprobs(model, ids, 40, DynamicCache(config=model.config))

    def kl(fmt: str) -> float:
        cfg = KVQuantConfig(key_format=fmt, value_format=fmt, rotation="hadamard", smoothing="mean")
        test = teacher_forced_logprobs(model, ids, 40, KVQuantCache(model.config, cfg))
        return compare(base, test, ids[:, 40:])["kl_mean"]

    kls = {f: kl(f) for f in ("nuq2", "tcq2", "nuq3", "tcq3")}
    assert kls["tcq2"] < 0.85 * kls["nuq2"] and kls["tcq3"] < 0.85 * kls["nuq3"], kls
