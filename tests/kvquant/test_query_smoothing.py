"""smoothing: query — the query probe, the divisor it gives, exact attention, and that it lowers the
score error it targets."""

import dataclasses
import warnings

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.cache.factory import make_layer
from kvquant.models import tiny_model
from kvquant.query_scales import (
    QUERY_EXPONENT_PLAIN,
    QUERY_EXPONENT_ROTATED,
    pooled_query_rms,
    query_channel_rms,
)
from kvquant.retrieval_heads import probe_ids
from kvquant.transforms import AUTO_MIN_TOKENS, KeyTransform


def test_probe_measures_each_layers_queries_and_leaves_the_attention_as_it_was():
    model = tiny_model("llama")
    impl = model.config._attn_implementation
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    rms = query_channel_rms(model, tokens=16)
    cfg = model.config
    hk, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert sorted(rms) == list(range(cfg.num_hidden_layers))
    assert all(tuple(r.shape) == (hk, d) for r in rms.values())
    assert model.config._attn_implementation == impl
    query_channel_rms(model, tokens=16)
    assert len(calls) == 1  # kept per model

    seen = {}  # the queries themselves, through an attention function of this test's own

    def capture(module, q, k, v, mask, **kw):
        seen[module.layer_idx] = q.detach().clone()
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("test_query_capture", capture)
    ids, first = probe_ids(model, 16)
    model.set_attn_implementation("test_query_capture")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(impl)
    for layer, q in seen.items():
        hq = q.shape[1]
        power = q[0, :, first:].pow(2).mean(1).view(hk, hq // hk, d)  # [Hk, G, D]
        expected = (power / power.sum(-1, keepdim=True)).mean(1).sqrt()  # each head's shares, averaged
        torch.testing.assert_close(rms[layer], expected)


def test_the_probe_fits_the_models_positions():
    ids, first = probe_ids(tiny_model("llama", max_position_embeddings=64), 128)
    assert ids.shape[1] <= 64 and (ids.shape[1] - first) % 2 == 0
    assert torch.equal(
        ids[0, first : first + (ids.shape[1] - first) // 2], ids[0, first + (ids.shape[1] - first) // 2 :]
    )


def _keys(gen, n=64, h=2, d=64):
    spread = torch.exp(torch.randn(h, d, generator=gen))  # [H, D] lognormal channel spreads
    return torch.randn(1, h, n, d, generator=gen) * spread[None, :, None, :] + 3.0 * torch.randn(
        h, 1, d, generator=gen
    )


@pytest.mark.parametrize("rotation", ["hadamard", "none"])
def test_the_divisor_is_the_keys_spread_and_the_queries_size_in_wide_heads(rotation):
    """Head 0's channel spreads are lognormal (the largest far above 6x the median, as QK-norm gains
    give): it is divided by ``std^(1-a) * (mean(rms) / rms)^a``. Head 1's are even: it takes the
    mean alone (divisor 1), as ``auto`` and ``mean`` do; so do both with too few tokens to tell."""
    gen = torch.Generator().manual_seed(0)
    k = _keys(gen)
    k[:, 1] = torch.randn(1, 64, 64, generator=gen) + 2.0  # head 1: even spreads, an offset
    rms = torch.exp(torch.randn(2, 64, generator=gen))  # [H, D]
    t = KeyTransform(rotation, "query", torch.float32, query_rms=rms)
    t.fit(k)
    a = QUERY_EXPONENT_ROTATED if rotation == "hadamard" else QUERY_EXPONENT_PLAIN
    std = k[0, 0].std(0, unbiased=False)  # [D]
    expected = std ** (1 - a) * (rms[0].mean() / rms[0]) ** a
    torch.testing.assert_close(t.stats[1][0, 0, 0], expected, rtol=1e-4, atol=0)
    assert torch.equal(t.stats[1][0, 1, 0], torch.ones(64))
    few = KeyTransform(rotation, "query", torch.float32, query_rms=rms)
    few.fit(k[:, :, : AUTO_MIN_TOKENS - 1])
    assert torch.equal(few.stats[1], torch.ones(1, 2, 1, 64))
    # attention stays exact: the folded query scores the stored keys as the query scores k - mean
    q = torch.randn(1, 4, 64, generator=gen)  # [B, Hq, D], 2 query heads per KV head
    ks = t.apply(k, torch.zeros_like(k))[0]  # [B, H, n, D]
    folded = t.fold_query(q)
    mean = t.stats[0].float().repeat_interleave(2, 1)  # [B, Hq, 1, D]
    want = ((k.repeat_interleave(2, 1) - mean) * q[:, :, None]).sum(-1)
    got = (ks.repeat_interleave(2, 1) * folded[:, :, None]).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_without_query_sizes_it_smooths_as_auto():
    gen = torch.Generator().manual_seed(1)
    k = _keys(gen)
    t, auto = (
        KeyTransform("hadamard", "query", torch.float16),
        KeyTransform("hadamard", "auto", torch.float16),
    )
    t.fit(k)
    auto.fit(k)
    assert torch.equal(t.stats[1], auto.stats[1])


def _score_error(cfg: KVQuantConfig, k: torch.Tensor, q: torch.Tensor, rms: torch.Tensor) -> float:
    """Mean squared error of the scores ``q . k`` over keys stored by a layer of ``cfg``."""
    layer = make_layer(cfg, layer_idx=0, query_rms=rms if cfg.smoothing == "query" else None)
    layer.lazy_initialization(k, k)
    layer.append(k, k)
    kq = layer.read(0, k.shape[2])[0].float()  # [B, H, n, D], the keys back
    e = kq - k  # [B, H, n, D]
    return (torch.einsum("bhnd,bhqd->bhqn", e, q) ** 2).mean().item()


@pytest.mark.parametrize(("rotation", "other"), [("hadamard", "mean"), ("none", "channel")])
def test_query_smoothing_lowers_the_score_error_where_queries_and_keys_differ(rotation, other):
    """Keys with lognormal channel spreads (some channels 10x others, as QK-norm gains give) read by
    queries whose channel sizes are lognormal too and independent of the keys': weighing the key
    channels by the queries lowers the error of the scores ``q . k`` against the preset recipes'
    smoothing (``mean`` after a rotation; ``channel`` without one)."""
    gen = torch.Generator().manual_seed(2)
    h, d = 2, 64
    k = _keys(gen, n=256, h=h, d=d)
    rms = torch.exp(torch.randn(h, d, generator=gen))  # [H, D]
    q = torch.randn(1, h, 128, d, generator=gen) * rms[None, :, None, :]  # [B, H, nq, D]
    base = KVQuantConfig(key_format="int4", value_format="int4", key_group_size=64, rotation=rotation)
    err = {s: _score_error(dataclasses.replace(base, smoothing=s), k, q, rms) for s in ("query", other)}
    assert err["query"] < 0.7 * err[other], err


def test_pooling_keeps_the_channels_a_small_query_head_reads():
    """Two query heads share a KV head: head 0's queries are 10x larger and spread over every
    channel; head 1 (a retrieval head, say) reads 8 channels. Pooling the raw mean squares lets head 0
    set the weights alone; :func:`pooled_query_rms` counts each head's channels as shares of its own
    total, so the worst head's score error, relative to its own scores, falls."""
    gen = torch.Generator().manual_seed(3)
    d = 64
    k = _keys(gen, n=256, h=1, d=d)  # [1, 1, n, D], lognormal channel spreads
    size = torch.exp(torch.randn(2, d, generator=gen))  # [G, D]
    size[0] *= 10
    size[1, 8:] *= 0.05  # head 1 reads channels 0-7
    q = torch.randn(2, 128, d, generator=gen) * size[:, None, :]  # [G, nq, D]
    power = q.pow(2).mean(1)[None]  # [1, G, D]
    cfg = KVQuantConfig(
        key_format="int4", value_format="int4", key_group_size=64, rotation="hadamard", smoothing="query"
    )

    def worst(rms: torch.Tensor) -> float:
        errs = [_score_error(cfg, k, q[g][None, None], rms) / power[0, g].sum().item() for g in range(2)]
        return max(errs)

    raw = worst(power.mean(1).sqrt())
    pooled = worst(pooled_query_rms(power))
    assert pooled < 0.7 * raw, (pooled, raw)


def test_the_cache_probes_the_model_and_warns_with_only_its_config():
    model = tiny_model("llama")
    cfg = KVQuantConfig(key_format="int4", value_format="int4", rotation="hadamard", smoothing="query")
    cache = KVQuantCache(model, cfg)
    rms = query_channel_rms(model)
    assert all(torch.equal(layer.query_rms, rms[i]) for i, layer in enumerate(cache.layers))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare = KVQuantCache(model.config, cfg)
    assert any("smoothing" in str(w.message) and "auto" in str(w.message) for w in caught)
    assert all(layer.query_rms is None for layer in bare.layers)
    with torch.no_grad():  # it generates, and a layer that asks for no smoothing gets no sizes
        ids = torch.randint(0, 100, (1, 40))
        model(ids, cache=cache)
        mixed = KVQuantCache(model, dataclasses.replace(cfg, layer_overrides={0: {"smoothing": "mean"}}))
    assert mixed.layers[0].query_rms is None and mixed.layers[1].query_rms is not None


def test_a_key_map_and_query_smoothing_do_not_mix():
    with pytest.raises(ValueError, match="smoothing"):
        KVQuantConfig(key_format="nuq4", value_format="nuq4", smoothing="query", key_map="smollm2")
    cfg = KVQuantConfig(key_format="nuq4", value_format="nuq4", smoothing="query").with_key_map("smollm2")
    assert cfg.smoothing == "mean" and cfg.key_map == "smollm2"
