"""The fused ``kvquant`` attention on the embedded SmolLM2-135M-Instruct, every shipped preset as a user
gets it (``KVQuantCache(model, preset)``: probed retrieval heads and query sizes included): the
fused decode gives the dequantizing path's logits and greedy tokens.

Marked `slow` (they load the real model); they still run in `make test`."""

import copy
from collections import Counter

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant import KVQuantCache, attention
from kvquant.cache.view import KVView
from kvquant.config import preset_names

pytestmark = pytest.mark.slow


def _counted(fn, name, calls):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


@pytest.fixture
def sdpa_after(smollm2):
    """The model, set back to SDPA after the test (the tests switch it to the fused attention)."""
    model, _ = smollm2
    yield model
    model.set_attn_implementation("sdpa")


def test_pass_through_under_the_fused_path_generates_dynamic_caches_tokens(sdpa_after, wikitext_ids, greedy):
    model, ids = sdpa_after, wikitext_ids[:, :300]
    ref_seq, _ = greedy(model, DynamicCache(config=model.config), ids)
    kvquant.enable(model)
    assert torch.equal(greedy(model, KVQuantCache(model, "none"), ids)[0], ref_seq)


@pytest.mark.parametrize("preset", preset_names())
def test_fused_decode_equals_the_dequantizing_path(sdpa_after, wikitext_ids, greedy, preset, monkeypatch):
    """Same greedy tokens from two runs, one per path; and the dequantizing path's logits within 1e-4
    (relative, fp32) on the same cache contents (each step runs both paths on copies of one cache: fed
    separately, a 1e-6 difference in a new token's K/V can flip one rounding and the contents would
    drift apart). The fused run's decode steps go through the fused decode: none dequantizes."""
    model, ids = sdpa_after, wikitext_ids[:, :300]
    dequant_seq, _ = greedy(model, KVQuantCache(model, preset), ids)
    kvquant.enable(model)
    calls = Counter()
    for name, owner in (("_decode", attention), ("dequantized", KVView)):  # which path the steps take
        monkeypatch.setattr(owner, name, _counted(getattr(owner, name), name, calls))
    seq, _ = greedy(model, KVQuantCache(model, preset), ids)
    monkeypatch.undo()
    assert torch.equal(seq, dequant_seq), (seq, dequant_seq)
    assert calls["_decode"] >= model.config.num_hidden_layers * (seq.shape[1] - ids.shape[1] - 1), calls
    assert calls["dequantized"] == 0, calls
    cache = KVQuantCache(model, preset)
    with torch.no_grad():
        model(input_ids=ids[:, :280], cache=cache)
        for t in range(280, 286):
            twin = copy.deepcopy(cache)
            model.set_attn_implementation("sdpa")
            want = model(input_ids=ids[:, t : t + 1], cache=cache).logits
            kvquant.enable(model)
            got = model(input_ids=ids[:, t : t + 1], cache=twin).logits
            rel = ((got - want).norm() / want.norm()).item()
            assert rel <= 1e-4, (t, rel)
