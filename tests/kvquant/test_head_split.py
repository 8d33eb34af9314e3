"""Per-head formats: head overrides, the HeadSplitLayer, the kvquant attention over it, and
``retrieval_unit: head`` (the probe's best KV heads kept finer instead of whole layers)."""

import copy
import dataclasses

import pytest
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

import kvquant
from kvquant import KVQuantCache, KVQuantConfig
from kvquant.cache import HeadSplitLayer, QuantizedKVLayer, make_layer
from kvquant.memory import model_cache_bytes
from kvquant.models import tiny_model
from kvquant.retrieval_heads import retrieval_scores, top_heads

FINE = {"key_format": "nuq4", "value_format": "nuq4"}


def _split(**kw) -> KVQuantConfig:
    """nuq2 with KV head 1 in nuq4 and a longer full-precision tail (its tiers move on other steps)."""
    fields = {"key_format": "nuq2", "value_format": "nuq2", "residual_length": 2, "sink_tokens": 1}
    fields["heads"] = {1: {**FINE, "residual_length": 5, "sink_tokens": 0}}
    return KVQuantConfig(**{**fields, **kw})


def test_head_overrides_group_the_heads_and_a_layer_override_merges_into_them():
    cfg = KVQuantConfig(
        key_format="int4",
        heads={0: {"key_format": "int8"}, 2: {"key_format": "int8"}},
        layer_overrides={1: {"value_format": "int2", "heads": {2: {"value_format": "int8"}, 3: FINE}}},
    )
    assert [(h, c.key_format, c.value_format) for h, c in cfg.for_layer(0, 2).head_groups(4)] == [
        ([0, 2], "int8", "int8"),
        ([1, 3], "int4", "int8"),
    ]
    assert [(h, c.key_format, c.value_format) for h, c in cfg.for_layer(1, 2).head_groups(4)] == [
        ([0], "int8", "int2"),
        ([1], "int4", "int2"),
        ([2], "int8", "int8"),
        ([3], "nuq4", "nuq4"),
    ]
    assert [h for h, _ in KVQuantConfig().head_groups(3)] == [[0, 1, 2]]  # no overrides: one group


def _plain_twins(cfg: KVQuantConfig, kv_heads: int) -> list[tuple[list[int], QuantizedKVLayer]]:
    return [(heads, QuantizedKVLayer(c, initial_capacity=4)) for heads, c in cfg.head_groups(kv_heads)]


