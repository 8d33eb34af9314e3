"""Shared pytest setup: `gpu`-marked tests are skipped without CUDA; without CUDA the Triton kernels
run under Triton's interpreter for the whole session (set here, before any test module can import
``kvquant.kernels``: Triton reads the variable when ``@triton.jit`` decorates the kernels). In a
pytest-xdist worker (``make test`` runs one per core) torch runs on one thread: workers that each
keep an OpenMP pool as wide as the machine oversubscribe its cores (README: the `make test` timings). Tests of the
threaded paths pass their thread counts explicitly."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _greedy(model, cache, ids, n: int = 16, mask=None, **kw):
    """``model.generate`` greedy for exactly ``n`` tokens through ``cache``: ``(sequences [B, T + n],
    logits [n, B, V])`` (transformers' warnings silenced)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    return out.sequences, torch.stack(out.logits)


@pytest.fixture
def greedy():
    """:func:`_greedy`: ``greedy(model, cache, ids, n=16, mask=None, **generate_kwargs)``."""
    return _greedy


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A local folder holding ``tiny_model("llama")`` and a character-level fast tokenizer (vocab <
    128), so that the CLI can load it by path like any Hugging Face model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvquant.models import tiny_model

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\t": 9, "\n": 10}
    vocab.update({chr(i): i for i in range(32, 127)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    fast.save_pretrained(path)
    return path
