"""Shared fixtures of the harness tests: a tiny random llama, its byte tokenizer, fast settings."""

from __future__ import annotations

import pytest

from kvquant.eval.corpus import ByteTokenizer
from kvquant.models import tiny_model

# Small enough that a full run_eval (quality, memory, speed, retrieval) takes about a second per cache.
FAST = {
    "quality.prefix_len": 48,
    "quality.score_len": 12,
    "quality.windows": 2,
    "retrieval.lengths": [360],
    "retrieval.trials": 1,
    "speed.context_lengths": [32],
    "speed.decode_tokens": 2,
    "speed.warmup": 0,
    "speed.repeats": 1,
    "progress": False,
}


@pytest.fixture
def fast() -> dict:
    """Overrides that keep a run_eval on the tiny model to about a second per cache."""
    return dict(FAST)


@pytest.fixture(scope="session")
def tiny():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def byte_tok():
    return ByteTokenizer()
