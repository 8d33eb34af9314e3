"""Methods below 4 bits: int3 and Lloyd-Max codebooks, channel smoothing, and that each method moves
the error the way it should (on synthetic head vectors with the structure it targets, and on a tiny
model whose keys are given that structure)."""

import math

import pytest
import torch

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.eval.quality import compare
from kvquant.formats import (
    CODEBOOK_SCALE_GRID,
    dequantize,
    error_bound,
    format_spec,
    lloyd_max_levels,
    pack_codes,
    quantize,
    round_to_dtype,
    unpack_codes,
)
from kvquant.memory import model_cache_bytes
from kvquant.models import tiny_model


def _mse(x, fmt, **kw):
    q = quantize(x, fmt, **kw)
    y = dequantize(
        q, fmt, head_dim=x.shape[-1], group_size=kw.get("group_size"), axis=kw.get("axis", "token")
    )
    return (y - x).pow(2).mean().item()


# --------------------------------------------------------------------------------------------- formats


def test_int3_packs_as_two_bit_planes():
    codes = torch.randint(0, 8, (2, 3, 5, 64), dtype=torch.uint8)
    packed = pack_codes(codes, 3)
    assert packed.shape == (2, 3, 5, 24)  # 3 bits per code
    assert torch.equal(packed[..., :16], pack_codes(codes & 3, 2))  # low bit pairs, int2 layout
    assert torch.equal(packed[..., 16:], pack_codes(codes >> 2, 1))  # high bits, eight per byte
    assert torch.equal(unpack_codes(packed, 3), codes)


def test_lloyd_max_levels_are_the_normal_optimum():
    assert torch.allclose(lloyd_max_levels(2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-4)
    for bits in (2, 3, 4):
        lv = lloyd_max_levels(bits).double()
        assert torch.equal(lv, -lv.flip(0)) and bool((lv[1:] > lv[:-1]).all())
        assert format_spec(f"nuq{bits}").qmax == pytest.approx(lv[-1].item(), abs=1e-5)
        # centroid condition: each level is the mean of a standard normal over its cell
        edges = [-math.inf, *((lv[1:] + lv[:-1]) / 2).tolist(), math.inf]
        for level, a, b in zip(lv.tolist(), edges[:-1], edges[1:], strict=True):
            pdf = lambda t: 0.0 if math.isinf(t) else math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
            mass = 0.5 * (math.erf(b / math.sqrt(2)) - math.erf(a / math.sqrt(2)))
            assert level == pytest.approx((pdf(a) - pdf(b)) / mass, abs=1e-6)


@pytest.mark.parametrize("fmt", ["int3", "nuq4", "nuq3", "nuq2"])
@pytest.mark.parametrize("group", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_formats_stay_within_their_bound(fmt, group, dtype):
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 37, 64) * torch.linspace(0.1, 8, 64)).to(dtype)  # uneven channels
    q = quantize(x, fmt, group_size=group)
    y = dequantize(q, fmt, head_dim=64, group_size=group)
    assert q.codes.shape[-1] == 64 * format_spec(fmt).bits // 8
    assert bool(((y - x.float()).abs() <= error_bound(q, fmt, x, group_size=group)).all())


def test_codebook_scale_search_and_norm_stretch():
    """Against the plain RMS scale: the searched scale has less error (3 and 4 bits), and the
    stretch keeps each group's norm, where nearest levels alone shrink it (and attention scores)."""
    torch.manual_seed(1)
    x = torch.randn(1, 4, 200, 64)
    x[..., 3] *= 6  # heavy tails make the RMS scale a poor choice
    for bits in (2, 3, 4):
        lv = lloyd_max_levels(bits)
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        plain = lv[torch.bucketize(x / rms, (lv[1:] + lv[:-1]) / 2)] * rms
        q = quantize(x, f"nuq{bits}", scale_dtype=torch.float32)
        y = dequantize(q, f"nuq{bits}", head_dim=64)
        if bits > 2:
            assert (y - x).pow(2).mean() < 0.97 * (plain - x).pow(2).mean()
        shrink_plain = (plain.norm(dim=-1) / x.norm(dim=-1)).mean().item() - 1
        shrink = (y.norm(dim=-1) / x.norm(dim=-1)).mean().item() - 1
        assert shrink_plain < -0.05 and abs(shrink) < abs(shrink_plain) / 2
    assert 1.0 in CODEBOOK_SCALE_GRID


