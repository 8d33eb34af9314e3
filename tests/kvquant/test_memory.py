"""Bytes from the config alone agree with what the cache really holds."""

import pytest
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.config import preset_names
from kvquant.memory import format_bytes_per_token, layer_bytes, model_cache_bytes
from kvquant.models import tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
@pytest.mark.parametrize("preset", preset_names())
@pytest.mark.parametrize("steps", [0, 1, 37])
def test_predicted_bytes_equal_cache_nbytes(family, preset, steps):
    model = tiny_model(family)
    cache = KVQuantCache(model, preset, initial_capacity=4)  # the model: retrieval layers probed
    ids = torch.randint(3, 100, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        for t in range(steps):
            model(input_ids=ids[:, t % 23 : t % 23 + 1], cache=cache)
    cfg = model.config
    types, kwargs = get_layer_types_and_kwargs(cfg)
    windows = [kw.get("sliding_window") for kw in kwargs]
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    predicted = model_cache_bytes(
        cache.quant_config, types, windows, 23 + steps, 2, cfg.num_key_value_heads, head_dim, 4
    )
    assert predicted == cache.nbytes()


def test_format_bytes_per_token_int4_and_kivi():
    int4 = KVQuantConfig(key_format="int4", value_format="int4")
    assert format_bytes_per_token(int4, heads=1, head_dim=64) == 2 * (32 + 2 + 2)
    kivi = KVQuantConfig(
        key_format="int2", value_format="int2", key_axis="channel", key_group_size=32, value_group_size=32
    )
    # K: 16 B codes + 64 channels x (scale + zero) fp16 per 32-token block; V: 16 B + 2 groups x 4 B
    assert format_bytes_per_token(kivi, heads=1, head_dim=64) == (16 + 64 * 4 / 32) + (16 + 2 * 4)


def test_bytes_depend_on_context_not_only_per_token():
    cfg = KVQuantConfig.resolve("kivi2")
    short = layer_bytes(cfg, 100, 1, 1, 64, 2)["total"] / 100
    long = layer_bytes(cfg, 10_000, 1, 1, 64, 2)["total"] / 10_000
    assert short > 2 * long  # the 128-token full-precision window dominates short contexts
