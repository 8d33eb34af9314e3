"""The ``evaluate`` metric shipped with kvquant: it loads offline by path and gives the harness's
numbers on the harness's own log-probs (both call :func:`kvquant.eval.quality.compare`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvquant.eval.context as context
from kvquant.eval import run_eval
from kvquant.eval.corpus import ByteTokenizer
from kvquant.integrations import CACHE_QUALITY_METRIC
from kvquant.models import tiny_model


@pytest.fixture(scope="module")
def metric():
    import evaluate

    assert Path(CACHE_QUALITY_METRIC).is_file()
    return evaluate.load(CACHE_QUALITY_METRIC)  # by path: no hub (the tests run with HF_HUB_OFFLINE=1)


def _rows(logprobs: torch.Tensor) -> list:
    return logprobs.reshape(-1, logprobs.shape[-1]).numpy()


def test_metric_equals_the_harness_records(tmp_path, metric, monkeypatch):
    seen = []  # (base, test, targets, result) of every compare the harness makes
    real = context.compare

    def recording(base, test, targets):
        out = real(base, test, targets)
        seen.append((base, test, targets, out))
        return out

    monkeypatch.setattr(context, "compare", recording)
    overrides = {
        "caches": ["dynamic", "int4", "nuq2"],
        "quality.prefix_len": 40,
        "quality.score_len": 12,
        "quality.windows": 2,
        "memory.enabled": False,
        "speed.enabled": False,
        "retrieval.enabled": False,
        "progress": False,
        "output.dir": str(tmp_path),
    }
    result = run_eval(overrides=overrides, model=tiny_model("llama"), tokenizer=ByteTokenizer())
    assert [r["quality"]["kl_mean"] for r in result.records] == [s[3]["kl_mean"] for s in seen]
    assert seen[-1][3]["kl_mean"] > 0  # nuq2 on the tiny model: a real difference to measure
    for (base, test, targets, harness), record in zip(seen, result.records, strict=True):
        got = metric.compute(predictions=_rows(test), references=_rows(base), targets=targets.reshape(-1))
        assert got == pytest.approx(harness, rel=1e-6, abs=1e-7), record["cache"]
        assert got["tokens"] == 2 * 12


def test_add_batch_accumulates_like_one_call(metric):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 10, 32, generator=g).log_softmax(-1)
    test = (base + 0.3 * torch.randn(1, 10, 32, generator=g)).log_softmax(-1)
    targets = torch.randint(0, 32, (10,), generator=g)
    whole = metric.compute(predictions=_rows(test), references=_rows(base), targets=targets)
    for lo, hi in ((0, 4), (4, 10)):
        metric.add_batch(
            predictions=_rows(test[:, lo:hi]), references=_rows(base[:, lo:hi]), targets=targets[lo:hi]
        )
    assert metric.compute() == pytest.approx(whole, rel=1e-6)
    assert whole["kl_mean"] > 0 and whole["top1_agreement"] < 1


def test_rows_of_different_sizes_are_refused(metric):
    with pytest.raises(ValueError, match="one vocabulary-sized row per position"):
        metric.compute(predictions=[[0.0, -1.0]], references=[[0.0, -1.0, -2.0]], targets=[0])
