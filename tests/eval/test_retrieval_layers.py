"""The retrieval-layer search (kvquant.eval.retrieval_layers) on the tiny random Llama."""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvquant import KVQuantCache
from kvquant.config import KVQuantConfig
from kvquant.eval.retrieval import answer, answer_first_token, passkey_cases, passkey_prompt
from kvquant.eval.retrieval_layers import find_retrieval_count, find_retrieval_layers

KW = {"length": 360, "trials": 2, "digits": 3}


def _margins_by_prefill(model, tok, config, seed):
    """Each prompt's margin through the real path: the prompt prefilled into the cache, then answered."""
    margins = []
    for case in passkey_cases([KW["length"]], KW["trials"], KW["digits"], seed):
        ids, q_len = passkey_prompt(tok, case["length"], case["key"], case["depth"])
        cache = DynamicCache(config=model.config) if config is None else KVQuantCache(model, config)
        margins.append(answer(model, cache, ids, q_len, 1, first=answer_first_token(tok, case["key"]))[1])
    return margins


def _capped(margins, full):
    return sum(min(m, r) for m, r in zip(margins, full, strict=True)) / len(full)


def test_the_search_scores_what_a_prefill_gives_and_protects_the_keys_until_the_reference(tiny, byte_tok):
    # keys in 2 bits, values exact: protecting every layer's keys with "none" is the full-precision cache
    cfg = KVQuantConfig(key_format="int2", value_format="none", name="k2")
    n = tiny.config.num_hidden_layers
    seed = 5  # prompts where 2-bit keys lower the margin (by 0.033) on this model
    found = find_retrieval_layers(
        tiny, byte_tok, cfg, protect_format="none", max_layers=n, tolerance=1e-4, seed=seed, **KW
    )
    with torch.no_grad():
        full = _margins_by_prefill(tiny, byte_tok, None, seed)
        assert found.reference == pytest.approx(sum(full) / len(full), abs=1e-4)
        assert found.margins[0] == pytest.approx(
            _capped(_margins_by_prefill(tiny, byte_tok, cfg, seed), full), abs=1e-4
        )
        last = _margins_by_prefill(tiny, byte_tok, found.config, seed)
        assert found.margins[-1] == pytest.approx(_capped(last, full), abs=1e-4)
    assert found.margins[0] < found.reference - 0.01
    assert abs(found.margins[-1] - found.reference) <= 1e-4  # and the search got back to it
    assert all(
        b > a for a, b in zip(found.margins, found.margins[1:], strict=False)
    )  # each chosen layer helped
    assert found.config.layer_overrides == {i: {"key_format": "none"} for i in sorted(found.layers)}
    for layers, best in zip(found.gains, found.layers, strict=False):
        assert max(layers, key=layers.__getitem__) == best


def test_the_search_keeps_the_configs_own_overrides_and_checks_its_arguments(tiny, byte_tok):
    cfg = KVQuantConfig(
        key_format="int2", value_format="int2", layer_overrides={0: {"value_format": "int8"}}, name="k2"
    )
    found = find_retrieval_layers(tiny, byte_tok, cfg, max_layers=1, tolerance=-1e9, seed=5, **KW)
    assert len(found.layers) <= 1
    for i in found.layers:
        assert found.config.layer_overrides[i]["key_format"] == "nuq4"
    assert found.config.layer_overrides[0]["value_format"] == "int8"
    assert dataclasses.replace(found.config, layer_overrides={}) == dataclasses.replace(
        cfg, layer_overrides={}
    )
    with pytest.raises(ValueError, match="key_format"):
        find_retrieval_layers(tiny, byte_tok, cfg, protect_format="int5", **KW)
    with pytest.raises(ValueError, match="max_layers"):
        find_retrieval_layers(tiny, byte_tok, cfg, max_layers=-1, **KW)


def test_the_count_scores_what_a_prefill_gives_and_takes_the_smallest_count_near_the_best(tiny, byte_tok):
    # 2-bit keys (seed 5: prompts where they lower the margin); a retrieval layer passes its keys and
    # values through: with every layer one, the cache holds what full precision holds
    cfg = KVQuantConfig(key_format="int2", value_format="none", retrieval_format="none", name="k2")
    n, seed = tiny.config.num_hidden_layers, 5
    kw = {"lengths": (KW["length"],), "trials": KW["trials"], "digits": KW["digits"], "seed": seed}
    (found,) = find_retrieval_count(tiny, byte_tok, [cfg], max_count=n, tolerance=1e-4, **kw)
    with torch.no_grad():
        full = _margins_by_prefill(tiny, byte_tok, None, seed)
        assert found.reference == pytest.approx(full, abs=1e-4)
        for count in (0, n):
            by_prefill = _margins_by_prefill(
                tiny, byte_tok, dataclasses.replace(cfg, retrieval_layers=count), seed
            )
            assert found.margins[count] == pytest.approx(by_prefill, abs=1e-4)
    reference = sum(full) / len(full)
    assert found.capped(0) < reference - 0.01  # 2-bit keys everywhere lose margin
    assert found.capped(n) == pytest.approx(reference, abs=1e-4)  # all layers passed through
    assert found.answered(n) == sum(m > 0 for m in full)
    # the smallest count within the tolerance of the best; none below it is
    best = max(found.capped(c) for c in found.margins)
    assert found.capped(found.count) >= best - 1e-4
    assert all(found.capped(c) < best - 1e-4 for c in range(found.count))
    assert found.config == dataclasses.replace(cfg, retrieval_layers=found.count)
    # a tolerance as wide as the whole gain takes no layer
    (wide,) = find_retrieval_count(tiny, byte_tok, [cfg], max_count=n, tolerance=1.0, **kw)
    assert wide.count == 0 and wide.margins == found.margins


def test_the_count_checks_its_arguments(tiny, byte_tok):
    cfg = KVQuantConfig(key_format="int2", value_format="int2", name="kv2")
    kw = {"lengths": (KW["length"],), "trials": KW["trials"], "digits": KW["digits"], "seed": 5}
    with pytest.raises(ValueError, match="max_count"):
        find_retrieval_count(tiny, byte_tok, [cfg], max_count=-1, **kw)
    channel_keys = dataclasses.replace(
        KVQuantConfig.resolve("kivi2"), retrieval_layers=0, retrieval_format="nuq4"
    )
    with pytest.raises(ValueError, match="retrieval_format"):  # nuq4 on the channel axis: before any prompt
        find_retrieval_count(tiny, object(), [channel_keys], **kw)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs" / "retrieval").glob("*.yaml")))
def test_shipped_retrieval_configs_protect_keys_on_smollm2(path):
    """``configs/retrieval/smollm2-*.yaml`` (``kvquant calibrate --retrieval`` output, the ``--pin`` of
    the tuned configs): a cache on SmolLM2's geometry accepts it, and its overrides hold keys only."""
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64
    )
    cfg = KVQuantConfig.from_yaml(path)
    cache = KVQuantCache(smollm2, cfg)
    assert cfg.layer_overrides and all(set(ov) == {"key_format"} for ov in cfg.layer_overrides.values())
    for i in cfg.layer_overrides:
        assert cache.layers[i].config.key_format == cfg.layer_overrides[i]["key_format"] != cfg.key_format