def test_split_layer_holds_each_group_exactly_as_a_layer_of_its_heads_would():
    """Prompt, decode steps, a beam reorder and a crop: every read equals the plain layers' over the
    same heads, put back in the model's head order; the bytes are theirs summed."""
    gen = torch.Generator().manual_seed(0)
    b, h, d = 2, 3, 16
    cfg = _split()
    layer = make_layer(cfg, kv_heads=h, initial_capacity=4)
    twins = _plain_twins(cfg, h)
    assert isinstance(layer, HeadSplitLayer) and [g for g, _ in twins] == [[0, 2], [1]]

    def step(n):
        k, v = torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)
        got_k, got_v = layer.update(k, v)
        want_k = torch.empty_like(got_k)
        want_v = torch.empty_like(got_v)
        for heads, twin in twins:
            tk, tv = twin.update(k[:, heads], v[:, heads])
            want_k[:, heads], want_v[:, heads] = tk, tv
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    step(11)
    for _ in range(6):
        step(1)
    beams = torch.tensor([1, 1])
    layer.reorder_cache(beams)
    for _, twin in twins:
        twin.reorder_cache(beams)
    step(1)
    layer.crop(-4)
    for _, twin in twins:
        twin.crop(-4)
    assert layer.get_seq_length() == 14
    step(2)
    parts = [twin.nbytes() for _, twin in twins]
    assert layer.nbytes() == {k: sum(p[k] for p in parts) for k in ("store", "tail", "sink")}
    assert layer.fp16_bytes() == sum(twin.fp16_bytes() for _, twin in twins)
    assert layer.formats() == ("nuq2[0,2]+nuq4[1]", "nuq2[0,2]+nuq4[1]")


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2"])
def test_fused_decode_over_split_layers_matches_the_dequantizing_path(family, greedy):
    """The kvquant attention decodes each group's query heads over that group's tiers; against the
    dequantizing path over the same cache contents (left padding, sliding layers, softcap)."""
    model = tiny_model(family)
    default = model.config._attn_implementation
    ids = torch.randint(3, 100, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0
    for cfg in (_split(), _split(heads={0: {"key_format": "int8", "recent_length": 0}}, recent_length=4)):
        model.set_attn_implementation(default)
        ref = KVQuantCache(model.config, cfg, fused=False, initial_capacity=4)
        seq_ref, logits_ref = greedy(model, ref, ids, 12, mask, pad_token_id=0)
        kvquant.enable(model)
        fused = KVQuantCache(model.config, cfg, initial_capacity=4)
        seq, logits = greedy(model, fused, ids, 12, mask, pad_token_id=0)
        assert all(isinstance(layer, HeadSplitLayer) for layer in fused.layers)
        rel = ((logits - logits_ref).norm() / logits_ref.norm()).item()
        assert rel <= 1e-4, (family, rel)
        assert torch.equal(seq, seq_ref)
    model.set_attn_implementation(default)


def test_the_finer_head_keeps_the_finer_error():
    """Direction: the overridden head is stored to nuq4's error, the others to nuq2's."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 3, 64, 32, generator=gen)
    cfg = _split(heads={1: FINE}, sink_tokens=0, residual_length=0)
    layer = make_layer(cfg, kv_heads=3)
    layer.update(k, k)
    err = (layer.keys - k).pow(2).mean(dim=(0, 2, 3))  # [H]
    assert err[1] < 0.3 * min(err[0], err[2])


def test_top_heads_rank_kv_heads_by_their_best_query_head():
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.0], [0.5, 0.0, 0.0, 0.3], [0.0, 0.0, 0.9, 0.0]])
    assert top_heads(scores, 3, kv_heads=2) == [(0, 0), (2, 1), (1, 0)]
    assert top_heads(scores, 9, kv_heads=2) == [(0, 0), (2, 1), (1, 0), (1, 1), (0, 1)]  # zeros left out
    with pytest.raises(ValueError, match="kv_heads: 3 does not divide the 4 query heads"):
        top_heads(scores, 1, kv_heads=3)


def _tcq2(n: int, unit: str) -> KVQuantConfig:
    base = KVQuantConfig.resolve("tcq2-recent")
    return dataclasses.replace(base, retrieval_layers=n, retrieval_unit=unit)


def test_retrieval_unit_head_keeps_the_best_heads_for_the_bytes_of_as_many_layers():
    model = tiny_model("llama", seed=1, num_hidden_layers=3)  # its best two heads in two layers
    cfg = model.config
    kv = cfg.num_key_value_heads
    want = top_heads(retrieval_scores(model), kv, kv)
    cache = KVQuantCache(model, _tcq2(1, "head"), initial_capacity=4)
    whole = KVQuantCache(model, _tcq2(1, "layer"), initial_capacity=4)
    assert cache.retrieval_heads == want and len(want) == kv
    assert cache.retrieval_layers == sorted({i for i, _ in want})
    assert cache.quant_config.retrieval_layers == 0  # resolved: head overrides name the heads
    for i, layer in enumerate(cache.layers):
        fine = [h for j, h in want if j == i]
        groups = [(c.key_format, heads) for heads, c in cache.quant_config.for_layer(i, 3).head_groups(kv)]
        assert ("nuq4", sorted(fine)) in groups if fine else groups == [("tcq2", list(range(kv)))]
        assert isinstance(layer, HeadSplitLayer) == (0 < len(fine) < kv)
    assert any(isinstance(layer, HeadSplitLayer) for layer in cache.layers)
    ids = torch.randint(3, 100, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids, cache=whole)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    windows = [kw.get("sliding_window") for kw in kwargs]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    dims = (150, 2, kv, head_dim, 4)
    assert cache.nbytes() == whole.nbytes()  # as many heads in nuq4: the same bytes
    assert model_cache_bytes(_tcq2(1, "head"), types, windows, *dims) == cache.nbytes()  # unprobed
    assert model_cache_bytes(cache.quant_config, types, windows, *dims) == cache.nbytes()  # resolved
    report = cache.format_memory_report()
    assert "nuq4[" in report and "tcq2[" in report


def test_a_pinned_layer_or_head_keeps_its_format():
    cfg = KVQuantConfig(
        key_format="nuq2",
        retrieval_layers=1,
        retrieval_unit="head",
        layer_overrides={3: {"key_format": "int8"}, 4: {"heads": {0: {"value_format": "int2"}}}},
    )
    out = cfg.with_retrieval_heads([(3, 1), (4, 0), (5, 1)], 6).layer_overrides
    assert out[3] == {"key_format": "int8", "heads": {1: {"value_format": "nuq4"}}}
    assert out[4] == {"heads": {0: {"value_format": "int2", "key_format": "nuq4"}}}
    assert out[5] == {"heads": {1: FINE}}


def test_a_split_cache_survives_beam_search_and_copies():
    model = kvquant.enable(tiny_model("llama"))
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = KVQuantCache(model, _split(), initial_capacity=4)
    out = model.generate(ids, cache=cache, max_new_tokens=6, num_beams=3, do_sample=False)
    assert out.shape == (1, 18)
    twin = copy.deepcopy(cache)
    assert twin.nbytes() == cache.nbytes() > 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"heads": {-1: FINE}}, "heads: invalid value -1; allowed: KV head indices: integers >= 0"),
        ({"heads": {0: "nuq4"}}, r"heads\[0\]: invalid value 'nuq4'; allowed: a mapping"),
        ({"heads": {0: {"heads": {}}}}, r"heads\[0\]: invalid value 'heads'; allowed: key_format"),
        ({"heads": {0: {"key_format": "int5"}}}, "key_format: invalid value 'int5'"),
        ({"layer_overrides": {0: {"heads": {0: {"name": "x"}}}}}, r"heads\[0\]: invalid value 'name'"),
        ({"retrieval_unit": "block"}, "retrieval_unit: invalid value 'block'; allowed: layer, head"),
    ],
)
def test_bad_head_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        KVQuantConfig(**fields)


def test_a_head_the_model_does_not_have_is_refused_when_the_cache_is_built():
    model = tiny_model("llama")  # 2 KV heads
    with pytest.raises(
        ValueError, match=r"heads: KV head 2 does not exist; this layer has 2 \(allowed: 0 .. 1\)"
    ):
        KVQuantCache(model, KVQuantConfig(heads={2: FINE}))
    with pytest.raises(ValueError, match="kv_heads: a config with head overrides"):
        make_layer(KVQuantConfig(heads={0: FINE}))


def test_head_overrides_survive_a_yaml_round_trip(tmp_path):
    cfg = KVQuantConfig(
        key_format="nuq2", heads={0: {"value_format": "int8"}}, layer_overrides={3: {"heads": {2: FINE}}}
    )
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert KVQuantConfig.from_yaml(path) == cfg  # (integer head and layer keys kept)


def test_with_one_kv_head_per_layer_heads_are_layers():
    """Gemma-shaped models (one KV head): ``retrieval_unit: head`` keeps the same layers, stored by plain
    layers, with the same results as whole layers."""
    model = tiny_model("llama", num_hidden_layers=3, num_key_value_heads=1)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = []
    for unit in ("head", "layer"):
        cache = KVQuantCache(model, _tcq2(1, unit), initial_capacity=4)
        with torch.no_grad():
            model(input_ids=ids[:, :30], cache=cache)
            logits.append(model(input_ids=ids[:, 30:], cache=cache).logits)
        assert not any(isinstance(layer, HeadSplitLayer) for layer in cache.layers)
        assert [layer.config.key_format for layer in cache.layers].count("nuq4") == 1
    assert torch.equal(logits[0], logits[1])


def test_a_non_finite_value_in_one_group_leaves_every_group_as_it_was():
    layer = make_layer(_split(), kv_heads=3, initial_capacity=4)
    k = torch.randn(1, 3, 12, 16)
    layer.update(k, k)
    before = layer.read_history()
    bad = torch.randn(1, 3, 1, 16)
    bad[0, 1, 0, 3] = float("nan")  # KV head 1: the second group
    with pytest.raises(ValueError, match="NaN or Inf"):
        layer.update(bad, torch.randn(1, 3, 1, 16))
    assert layer.get_seq_length() == 12 and all(p.get_seq_length() == 12 for p in layer.leaves())
    after = layer.read_history()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