def test_codebooks_beat_uniform_integers_on_gaussian_heads():
    """What the codebooks are for: rotated head vectors are close to Gaussian, where the Lloyd-Max
    levels beat uniform steps, with one scale instead of a scale and a zero point."""
    torch.manual_seed(2)
    x = torch.randn(1, 8, 256, 64)
    assert _mse(x, "nuq2") < 0.7 * _mse(x, "int2")  # 2.25 vs 2.5 bits
    assert _mse(x, "nuq3") < _mse(x, "int3")  # 3.25 vs 3.5 bits
    assert _mse(x, "int4") < _mse(x, "int3") < _mse(x, "int2")


def test_codebooks_refuse_channel_axis_and_static_scales():
    x = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="axis: codebook format nuq4"):
        quantize(x, "nuq4", group_size=16, axis="channel")
    with pytest.raises(ValueError, match="static_scale"):
        quantize(x, "nuq3", static_scale=torch.ones(2))
    with pytest.raises(ValueError, match="key_axis: invalid value 'channel'"):
        KVQuantConfig(key_format="nuq2", key_axis="channel", key_group_size=32)
    with pytest.raises(ValueError, match="smoothing: invalid value 'median'; allowed: none, mean, channel"):
        KVQuantConfig(smoothing="median")


# --------------------------------------------------------------------------------------------- smoothing


def _layer_roundtrip(cfg: KVQuantConfig, k: torch.Tensor, v: torch.Tensor):
    cache = KVQuantCache(tiny_model("llama").config, cfg)
    layer = cache.layers[0]
    layer.lazy_initialization(k, v)
    layer.append(k, v)
    return layer, *layer.read(0, k.shape[2])


def test_mean_smoothing_removes_a_channel_offset_from_the_error():
    torch.manual_seed(3)
    k = torch.randn(1, 2, 64, 16) + torch.linspace(-20, 20, 16)  # keys with big per-channel offsets
    v = torch.randn(1, 2, 64, 16)
    errs = {}
    values = {}
    for smoothing in ("none", "mean"):
        cfg = KVQuantConfig(key_format="int4", value_format="int4", smoothing=smoothing)
        _, kq, vq = _layer_roundtrip(cfg, k, v)
        errs[smoothing] = (kq - k).pow(2).mean().item()
        values[smoothing] = vq
    assert errs["mean"] < 0.1 * errs["none"]
    assert torch.equal(values["mean"], values["none"])  # values are not smoothed


def test_smoothing_statistics_skip_padding_and_sinks():
    torch.manual_seed(4)
    k = torch.randn(2, 2, 12, 16)
    v = torch.randn(2, 2, 12, 16)
    k[1, :, :3] = 1e3  # row 1: three pad positions of garbage
    k[:, :, 0:1] += 50  # an attention-sink-like first token in row 0 (row 1's first real one is 3)
    k[1, :, 3] += 50
    cfg = KVQuantConfig(key_format="int8", value_format="int8", smoothing="channel", sink_tokens=1)
    layer = KVQuantCache(tiny_model("llama").config, cfg).layers[0]
    layer.lazy_initialization(k, v)
    pos = torch.arange(12)[None].expand(2, -1) - torch.tensor([[0], [3]])
    layer.append(k, v, pos.clamp_min(0))
    k_mean, k_std = layer.transform.stats[0].float(), layer.transform.stats[1].float()
    assert torch.allclose(k_mean[0, :, 0], k[0, :, 1:].mean(1), atol=2e-3)
    assert torch.allclose(k_mean[1, :, 0], k[1, :, 4:].mean(1), atol=2e-3)
    assert torch.allclose(k_std[1, :, 0], k[1, :, 4:].std(1, unbiased=False), rtol=2e-3)


