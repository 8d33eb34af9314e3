"""The quality measurements themselves, on a tiny random llama: decode mode through a full-precision
cache reproduces single-pass perplexity, the baseline against itself has KL 0, a broken cache shows."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvquant import KVQuantCache
from kvquant.eval import compare, simulated_logprobs, single_pass_logprobs, teacher_forced_logprobs

P, N = 40, 24


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 128, (2, P + N), generator=g)  # [B, P + N]


class NoisyKeysCache(DynamicCache):
    """A deliberately broken cache: Gaussian noise added to every key it stores."""

    def __init__(self, config, scale: float):
        super().__init__(config=config)
        self.scale = scale
        self.gen = torch.Generator().manual_seed(1)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        noise = torch.randn(key_states.shape, generator=self.gen) * self.scale * key_states.std()
        return super().update(key_states + noise, value_states, layer_idx, *args, **kwargs)


@pytest.mark.parametrize("cache_kind", ["dynamic", "none"])
def test_decode_with_full_precision_cache_reproduces_single_pass_ppl(tiny, ids, cache_kind):
    ref = single_pass_logprobs(tiny, ids, P)
    cache = DynamicCache(config=tiny.config) if cache_kind == "dynamic" else KVQuantCache(tiny.config, "none")
    got = teacher_forced_logprobs(tiny, ids, P, cache)
    assert got.shape == ref.shape == (2, N, tiny.config.vocab_size)
    m = compare(ref, got, ids[:, P:])
    assert abs(m["ppl"] / m["ppl_base"] - 1) < 1e-4
    assert m["top1_agreement"] == 1.0
    assert m["kl_mean"] < 1e-6


def test_kl_of_baseline_against_itself_is_zero(tiny, ids):
    base = teacher_forced_logprobs(tiny, ids, P, DynamicCache(config=tiny.config))
    m = compare(base, base, ids[:, P:])
    assert m["kl_mean"] == m["kl_p90"] == m["kl_p99"] == 0.0
    assert m["delta_ppl"] == 0.0 and m["top1_agreement"] == 1.0
    assert m["tokens"] == 2 * N


def test_broken_cache_is_detected_as_worse(tiny, ids):
    base = teacher_forced_logprobs(tiny, ids, P, DynamicCache(config=tiny.config))
    int8 = compare(base, teacher_forced_logprobs(tiny, ids, P, KVQuantCache(tiny.config, "int8")), ids[:, P:])
    noisy = compare(base, teacher_forced_logprobs(tiny, ids, P, NoisyKeysCache(tiny.config, 0.5)), ids[:, P:])
    assert noisy["kl_mean"] > 10 * int8["kl_mean"] > 0
    assert noisy["kl_p99"] > int8["kl_p99"]
    assert noisy["top1_agreement"] < int8["top1_agreement"] <= 1.0


def test_simulated_mode(tiny, ids):
    ref = single_pass_logprobs(tiny, ids, P)
    for cache in (DynamicCache(config=tiny.config), KVQuantCache(tiny.config, "none")):
        torch.testing.assert_close(simulated_logprobs(tiny, ids, P, cache), ref, rtol=1e-5, atol=1e-5)
    int4 = compare(ref, simulated_logprobs(tiny, ids, P, KVQuantCache(tiny.config, "int4")), ids[:, P:])
    int8 = compare(ref, simulated_logprobs(tiny, ids, P, KVQuantCache(tiny.config, "int8")), ids[:, P:])
    assert int4["kl_mean"] > int8["kl_mean"] > 0


def test_simulated_is_no_better_than_decode_for_a_lossy_cache(tiny, ids):
    # simulated quantizes every token a query sees (itself included); decode keeps each step's own token
    # and the prefill in full precision: the screen must not look rosier than the real thing
    ref = single_pass_logprobs(tiny, ids, P)
    sim = compare(ref, simulated_logprobs(tiny, ids, P, KVQuantCache(tiny.config, "int4")), ids[:, P:])
    dec = compare(ref, teacher_forced_logprobs(tiny, ids, P, KVQuantCache(tiny.config, "int4")), ids[:, P:])
    assert sim["kl_mean"] > dec["kl_mean"] > 0
