"""The free-running check (:mod:`kvquant.eval.free_run`) on a tiny random llama: greedy continuations,
their full-precision perplexity, divergence; and its wiring into ``run_eval``."""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from kvquant import KVQuantCache
from kvquant.eval import CacheSpec, run_eval
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.eval.free_run import continuation_nll, free_run_numbers, greedy_continuations


class NoisyCache(DynamicCache):
    """A destructive cache: every key and value it hands attention is replaced by noise."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        g = torch.Generator().manual_seed(layer_idx + k.shape[2])
        return torch.randn(k.shape, generator=g) * 3, torch.randn(v.shape, generator=g) * 3


def _prompts(n=2, length=24):
    return torch.randint(3, 100, (n, length), generator=torch.Generator().manual_seed(0))


def _reference_greedy(model, prompt, cache, tokens):
    """The twin of ``greedy_continuation``: prefill, then argmax fed back one token per call."""
    out = model(input_ids=prompt[None], cache=cache, use_cache=True)
    got = []
    for _ in range(tokens):
        nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]
        got.append(nxt)
        out = model(input_ids=nxt, cache=cache, use_cache=True)
    return torch.cat(got, dim=1)[0]


def test_greedy_continuation_is_the_argmax_loop_and_runs_past_end_of_text(tiny, greedy):
    prompts = _prompts(1)
    want = _reference_greedy(tiny, prompts[0], DynamicCache(config=tiny.config), 12)
    got = greedy_continuations(tiny, prompts, lambda: DynamicCache(config=tiny.config), 12)
    assert torch.equal(got[0], want)
    seq, _ = greedy(tiny, DynamicCache(config=tiny.config), prompts, n=12)
    assert torch.equal(got, seq[:, prompts.shape[1] :])
    # the model's end-of-text token is the first one generated: generate would stop there, this does not
    saved = tiny.generation_config.eos_token_id
    tiny.generation_config.eos_token_id = int(want[0])
    try:
        again = greedy_continuations(tiny, prompts, lambda: DynamicCache(config=tiny.config), 12)
    finally:
        tiny.generation_config.eos_token_id = saved
    assert torch.equal(again[0], want)


def test_continuation_nll_is_the_teacher_forced_full_precision_nll(tiny):
    prompts, n = _prompts(), 10
    cont = torch.randint(3, 100, (2, n), generator=torch.Generator().manual_seed(1))
    nll = continuation_nll(tiny, prompts, cont)
    for i in range(2):
        seq = torch.cat([prompts[i], cont[i]])[None]
        lp = teacher_forced_logprobs(tiny, seq, prompts.shape[1], DynamicCache(config=tiny.config))
        want = -lp[0].gather(-1, cont[i, :, None]).mean()
        assert math.isclose(nll[i].item(), want.item(), rel_tol=1e-4)


def test_passthrough_cache_matches_and_a_destructive_one_diverges(tiny):
    prompts, n = _prompts(), 16
    ref = greedy_continuations(tiny, prompts, lambda: DynamicCache(config=tiny.config), n)
    same = greedy_continuations(tiny, prompts, lambda: KVQuantCache(tiny.config, "none"), n)
    m = free_run_numbers(tiny, prompts, ref, same)
    assert torch.equal(same, ref)
    assert m["identical_fraction"] == 1.0 and m["first_divergence"] == n == m["tokens"]
    assert m["ppl"] == m["ppl_dynamic"] and m["ppl_ratio"] == 1.0

    bad = greedy_continuations(tiny, prompts, lambda: NoisyCache(config=tiny.config), n)
    d = free_run_numbers(tiny, prompts, ref, bad)
    assert d["identical_fraction"] < 1.0 and d["first_divergence"] < n
    first = d["first_divergence_each"]
    for i in range(2):  # the first divergent position, exactly
        if first[i] < n:
            assert (
                torch.equal(bad[i, : first[i]], ref[i, : first[i]]) and bad[i, first[i]] != ref[i, first[i]]
            )
    assert d["ppl_dynamic"] == m["ppl_dynamic"]
    want = continuation_nll(tiny, prompts, bad).mean().exp().item()
    assert math.isclose(d["ppl"], want, rel_tol=1e-6) and d["ppl"] > d["ppl_dynamic"]


def test_run_eval_free_run_records_and_table(tmp_path, tiny, byte_tok, fast):
    noisy = CacheSpec.custom("noisy", lambda m: NoisyCache(config=m.config))
    overrides = {
        **fast,
        "output.dir": str(tmp_path),
        "caches": ["dynamic", "none"],
        "quality.enabled": False,
        "memory.enabled": False,
        "speed.enabled": False,
        "retrieval.enabled": False,
        "free_run.enabled": True,
        "free_run.tokens": 12,
        "free_run.prompt_len": 40,
        "free_run.prompts": 2,
    }
    result = run_eval(overrides=overrides, model=tiny, tokenizer=byte_tok, caches=[noisy])
    by = {r["cache"]: r["free_run"] for r in result.records}
    assert by["dynamic"]["ppl_ratio"] == 1.0 and by["dynamic"]["identical_fraction"] == 1.0
    assert by["none"]["ppl"] == by["dynamic"]["ppl"] and by["none"]["first_divergence"] == 12
    assert by["noisy"]["identical_fraction"] < 1.0 and by["noisy"]["ppl_dynamic"] == by["dynamic"]["ppl"]
    assert by["noisy"]["prompts"] == 2 and by["noisy"]["prompt_len"] == 40
    assert "diverges @" in result.table and "free-run ppl (12 tok)" in result.table
