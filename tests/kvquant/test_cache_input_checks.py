"""Bad input to ``KVQuantCache`` gets one clear error naming the field, when it comes in, and leaves
the cache as it was: wrong shapes, dtypes, devices or layer index at ``update``, a wrong-length beam
index, NaN / Inf as they enter (not when they leave the residual window), and construction
arguments (``fused``, ``layer_overrides`` of a layer that does not exist, static scales of the
wrong head count). A huge ``residual_length`` / ``recent_length`` grows as tokens come in instead
of allocating up front.
"""

from __future__ import annotations

import pytest
import torch

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.models import tiny_config

CFG = tiny_config("llama")  # 2 layers, 2 KV heads, head_dim 16


def _kv(b=1, h=2, n=3, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g).to(dtype), torch.randn(b, h, n, d, generator=g).to(dtype)


@pytest.mark.parametrize(
    ("k", "v", "error", "message"),
    [
        (torch.zeros(2, 3, 16), torch.zeros(2, 3, 16), ValueError, r"key_states: expected \[batch, kv_heads"),
        (
            torch.zeros(1, 2, 3, 16, dtype=torch.int64),
            torch.zeros(1, 2, 3, 16),
            TypeError,
            "dtype int64; allowed",
        ),
        (torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16), ValueError, "at least one token, got 0"),
        (torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 4, 16), ValueError, "does not match key_states"),
        (
            torch.zeros(1, 2, 3, 16),
            torch.zeros(1, 2, 3, 16, dtype=torch.float16),
            ValueError,
            "does not match",
        ),
        ([[0.0]], torch.zeros(1, 2, 3, 16), TypeError, "key_states: expected a torch.Tensor"),
    ],
)
def test_a_bad_first_update_is_refused(k, v, error, message):
    cache = KVQuantCache(CFG, "int4")
    with pytest.raises(error, match=message):
        cache.update(k, v, 0)
    assert cache.get_seq_length(0) == 0
    cache.update(*_kv(), 0)  # and the cache still works
    assert cache.get_seq_length(0) == 3


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(b=2), "batch 2 but this layer holds 1"),
        (dict(h=3), "kv_heads 3 but this layer holds 2"),
        (dict(d=32), "head_dim 32 but this layer holds 16"),
        (dict(dtype=torch.bfloat16), "dtype torch.bfloat16 but this layer holds torch.float32"),
    ],
)
def test_a_later_update_must_match_the_first(kw, message):
    cache = KVQuantCache(CFG, "int4")
    cache.update(*_kv(), 0)
    with pytest.raises(ValueError, match=message):
        cache.update(*_kv(n=1, **kw), 0)
    assert cache.get_seq_length(0) == 3


def test_keys_and_values_of_different_widths_are_stored_each_at_its_own():
    # a latent cache (DeepSeek MLA): the compressed KV as keys, the RoPE key part as values
    cache = KVQuantCache(CFG, "int8")
    k, v = torch.randn(1, 1, 5, 32), torch.randn(1, 1, 5, 8)
    hk, hv = cache.update(k, v, 0)
    assert hk.shape == (1, 1, 5, 32) and hv.shape == (1, 1, 5, 8)
    hk, hv = cache.update(torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 8), 0)
    assert torch.allclose(hk[:, :, :5], k, atol=0.05) and torch.allclose(hv[:, :, :5], v, atol=0.05)
    with pytest.raises(ValueError, match="value_states: head_dim 16 but this layer holds 8"):
        cache.update(torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 16), 0)


@pytest.mark.parametrize("layer_idx", [2, -1, 7, "0", True])
def test_layer_idx_outside_the_model_is_refused(layer_idx):
    with pytest.raises(ValueError, match=r"layer_idx: expected 0 \.\. 1"):
        KVQuantCache(CFG, "int4").update(*_kv(), layer_idx)


def test_beam_index_of_the_wrong_length_is_refused():
    cache = KVQuantCache(CFG, "int4")
    cache.update(*_kv(b=3), 0)
    with pytest.raises(ValueError, match=r"beam_idx: expected one index per cached row \(3\)"):
        cache.reorder_cache(torch.tensor([0, 1]))
    cache.reorder_cache(torch.tensor([2, 2, 0]))  # the right length works


@pytest.mark.parametrize("preset", ["int4", "nuq4", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_states_are_refused_as_they_enter(preset, bad):
    cfg = KVQuantConfig.resolve(preset)
    cache = KVQuantCache(CFG, {**cfg.to_dict(), "residual_length": 64})  # they would sit in the tail
    cache.update(*_kv(n=5), 0)
    k, v = _kv(n=1, seed=1)
    v[0, 1, 0, 7] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.update(k, v, 0)
    assert cache.get_seq_length(0) == 5


def test_construction_arguments_are_checked():
    with pytest.raises(TypeError, match="fused: expected True, False or None, got 'yes'"):
        KVQuantCache(CFG, "int4", fused="yes")
    with pytest.raises(ValueError, match="initial_capacity: expected an integer >= 1"):
        KVQuantCache(CFG, "int4", initial_capacity=0)
    over = {**KVQuantConfig.resolve("int4").to_dict(), "layer_overrides": {5: {"key_format": "int8"}}}
    with pytest.raises(ValueError, match=r"layer_overrides: layer 5 does not exist; the model has 2 layers"):
        KVQuantCache(CFG, over)
    over["layer_overrides"] = {-2: {"key_format": "int8"}}  # negative indices count from the end
    assert KVQuantCache(CFG, over).layers[0].config.key_format == "int8"


@pytest.mark.parametrize("shape", [(2, 3), (3, 2), (2,)])
def test_static_scales_of_the_wrong_shape_are_refused_at_construction(tmp_path, shape):
    path = tmp_path / "scales.pt"
    torch.save({"keys": torch.ones(shape), "values": torch.ones(2, 2)}, path)
    cfg = dict(key_format="int8", value_format="int8", static_scales=str(path))
    with pytest.raises(
        ValueError, match=r"static_scales: keys of shape .* needs \[layers, kv_heads\] = \[2, 2\]"
    ):
        KVQuantCache(CFG, cfg)


def test_a_huge_residual_or_recent_window_grows_as_tokens_come():
    cfg = dict(key_format="int4", value_format="int4", residual_length=10**9)
    cache = KVQuantCache(CFG, cfg)
    k, v = _kv(n=40)
    out_k, out_v = cache.update(k, v, 0)
    for i in range(3):  # decode steps: everything stays in the full-precision tail
        k1, v1 = _kv(n=1, seed=i + 1)
        out_k, out_v = cache.update(k1, v1, 0)
        k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    assert cache.reserved_bytes() < 1e6
    recent = dict(key_format="nuq2", value_format="nuq2", recent_length=10**9, residual_length=2)
    cache = KVQuantCache(CFG, {**recent, "recent_key_format": "int8", "recent_value_format": "int8"})
    cache.update(*_kv(n=40), 0)
    for i in range(5):
        cache.update(*_kv(n=1, seed=i + 1), 0)
    assert cache.get_seq_length(0) == 45 and cache.reserved_bytes() < 1e6