def test_auto_smoothing_divides_only_the_heads_with_outlier_channels():
    # head 0: a few channels 20x the others' spread (QK-norm gains, as in Gemma 3); head 1: even spreads
    # (SmolLM2's largest / median is <= 4.9). "auto" divides head 0 by its spreads and leaves head 1 as
    # "mean" does (divisor 1); fitted on too few tokens to tell, it divides none
    gen = torch.Generator().manual_seed(5)
    spread = torch.ones(16)
    spread[:2] = 20.0
    k = torch.randn(1, 2, 64, 16, generator=gen) * torch.stack([spread, torch.ones(16)])[None, :, None, :]
    v = torch.randn(1, 2, 64, 16, generator=gen)
    cfg = KVQuantConfig(key_format="int4", value_format="int4", smoothing="auto")
    layer, kq, _ = _layer_roundtrip(cfg, k, v)
    std = layer.transform.stats[1].float()[0, :, 0]  # [H, D]
    assert torch.allclose(std[0], k[0, 0].std(0, unbiased=False), rtol=1e-2)
    assert torch.equal(std[1], torch.ones(16))
    mean_cfg = KVQuantConfig(key_format="int4", value_format="int4", smoothing="mean")
    _, kq_mean, _ = _layer_roundtrip(mean_cfg, k, v)
    assert torch.equal(kq[0, 1], kq_mean[0, 1])  # head 1 stored exactly as with "mean"
    err = {n: (x[0, 0] - k[0, 0]).pow(2).mean().item() for n, x in (("auto", kq), ("mean", kq_mean))}
    assert err["auto"] < err["mean"]  # head 0: the small channels keep their resolution
    few, _, _ = _layer_roundtrip(cfg, k[:, :, :20], v[:, :, :20])
    assert torch.equal(few.transform.stats[1].float(), torch.ones(1, 2, 1, 16))


@pytest.mark.parametrize("smoothing", ["mean", "channel", "auto"])
def test_smoothing_costs_and_planner_agree(smoothing):
    model = tiny_model("llama")
    c = model.config
    cfg = KVQuantConfig(key_format="nuq3", value_format="int3", smoothing=smoothing, residual_length=3)
    cache = KVQuantCache(c, cfg)
    with torch.no_grad():
        model(torch.randint(0, 100, (2, 21)), cache=cache)
    kv_heads, head_dim = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    layer_types = ["full_attention"] * c.num_hidden_layers
    expected = model_cache_bytes(cfg, layer_types, [None] * len(layer_types), 21, 2, kv_heads, head_dim, 4)
    assert cache.nbytes() == expected
    per_head = head_dim * 2 * (1 if smoothing == "mean" else 2)  # fp16 mean (+ std) of the keys
    plain = KVQuantCache(c, KVQuantConfig(key_format="nuq3", value_format="int3", residual_length=3))
    with torch.no_grad():
        model(torch.randint(0, 100, (2, 21)), cache=plain)
    assert cache.nbytes() - plain.nbytes() == c.num_hidden_layers * 2 * kv_heads * per_head  # batch 2


@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("gemma2", "eager")])
@pytest.mark.parametrize("fmt", ["nuq3", "int3"])
def test_fused_attention_matches_the_dequantizing_path(family, impl, fmt):
    """The `kvquant` attention folds smoothing into the query / output / LSE (and, under softcap,
    dequantizes): it must give the logits of the plain path."""
    model = tiny_model(family)
    ids = torch.randint(0, 100, (2, 30))
    cfg = KVQuantConfig(
        key_format=fmt,
        value_format=fmt,
        rotation="hadamard",
        smoothing="channel",
        sink_tokens=1,
        residual_length=4,
    )
    logits = []
    for attn in (impl, "kvquant"):
        model.set_attn_implementation(attn)
        cache = KVQuantCache(model.config, cfg)
        with torch.no_grad():
            model(ids[:, :22], cache=cache)
            logits.append(torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(22, 30)], 1))
    model.set_attn_implementation(impl)
    assert torch.allclose(logits[0], logits[1], atol=2e-4), (logits[0] - logits[1]).abs().max()


# --------------------------------------------------------------------------------------------- direction


def _structured_tiny(offset: float = 0.0, outlier: float = 1.0):
    """A tiny llama whose keys carry the structure real models show: a per-channel offset (k_proj
    bias) and a few outlier channels (k_proj rows scaled up)."""
    model = tiny_model("llama", attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            proj = layer.self_attn.k_proj
            proj.bias.copy_(offset * torch.linspace(-1, 1, proj.bias.numel()))
            proj.weight[::16] *= outlier  # channel 0 of every head
    return model


def _kl(model, cfg, ids, prefix=40) -> float:
    from transformers import DynamicCache

    base = teacher_forced_logprobs(model, ids, prefix, DynamicCache(config=model.config))
    test = teacher_forced_logprobs(model, ids, prefix, KVQuantCache(model.config, cfg))
    return compare(base, test, ids[:, prefix:])["kl_mean"]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 100, (2, 56), generator=torch.Generator().manual_seed(5))


