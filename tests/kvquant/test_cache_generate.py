"""KVQuantCache inside `generate`: the pass-through preset is token-exact against DynamicCache, and
every preset runs every decoding mode on tiny random models of several families."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.config import preset_names
from kvquant.models import tiny_model

FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gemma3"]

# pass-through configs that still exercise sinks, the residual tail, channel blocks and growth
PASSTHROUGH = {
    "plain": dict(key_format="none", value_format="none"),
    "sink-residual": dict(key_format="none", value_format="none", sink_tokens=3, residual_length=5),
    # longer than the prompt: the first flushes happen while the whole history is still in the tail
    "long-residual": dict(key_format="none", value_format="none", residual_length=16),
    "blocks": dict(
        key_format="none",
        value_format="none",
        key_axis="channel",
        key_group_size=4,
        sink_tokens=2,
        residual_length=3,
    ),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param, seed=0)


def _prompt(model, batch=1, length=11, pad_first=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if pad_first:
        ids[0, :pad_first] = 0
        mask[0, :pad_first] = 0
    return ids, mask


def _generate(model, cache, ids, mask, **kw):
    kw = dict(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw.setdefault("min_new_tokens", kw["max_new_tokens"])  # no early stop on a random EOS
        return model.generate(input_ids=ids, attention_mask=mask, cache=cache, pad_token_id=0, **kw)


MODES = {
    "greedy": dict(do_sample=False, max_new_tokens=24),
    "beam": dict(do_sample=False, num_beams=3, max_new_tokens=12),
    "batch-left-pad": dict(do_sample=False, max_new_tokens=20),
}


@pytest.mark.parametrize("setting", list(PASSTHROUGH))
@pytest.mark.parametrize("mode", list(MODES))
def test_passthrough_generates_exactly_dynamic_cache_tokens(family_model, setting, mode):
    family, model = family_model
    batch, pad = (3, 4) if mode == "batch-left-pad" else (1, 0)
    ids, mask = _prompt(model, batch=batch, pad_first=pad)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **MODES[mode])
    cache = KVQuantCache(model.config, PASSTHROUGH[setting], initial_capacity=2)
    out = _generate(model, cache, ids, mask, **MODES[mode])
    assert torch.equal(out, ref), f"{family}/{setting}/{mode}"
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is never fed back


@pytest.mark.parametrize("setting", list(PASSTHROUGH))
def test_passthrough_assisted_decoding_crops_exactly(family_model, setting):
    family, model = family_model
    assistant = tiny_model(family, seed=1)  # a different model: many drafts get rejected and cropped
    ids, mask = _prompt(model)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, do_sample=False, max_new_tokens=24)
    cache = KVQuantCache(model.config, PASSTHROUGH[setting], initial_capacity=2)
    crops = []
    original = KVQuantCache.crop

    def spy(self, n):
        crops.append(n)
        return original(self, n)

    KVQuantCache.crop = spy
    try:
        out = _generate(
            model, cache, ids, mask, do_sample=False, max_new_tokens=24, assistant_model=assistant
        )
    finally:
        KVQuantCache.crop = original
    assert torch.equal(out, ref)
    assert any(n < 0 for n in crops), "assisted decoding never cropped: the test did not exercise crop"


@pytest.mark.parametrize("preset", [p for p in preset_names() if p != "none"])
def test_every_preset_runs_every_decoding_mode(family_model, preset):
    family, model = family_model
    ids, mask = _prompt(model)
    for mode, kw in {**MODES, "sample": dict(do_sample=True, top_k=20, max_new_tokens=16)}.items():
        batch, pad = (3, 4) if mode == "batch-left-pad" else (1, 0)
        ids, mask = _prompt(model, batch=batch, pad_first=pad)
        torch.manual_seed(0)
        cache = KVQuantCache(model.config, preset, initial_capacity=4)
        out = _generate(model, cache, ids, mask, **kw)
        assert out.shape[1] == ids.shape[1] + kw["max_new_tokens"], (family, preset, mode)
        assert cache.get_seq_length() == out.shape[1] - 1
        assert 0 < cache.nbytes() <= cache.reserved_bytes()
    assistant = tiny_model(family, seed=1)
    ids, mask = _prompt(model)
    cache = KVQuantCache(model.config, preset, initial_capacity=4)
    out = _generate(model, cache, ids, mask, do_sample=False, max_new_tokens=12, assistant_model=assistant)
    assert out.shape[1] == ids.shape[1] + 12


def test_cache_declares_itself_croppable_and_reports_layers(family_model):
    family, model = family_model
    cache = KVQuantCache(model, "int4")  # the model itself is accepted too
    assert cache.is_croppable
    ref = DynamicCache(config=model.config)
    assert cache.is_sliding == ref.is_sliding
    assert len(cache.layers) == len(ref.layers)


def test_layer_overrides_apply_per_layer():
    model = tiny_model("llama")
    n = model.config.num_hidden_layers
    cfg = KVQuantConfig(
        key_format="int4",
        value_format="int4",
        layer_overrides={0: {"key_format": "int8"}, -1: {"value_format": "int8"}},
    )
    cache = KVQuantCache(model.config, cfg)
    formats = [(layer.config.key_format, layer.config.value_format) for layer in cache.layers]
    assert formats[0] == ("int8", "int4") and formats[-1] == ("int4", "int8")
    assert all(f == ("int4", "int4") for f in formats[1 : n - 1])


def test_generate_still_accepts_past_key_values():
    model = tiny_model("llama")
    ids, mask = _prompt(model)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, do_sample=False, max_new_tokens=8)
    cache = KVQuantCache(model.config, "none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1  # our cache object was the one used
