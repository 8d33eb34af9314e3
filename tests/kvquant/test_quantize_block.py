"""``quantize_block``: the full-precision tail hands tokens on in blocks, so decode quantizes only
every ``quantize_block`` steps; each token keeps the codes it gets with ``quantize_block=1``."""

import dataclasses

import pytest
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

import kvquant
from kvquant import KVQuantCache, KVQuantConfig
from kvquant.cache import QuantizedKVLayer
from kvquant.formats import dequantize, quantize
from kvquant.memory import model_cache_bytes
from kvquant.models import tiny_model

B, H, D = 2, 3, 16
BASE = dict(
    key_format="int2",
    value_format="int3",
    recent_key_format="int8",
    recent_value_format="int4",
    sink_tokens=2,
    residual_length=3,
    recent_length=5,
)


def _layer(block, **cfg):
    return QuantizedKVLayer(KVQuantConfig(**{**BASE, "quantize_block": block, **cfg}), initial_capacity=4)


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _qdq(x, fmt):
    return dequantize(quantize(x, fmt), fmt, head_dim=x.shape[-1])


def _main_codes(layer, p1):
    i1 = p1 - layer.main.origin
    return layer.main.k_store.codes[:, :, :i1], layer.main.v_store.codes[:, :, :i1]


def test_field_is_validated():
    with pytest.raises(ValueError, match="quantize_block: invalid value 0; allowed: an integer >= 1"):
        KVQuantConfig(quantize_block=0)
    with pytest.raises(ValueError, match="quantize_block: invalid value 4; allowed: 1 when key_axis"):
        KVQuantConfig(key_format="int2", key_axis="channel", key_group_size=8, quantize_block=4)
    with pytest.raises(ValueError, match="quantize_block"):  # in a layer override too
        KVQuantConfig(layer_overrides={1: {"quantize_block": True}})


@pytest.mark.parametrize("chunks", [[9] + [1] * 23, [1] * 20, [6, 1, 1, 7] + [1] * 20])
def test_tail_holds_residual_plus_a_partial_block_and_codes_equal_block_1(chunks):
    blk, r, w = 4, BASE["residual_length"], BASE["recent_length"]
    layer, ref = _layer(blk), _layer(1)
    ks, vs, quantize_steps = [], [], 0
    for i, n in enumerate(chunks):
        k, v = _kv(n, i)
        ks.append(k)
        vs.append(v)
        end_before = layer.store_end
        layer.update(k, v)
        ref.update(k, v)
        if n == 1 and layer.store_end != end_before:
            quantize_steps += 1
            assert layer.store_end - end_before == blk  # a whole block leaves the tail at once
        if layer.seq_len >= r + blk:
            assert r <= len(layer.tail) <= r + blk - 1
        assert layer.store_end + len(layer.tail) == layer.seq_len
    singles = sum(n == 1 for n in chunks)
    assert quantize_steps <= singles // blk + 1 and quantize_steps >= 1  # not every step
    k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)

    # Oldest first: the main store holds the codes block 1 gives the tokens that took the same path
    # (one-token steps through the recent window; at a prompt the tiers split it differently) ...
    end = layer.main.end
    p = sum(chunks[: max(i for i, n in enumerate(chunks) if n > 1) + 1]) if max(chunks) > 1 else 0
    assert end > p + 4
    got, want = _main_codes(layer, end), _main_codes(ref, end)
    assert torch.equal(got[0][:, :, p:], want[0][:, :, p:]) and torch.equal(
        got[1][:, :, p:], want[1][:, :, p:]
    )
    # ... the recent window the finer format of the tokens themselves, the tail the tokens.
    hist_k, hist_v = layer.read_history()
    rec = slice(end, layer.store_end)
    assert layer.store_end - end == w
    assert torch.equal(hist_k[:, :, rec], _qdq(k_all[:, :, rec], "int8"))
    assert torch.equal(hist_v[:, :, rec], _qdq(v_all[:, :, rec], "int4"))
    tail = slice(layer.store_end, layer.seq_len)
    assert torch.equal(hist_k[:, :, tail], k_all[:, :, tail])
    assert torch.equal(hist_v[:, :, tail], v_all[:, :, tail])


def test_crop_inside_the_store_then_decode_matches_a_fresh_layer():
    layer = _layer(4)
    k, v = _kv(30, 0)
    layer.update(k, v)
    for s in range(6):
        layer.update(*_kv(1, 100 + s))
    store_end = layer.store_end
    layer.crop(-(layer.seq_len - (store_end - 2)))  # into the stored tokens: they are simply forgotten
    assert layer.seq_len == layer.store_end == store_end - 2 and len(layer.tail) == 0
    hist_before = layer.read_history()
    for s in range(7):  # the tail fills again and hands on one block
        layer.update(*_kv(1, 200 + s))
    assert layer.store_end == store_end - 2 + 4 and len(layer.tail) == 3
    hist_after = layer.read_history()
    n = hist_before[0].shape[2] - BASE["recent_length"]  # (tokens in the window since moved to main)
    assert torch.equal(hist_after[0][:, :, :n], hist_before[0][:, :, :n])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_predicted_bytes_equal_the_cache_at_every_step(family):
    model = tiny_model(family)
    cfg = KVQuantConfig(**{**BASE, "quantize_block": 8})
    cache = KVQuantCache(model.config, cfg, initial_capacity=4)
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    types, kwargs = get_layer_types_and_kwargs(model.config)
    windows = [kw.get("sliding_window") for kw in kwargs]
    head_dim = getattr(model.config, "head_dim", model.config.hidden_size // model.config.num_attention_heads)
    heads = model.config.num_key_value_heads
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        for t in range(21):
            model(input_ids=ids[:, t % 13 : t % 13 + 1], cache=cache)
            predicted = model_cache_bytes(cfg, types, windows, 14 + t, 2, heads, head_dim, 4)
            assert predicted == cache.nbytes(), 14 + t


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("preset", ["tcq2-recent", "nuq4"])
def test_fused_decode_matches_the_dequantizing_path_with_blocks(family, preset, greedy):
    model = tiny_model(family)
    default = model.config._attn_implementation
    cfg = dataclasses.replace(KVQuantConfig.from_preset(preset), quantize_block=4)
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # a left-padded row
    seq_ref, logits_ref = greedy(
        model, KVQuantCache(model.config, cfg, fused=False), ids, 14, mask, pad_token_id=0
    )
    kvquant.enable(model)
    try:
        seq, logits = greedy(model, KVQuantCache(model.config, cfg), ids, 14, mask, pad_token_id=0)
    finally:
        model.set_attn_implementation(default)
    assert ((logits - logits_ref).norm() / logits_ref.norm()).item() <= 1e-4
    assert torch.equal(seq, seq_ref)