def test_more_bits_less_error_and_keys_matter_more(tokens):
    model = _structured_tiny(outlier=4.0)
    kl = {
        f: _kl(model, KVQuantConfig(key_format=f, value_format=f), tokens) for f in ("int8", "int4", "int2")
    }
    assert kl["int8"] < kl["int4"] < kl["int2"]
    k8v4 = _kl(model, KVQuantConfig(key_format="int8", value_format="int4"), tokens)
    assert k8v4 < kl["int4"]


def test_rotation_helps_outlier_channels(tokens):
    model = _structured_tiny(outlier=8.0)
    plain = _kl(model, KVQuantConfig(key_format="int4", value_format="int4"), tokens)
    rotated = _kl(model, KVQuantConfig(key_format="int4", value_format="int4", rotation="hadamard"), tokens)
    assert rotated < 0.7 * plain


def test_mean_smoothing_helps_channel_offsets(tokens):
    model = _structured_tiny(offset=6.0)
    plain = _kl(model, KVQuantConfig(key_format="nuq3", value_format="nuq3"), tokens)
    smoothed = _kl(model, KVQuantConfig(key_format="nuq3", value_format="nuq3", smoothing="mean"), tokens)
    assert smoothed < 0.7 * plain


def test_groups_sinks_and_residual_reduce_error(tokens):
    model = _structured_tiny(outlier=4.0)
    base = KVQuantConfig(key_format="int2", value_format="int2")
    kl = _kl(model, base, tokens)
    assert _kl(model, KVQuantConfig(key_format="int2", value_format="int2", key_group_size=4), tokens) < kl
    assert _kl(model, KVQuantConfig(key_format="int2", value_format="int2", residual_length=16), tokens) < kl
    channel = KVQuantConfig(key_format="int2", value_format="int2", key_axis="channel", key_group_size=8)
    assert _kl(model, channel, tokens) < kl  # KIVI: per-channel key scales for outlier channels


# --------------------------------------------------------------------------------------------- 8-bit scales


def test_float8_scales_round_outward_on_their_grid():
    f8 = torch.float8_e4m3fn
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f8).float()
    grid = grid[torch.isfinite(grid)].unique()
    x = torch.cat([torch.randn(500) * 10, torch.tensor([0.0, 1e-9, -1e-9, 448.0, 0.3])])
    up, down = round_to_dtype(x, f8, +1).float(), round_to_dtype(x, f8, -1).float()
    assert bool((up >= x).all()) and bool((down <= x).all())
    assert bool(torch.isin(up, grid).all()) and bool(torch.isin(down, grid).all())
    between = (grid[None] > down[:, None]) & (grid[None] < up[:, None])
    assert not bool(between.any())  # the neighbouring grid values, nothing skipped
    assert (
        round_to_dtype(torch.tensor([1e-9]), f8, +1).float().item() == 2.0**-9
    )  # underflow: smallest subnormal
    assert torch.isnan(round_to_dtype(torch.tensor([449.0]), f8, +1).float()).all()  # no silent saturation
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(torch.full((1, 1, 2, 64), 2000.0), "nuq2", scale_dtype=f8)  # scale 2000/1.51 > 448


@pytest.mark.parametrize("fmt", ["nuq2", "nuq3", "int4", "int8"])
def test_float8_scales_keep_the_bound_and_cost_one_byte(fmt):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 37, 64) * torch.linspace(0.05, 4, 64)
    q = quantize(x, fmt, group_size=32, scale_dtype=torch.float8_e4m3fn)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.element_size() == 1
    y = dequantize(q, fmt, head_dim=64, group_size=32)
    assert bool(((y - x).abs() <= error_bound(q, fmt, x, group_size=32)).all())
    cfg = KVQuantConfig(key_format=fmt, value_format=fmt, key_group_size=32, scale_dtype="float8_e4m3")
    assert cfg.torch_scale_dtype == torch.float8_e4m3fn


