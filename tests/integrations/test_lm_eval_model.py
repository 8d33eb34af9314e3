"""lm-eval model ``kvquant``: ``cache=none`` reproduces lm-eval's ``hf`` model, a quantized cache is
really in the loop (log-likelihoods, rolling perplexity and generation), offline on local tasks."""

from __future__ import annotations

import sys

import pytest
import torch

from kvquant import KVQuantCache
from kvquant.eval.decode import single_pass_logprobs

pytest.importorskip("lm_eval")  # the `lmeval` extra (set up by `make test`; absent on a bare GPU image)
from kvquant.integrations.lm_eval_model import KVQuantLM, continuation_logprob  # noqa: E402

TASKS = ["kvq_mc", "kvq_gen", "kvq_ppl"]


def loglikelihoods(responses: list) -> list[float]:
    """Every log-likelihood of a task's responses, flattened (multiple choice: one per choice)."""
    flat = []
    for doc in responses:
        for resp in doc:
            value = resp[0]
            flat.append(float(value[0] if isinstance(value, (list, tuple)) else value))
    return flat


def test_continuation_logprob_through_a_pass_through_cache_is_the_single_pass_one(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, 30), generator=g)
    context, continuation = ids[0, :25].tolist(), ids[0, 25:].tolist()
    ref = single_pass_logprobs(model, ids, 25)[0]  # [5, V]
    want = float(ref.gather(-1, ids[0, 25:, None]).sum())
    got, greedy = continuation_logprob(model, context, continuation, KVQuantCache(model.config, "none"))
    assert got == pytest.approx(want, abs=1e-4)
    assert greedy == bool((ref.argmax(-1) == ids[0, 25:]).all())
    quant, _ = continuation_logprob(model, context, continuation, KVQuantCache(model.config, "int4"))
    assert abs(quant - want) > 1e-3  # the int4 cache holds the context: the score moves
    with pytest.raises(ValueError, match="context and continuation"):
        continuation_logprob(model, [], continuation, KVQuantCache(model.config, "none"))


def test_bad_cache_is_one_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match=r"cache=int5: .*unknown cache or preset 'int5'.*allowed"):
        KVQuantLM(pretrained=str(tiny_model_dir), cache="int5", device="cpu")


def _three_runs(run_lm_eval, hf_model: str, kv_model: str, tasks_dir, quant: str, tasks: list[str]):
    common = "dtype=float32,device=cpu"
    return {
        "hf": run_lm_eval("hf", f"pretrained={hf_model},{common}", tasks_dir, tasks),
        "none": run_lm_eval("kvquant", f"pretrained={kv_model},{common},cache=none", tasks_dir, tasks),
        quant: run_lm_eval("kvquant", f"pretrained={kv_model},{common},cache={quant}", tasks_dir, tasks),
    }


def _check(runs: dict[str, dict], quant: str) -> None:
    hf, none, q = runs["hf"], runs["none"], runs[quant]
    for task in ("kvq_mc", "kvq_ppl"):
        ref = loglikelihoods(hf[task])
        assert loglikelihoods(none[task]) == pytest.approx(ref, abs=2e-4, rel=1e-5), task
        # the quantized cache gives its own numbers on every request (each context reaches the store)
        moved = [abs(a - b) for a, b in zip(loglikelihoods(q[task]), ref, strict=True)]
        assert min(moved) > 1e-4, (task, moved)
    assert none["results"]["kvq_mc"]["acc,none"] == hf["results"]["kvq_mc"]["acc,none"]
    if "kvq_gen" in hf:
        assert none["kvq_gen"] == hf["kvq_gen"]  # the same greedy text through the pass-through cache


def test_tiny_model_none_reproduces_hf_and_int4_differs(tiny_model_dir, lm_tasks, run_lm_eval, monkeypatch):
    built = []
    original = KVQuantLM.new_cache

    def spy(self):
        cache = original(self)
        built.append(cache)
        return cache

    monkeypatch.setattr(KVQuantLM, "new_cache", spy)
    path = str(tiny_model_dir)
    runs = _three_runs(run_lm_eval, path, path, lm_tasks, "int4", TASKS)
    _check(runs, "int4")
    # every log-likelihood request (9 choices, 1 text) and every generate call went through a cache
    # that received its tokens: 2 runs x (10 requests + at least 1 generate call)
    assert len(built) >= 2 * (10 + 1)
    assert all(isinstance(c, KVQuantCache) and c.get_seq_length() > 20 for c in built)


@pytest.mark.slow
def test_embedded_model_none_reproduces_hf_and_int4_differs(lm_tasks, run_lm_eval):
    """The issue's check on the embedded SmolLM2 (weights dequantized from a 4-bit GGUF): ``hf`` loads
    the converted folder, ``kvquant`` the alias ``smollm2``; generation is checked on the tiny model."""
    from kvquant.models import ensure_embedded_copy

    folder = str(ensure_embedded_copy())
    runs = _three_runs(run_lm_eval, folder, "smollm2", lm_tasks, "int4", ["kvq_mc", "kvq_ppl"])
    _check(runs, "int4")


def test_kvquant_lm_eval_command_registers_the_model_then_runs_lm_eval(monkeypatch):
    """``kvquant-lm-eval ARGS`` is lm-eval's command line with ARGS and the model registered (lm-eval
    itself is not run here: its command line indexes every built-in task first, ~30 s)."""
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from kvquant.integrations import lm_eval_main

    seen = []
    monkeypatch.setattr(
        lm_eval.__main__, "cli_evaluate", lambda: seen.append((list(sys.argv), get_model("kvquant")))
    )
    monkeypatch.setattr(sys, "argv", ["kvquant-lm-eval"])
    lm_eval_main(["--model", "kvquant", "--tasks", "t"])
    assert seen == [(["kvquant-lm-eval", "--model", "kvquant", "--tasks", "t"], KVQuantLM)]
