"""Fixtures of the tests on the embedded SmolLM2-135M-Instruct (each test file loads it once)."""

import pytest

from kvquant.eval.config import CorpusSection, EvalError
from kvquant.eval.corpus import load_corpus
from kvquant.models import load_model


def _test_text() -> str:
    """WikiText-2 (``$KVQUANT_WIKITEXT2``, else the hub through ``datasets``), else the embedded corpus:
    the tests hold on either; a fresh clone with no data beside it runs them on the embedded one."""
    try:
        return load_corpus(CorpusSection(name="wikitext2")).text
    except EvalError:
        return load_corpus(CorpusSection(name="embedded")).text


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)``: the embedded model, fp32, loaded once per test file."""
    return load_model()


@pytest.fixture(scope="module")
def wikitext_ids(smollm2):
    """``[1, N]`` token ids of the first 40,000 characters of the test text."""
    _, tok = smollm2
    return tok(_test_text()[:40_000], return_tensors="pt").input_ids