def test_float8_codebook_scales_cost_little_error_and_pay_for_smaller_groups():
    """A group of 32 with an 8-bit scale costs the bits of a group of 64 with an fp16 one and, on
    heads with uneven channel groups, has less error."""
    torch.manual_seed(4)
    x = torch.randn(1, 8, 256, 64)
    x[..., :32] *= 3  # one half of each head louder than the other
    mse = lambda q, g: (dequantize(q, "nuq2", head_dim=64, group_size=g) - x).pow(2).mean()  # noqa: E731
    fp16_64 = mse(quantize(x, "nuq2"), None)
    fp8_64 = mse(quantize(x, "nuq2", scale_dtype=torch.float8_e4m3fn), None)
    fp8_32 = mse(quantize(x, "nuq2", group_size=32, scale_dtype=torch.float8_e4m3fn), 32)
    assert fp8_64 < 1.1 * fp16_64
    assert fp8_32 < 0.9 * fp16_64


# --------------------------------------------------------------------------------------------- presets

_RECIPE = dict(rotation="hadamard", smoothing="query", sink_tokens=4)  # every codebook preset
_RECENT = dict(residual_length=4, recent_key_format="nuq4", recent_value_format="nuq4")
# the 2-bit window recipe: keys scaled per 32 channels, 8-bit scales, a 96-token window
_RECENT_2BIT = dict(key_group_size=32, scale_dtype="float8_e4m3", recent_length=96, **_RECENT)
_PROBED = dict(retrieval_layers=4, retrieval_unit="head")  # 4 layers' worth of probed KV heads in nuq4
_G64 = dict(key_group_size=64, value_group_size=64)  # a scale per 64 channels (per head on 64-wide heads)
PINNED = {  # what the low-bit presets are; a change here is a change of a measured recipe
    # key channels weighed by the model's query sizes in heads with outlier channels (smoothing: query in
    # _RECIPE; Gemma 3 270M, README "Query-weighted key smoothing"); nuq4 with scales per 64 channels
    "nuq4": dict(key_format="nuq4", value_format="nuq4", residual_length=16, **_G64),
    "nuq3": dict(key_format="nuq3", value_format="nuq3", residual_length=8, **_PROBED),
    "k3v2": dict(key_format="nuq3", value_format="nuq2", residual_length=8, **_PROBED),
    # the 2-bit codebook presets need 6 layers' worth of retrieval heads (passkey at 4k on SmolLM2)
    "nuq2": dict(
        key_format="nuq2", value_format="nuq2", residual_length=8, **{**_PROBED, "retrieval_layers": 6}
    ),
    "k3v2-recent": dict(key_format="nuq3", value_format="nuq2", recent_length=64, **_RECENT, **_PROBED),
    "nuq2-recent": dict(
        key_format="nuq2", value_format="nuq2", **_RECENT_2BIT, **{**_PROBED, "retrieval_layers": 6}
    ),
    "tcq3v2-recent": dict(
        key_format="tcq3", value_format="tcq2", recent_length=64, **_G64, **_RECENT, **_PROBED
    ),
    "tcq2-recent": dict(key_format="tcq2", value_format="tcq2", **_RECENT_2BIT, **_PROBED),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_low_bit_presets_are_pinned(name):
    expected = KVQuantConfig(**{**_RECIPE, **PINNED[name]}, name=name)  # an entry may override the recipe
    assert KVQuantConfig.from_preset(name) == expected


def test_an_old_preset_name_loads_its_preset():
    """``int4-rot`` became ``int4``'s recipe (2026-12-07): the name still loads it, labelled as asked,
    everywhere a preset name is taken, and is not listed twice."""
    from kvquant.config import PRESET_ALIASES, preset_names
    from kvquant.planning import plan

    assert PRESET_ALIASES == {"int4-rot": "int4"} and "int4-rot" not in preset_names()
    old, new = KVQuantConfig.resolve("int4-rot"), KVQuantConfig.resolve("int4")
    assert old.name == "int4-rot" and old.to_dict() | {"name": "int4"} == new.to_dict()
    rows = plan(tiny_model("llama").config, memory_bytes=2**30, context=256, presets=["int4-rot", "int4"])
    by_name = {r["config"]: r for r in rows}
    assert by_name["int4-rot"]["bytes_per_token"] == by_name["int4"]["bytes_per_token"]
    with pytest.raises(ValueError, match="unknown preset 'int4-rotated'"):
        KVQuantConfig.from_preset("int4-rotated")
