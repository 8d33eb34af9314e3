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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny):
    """A local folder holding the tiny llama and a character-level fast tokenizer (vocab < 128), so
    that the CLI can load it by path like any Hugging Face model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\t": 9, "\n": 10}
    vocab.update({chr(i): i for i in range(32, 127)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny.save_pretrained(path)
    fast.save_pretrained(path)
    return path
