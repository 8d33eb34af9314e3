"""Retrieval layers found by the probe: scores, the cache's use of them, byte accounting, bad input."""

import dataclasses
import warnings

import pytest
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.memory import model_cache_bytes
from kvquant.models import tiny_model
from kvquant.retrieval_heads import retrieval_scores, top_layers


def _tcq2(n: int, **kw) -> KVQuantConfig:
    """``tcq2-recent`` keeping ``n`` whole retrieval layers (the preset keeps heads: test_head_split)."""
    kw.setdefault("retrieval_unit", "layer")
    return dataclasses.replace(KVQuantConfig.resolve("tcq2-recent"), retrieval_layers=n, **kw)


def _forwards(model) -> list[int]:
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_scores_cover_every_layer_and_head_and_leave_the_attention_as_it_was():
    model = tiny_model("llama")
    impl = model.config._attn_implementation
    calls = _forwards(model)
    scores = retrieval_scores(model, tokens=16)
    cfg = model.config
    assert scores.shape == (cfg.num_hidden_layers, cfg.num_attention_heads)
    assert ((scores > 0) & (scores <= 1)).all()  # attention weights: a mean in (0, 1]
    assert model.config._attn_implementation == impl
    assert torch.equal(retrieval_scores(model, tokens=16), scores) and len(calls) == 1  # kept per model
    retrieval_scores(model, tokens=16, seed=1)
    assert len(calls) == 2


def test_a_planted_induction_head_scores_near_one():
    """A layer whose attention is rewired to look at the token after the previous occurrence of the
    current one (by hand, through the eager attention's weights) must come out on top."""
    model = tiny_model("llama")
    n = 16
    layer = model.model.layers[1].self_attn
    original = layer.forward

    def forward(*args, **kwargs):
        out, weights = original(*args, **kwargs)
        t = weights.shape[-1]
        planted = torch.zeros_like(weights)
        rows = torch.arange(t)
        target = torch.where(rows > n, rows - n + 1, rows)  # second copy: s[i] -> s[i + 1] in the first
        planted[:, 0, rows, target] = 1.0
        planted[:, 1:] = weights[:, 1:]
        return out, planted

    layer.forward = forward
    scores = retrieval_scores(model, tokens=n)
    assert scores[1, 0] == pytest.approx(1.0)
    assert top_layers(scores, 1) == [1]


def test_top_layers_ranks_by_the_best_head_ties_to_the_lower_index():
    scores = torch.tensor([[0.1, 0.2], [0.9, 0.0], [0.2, 0.2], [0.0, 0.9]])
    assert top_layers(scores, 3) == [1, 3, 0]
    assert top_layers(scores, 9) == [1, 3, 0, 2]
    assert top_layers(scores, 0) == []


def test_cache_given_the_model_keeps_the_found_layers_keys_and_values_finer():
    model = tiny_model("llama")
    found = top_layers(retrieval_scores(model), 1)
    cache = KVQuantCache(model, _tcq2(1))
    assert cache.retrieval_layers == found
    assert cache.quant_config.retrieval_layers == 0  # resolved: the overrides name the layer
    assert cache.quant_config.layer_overrides == {found[0]: {"key_format": "nuq4", "value_format": "nuq4"}}
    formats = [(layer.config.key_format, layer.config.value_format) for layer in cache.layers]
    assert formats == [("nuq4", "nuq4") if i in found else ("tcq2", "tcq2") for i in range(len(formats))]


def test_an_override_of_the_found_layer_keeps_its_format():
    model = tiny_model("llama")
    top = top_layers(retrieval_scores(model), 1)[0]
    n = model.config.num_hidden_layers
    cache = KVQuantCache(model, _tcq2(1, layer_overrides={top - n: {"key_format": "int8"}}))
    assert (cache.layers[top].config.key_format, cache.layers[top].config.value_format) == ("int8", "nuq4")


def test_cache_given_only_the_config_warns_and_keeps_every_key_format():
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match=r"retrieval_layers: .*KVQuantCache\(model"):
        cache = KVQuantCache(model.config, _tcq2(1))
    assert cache.retrieval_layers == [] and cache.quant_config.retrieval_layers == 0  # what it holds
    assert {(layer.config.key_format, layer.config.value_format) for layer in cache.layers} == {
        ("tcq2", "tcq2")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVQuantCache(model.config, _tcq2(0, smoothing="mean"))  # nothing to probe for: no warning


def test_predicted_bytes_count_the_retrieval_layers():
    """The planner cannot probe: it counts the finer keys on the last layers, the same bytes where the
    layers are alike."""
    model = tiny_model("llama")
    cache = KVQuantCache(model, _tcq2(1), initial_capacity=4)
    plain = KVQuantCache(model, _tcq2(0), initial_capacity=4)
    ids = torch.randint(3, 100, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids, cache=plain)
    cfg = model.config
    types, kwargs = get_layer_types_and_kwargs(cfg)
    windows = [kw.get("sliding_window") for kw in kwargs]
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    predicted = model_cache_bytes(_tcq2(1), types, windows, 150, 2, cfg.num_key_value_heads, head_dim, 4)
    assert predicted == cache.nbytes() > plain.nbytes()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"retrieval_layers": -1}, "retrieval_layers: invalid value -1; allowed: an integer >= 0"),
        ({"retrieval_layers": True}, "retrieval_layers: invalid value True"),
        ({"retrieval_format": "int5"}, "retrieval_format: invalid value 'int5'; allowed: none, int8"),
        (
            {
                "key_format": "int2",
                "key_axis": "channel",
                "key_group_size": 32,
                "retrieval_format": "nuq4",
                "retrieval_layers": 1,
            },
            "retrieval_format: invalid value 'nuq4'; allowed: a format the channel axis can store",
        ),
    ],
)
def test_bad_retrieval_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        KVQuantConfig(**fields)


def test_the_probe_hands_a_kvquant_model_back_on_the_kvquant_attention():
    import kvquant

    model = kvquant.enable(tiny_model("llama"))
    cache = KVQuantCache(model, _tcq2(1))
    assert model.config._attn_implementation == "kvquant" and cache.uses_views()
    assert len(cache.retrieval_layers) == 1


def test_a_model_the_probe_cannot_read_warns_and_keeps_every_key_format(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(
        model, "set_attn_implementation", lambda impl: (_ for _ in ()).throw(ValueError("no eager"))
    )
    with pytest.warns(UserWarning, match=r"retrieval_layers: probing LlamaForCausalLM failed \(no eager\)"):
        cache = KVQuantCache(model, _tcq2(1))
    assert cache.retrieval_layers == [] and {layer.config.key_format for layer in cache.layers} == {"tcq2"}
