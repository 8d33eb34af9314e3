"""Mechanisms of the quantized layer: quantize once, grow in place, copy / reorder / select rows
without a lossy round trip, sinks are each row's first real tokens, bytes are counted exactly."""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.cache import QuantizedKVLayer
from kvquant.models import tiny_model

B, H, D = 2, 3, 16


def _layer(initial_capacity=4, **cfg):
    base = dict(key_format="int4", value_format="int4")
    return QuantizedKVLayer(KVQuantConfig(**{**base, **cfg}), initial_capacity=initial_capacity)


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _codes(layer, p0, p1):
    i0, i1 = p0 - layer.main.origin, p1 - layer.main.origin
    return layer.main.k_store.codes[:, :, i0:i1].clone(), layer.main.v_store.codes[:, :, i0:i1].clone()


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(key_format="int8", value_format="int2", sink_tokens=2, residual_length=3),
        dict(key_format="int2", key_axis="channel", key_group_size=4, residual_length=5),
        dict(key_format="fp8_e4m3", value_format="fp8_e5m2", rotation="hadamard"),
    ],
)
def test_old_codes_are_bit_identical_after_many_appends(cfg):
    layer = _layer(**cfg)
    layer.update(*_kv(9, 0))
    first_end = layer.store_end
    assert first_end > 0
    before = _codes(layer, 0, first_end)
    for step in range(70):  # several growths and, for the channel axis, many blocks
        layer.update(*_kv(1, step + 1))
    after = _codes(layer, 0, first_end)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert layer.seq_len == 79 and layer.main.k_store.capacity >= layer.store_end


def test_buffers_keep_data_ptr_between_growths():
    layer = _layer(initial_capacity=8)
    layer.update(*_kv(2, 0))
    growths = 0
    for step in range(40):
        cap = layer.main.k_store.capacity
        ptr = layer.main.k_store.codes.data_ptr()
        layer.update(*_kv(1, step))
        if layer.main.k_store.capacity == cap:
            assert layer.main.k_store.codes.data_ptr() == ptr  # written in place
        else:
            growths += 1
            assert layer.main.k_store.capacity >= 2 * cap  # geometric
    assert growths == 3 and layer.main.k_store.capacity == 64  # 42 tokens: 8 -> 16 -> 32 -> 64 slots


def test_history_is_stored_tokens_then_the_call_gets_its_own_fresh_tokens():
    layer = _layer(residual_length=0)
    k1, v1 = _kv(5, 0)
    k_out, _ = layer.update(k1, v1)
    assert torch.equal(k_out, k1)  # the call's own tokens come back in full precision
    k2, v2 = _kv(1, 1)
    k_out, v_out = layer.update(k2, v2)
    assert torch.equal(k_out[:, :, -1:], k2)
    assert not torch.equal(k_out[:, :, :5], k1)  # the history was quantized
    assert (k_out[:, :, :5] - k1).abs().max() < 0.5


def _filled(cfg="int4", batch=3):
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (batch, 13), generator=torch.Generator().manual_seed(0))
    cache = KVQuantCache(model.config, cfg, initial_capacity=4)
    model(input_ids=ids, cache=cache)
    model(input_ids=ids[:, :1], cache=cache)
    return model, cache


def _history(cache):
    return [tuple(t.clone() for t in layer.read_history()) for layer in cache.layers]


@pytest.mark.parametrize("preset", ["int4", "kivi2", "k8v4"])
def test_reorder_select_repeat_move_rows_exactly(preset):
    _, cache = _filled(preset)
    hist = _history(cache)
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    for (k, v), (k2, v2) in zip(hist, _history(cache), strict=True):
        assert torch.equal(k[idx], k2) and torch.equal(v[idx], v2)
    cache.batch_select_indices(torch.tensor([1, 2]))  # rows are now [0, 0] of the original
    for (k, _), (k2, _) in zip(hist, _history(cache), strict=True):
        assert torch.equal(k[[0, 0]], k2)
    cache.batch_repeat_interleave(2)
    for (k, _), (k2, _) in zip(hist, _history(cache), strict=True):
        assert torch.equal(k[[0, 0, 0, 0]], k2)
    assert cache.layers[0].batch_size == 4


def test_batch_ops_match_dynamic_cache_for_passthrough():
    model, cache = _filled("none")
    ids = torch.randint(3, 100, (3, 13), generator=torch.Generator().manual_seed(0))
    ref = DynamicCache(config=model.config)
    model(input_ids=ids, cache=ref)
    model(input_ids=ids[:, :1], cache=ref)
    for c in (cache, ref):
        c.batch_select_indices(torch.tensor([2, 0]))
        c.batch_repeat_interleave(3)
    for layer, ref_layer in zip(cache.layers, ref.layers, strict=True):
        k, v = layer.read_history()
        assert torch.equal(k, ref_layer.keys) and torch.equal(v, ref_layer.values)


@pytest.mark.parametrize("preset", ["int4", "kivi2"])
def test_deepcopy_continues_like_the_original(preset):
    model, cache = _filled(preset, batch=1)
    clone = copy.deepcopy(cache)
    nxt = torch.tensor([[5, 6, 7]])
    a = model(input_ids=nxt, cache=cache).logits
    b = model(input_ids=nxt, cache=clone).logits
    assert torch.equal(a, b)
    assert clone.layers[0].main.k_store.codes.data_ptr() != cache.layers[0].main.k_store.codes.data_ptr()


def test_multi_turn_generate_matches_an_uninterrupted_forward_loop():
    model = tiny_model("llama")
    prompt = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = KVQuantCache(model.config, "int4")
    out1 = model.generate(prompt, cache=cache, max_new_tokens=5, do_sample=False)
    turn2 = torch.cat([out1, torch.tensor([[11, 12, 13]])], dim=1)
    out2 = model.generate(
        turn2,
        cache=cache,
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # the same forward calls, by hand, on a fresh cache
    fresh = KVQuantCache(model.config, "int4")
    model(input_ids=prompt, cache=fresh)
    for t in range(prompt.shape[1], out1.shape[1] - 1):
        model(input_ids=out1[:, t : t + 1], cache=fresh)
    logits = [model(input_ids=turn2[:, out1.shape[1] - 1 :], cache=fresh).logits[:, -1]]
    seq = out2.sequences
    for t in range(turn2.shape[1], seq.shape[1] - 1):
        logits.append(model(input_ids=seq[:, t : t + 1], cache=fresh).logits[:, -1])
    for got, want in zip(out2.logits, logits, strict=True):
        torch.testing.assert_close(
            got, want
        )  # fp32 tolerance: generate and a bare forward build masks differently


def test_sinks_are_each_rows_first_real_tokens_under_left_padding():
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    cfg = KVQuantConfig(key_format="int2", value_format="int2", sink_tokens=3)
    cache = KVQuantCache(model.config, cfg)
    ref = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for c in (cache, ref):
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=c)
    layer, ref_layer = cache.layers[1], ref.layers[1]
    assert layer.pads.tolist() == [4, 0]
    torch.testing.assert_close(layer.sinks.k[0], ref_layer.keys[0, :, 4:7], rtol=0, atol=0)
    torch.testing.assert_close(layer.sinks.k[1], ref_layer.keys[1, :, 0:3], rtol=0, atol=0)
    k, _ = layer.read_history()  # the sink positions come back in full precision, the rest quantized
    assert torch.equal(k[0, :, 4:7], ref_layer.keys[0, :, 4:7]) and torch.equal(
        k[1, :, :3], ref_layer.keys[1, :, :3]
    )
    assert not torch.equal(k[1, :, 3:], ref_layer.keys[1, :, 3:])


def test_sliding_layers_hold_only_the_window():
    model = tiny_model("gemma3")
    cache = KVQuantCache(model.config, "int4", initial_capacity=4)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, cache=cache)
    for t in range(20):
        model(input_ids=ids[:, t : t + 1], cache=cache)
    for layer in cache.layers:
        if layer.is_sliding:
            assert layer.get_seq_length() == 60
            assert layer.held_tokens() <= layer.sliding_window - 1 + layer.config.residual_length + 1
            assert layer.main.k_store.capacity <= 64  # compaction reuses the buffer instead of growing
        else:
            assert layer.held_tokens() == 60


def test_nbytes_counts_codes_scales_zeros_tail_and_sinks_exactly():
    layer = _layer(sink_tokens=2, residual_length=3, key_group_size=8, value_group_size=16)
    layer.update(*_kv(20, 0))
    parts = layer.nbytes()
    stored = 20 - 3
    # int4 codes D/2 bytes; K: 2 groups x (scale + zero) fp16; V: 1 group x (scale + zero) fp16
    assert parts["store"] == B * H * stored * ((D // 2 + 2 * 2 * 2) + (D // 2 + 2 * 2))
    assert parts["tail"] == B * H * 3 * D * 4 * 2  # fp32 K and V
    assert parts["sink"] == B * H * 2 * D * 4 * 2
    assert layer.fp16_bytes() == B * H * 20 * D * 2 * 2


def test_crop_rules():
    layer = _layer(residual_length=2)
    layer.update(*_kv(10, 0))
    with pytest.raises(ValueError, match="tokens_to_remove"):
        layer.crop(3)
    layer.crop(0)
    assert layer.seq_len == 10
    layer.crop(-5)  # reaches into the store: token axis just forgets the positions
    assert layer.seq_len == 5 and layer.store_end == 5 and len(layer.tail) == 0
    k, _ = layer.update(*_kv(1, 1))
    assert k.shape[2] == 6


def test_channel_axis_crop_inside_a_block_keeps_the_kept_part_in_the_tail():
    layer = _layer(key_format="int4", key_axis="channel", key_group_size=4, residual_length=0)
    layer.update(*_kv(12, 0))
    assert layer.store_end == 12
    hist_before = layer.read_history()[0]
    layer.crop(-2)  # positions 10, 11 go; 8, 9 shared a block with them
    assert (layer.store_end, len(layer.tail), layer.seq_len) == (8, 2, 10)
    assert torch.equal(layer.read_history()[0], hist_before[:, :, :10])


def test_bad_presets_and_fields_raise_one_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="preset or YAML file 'int5'"):
        KVQuantCache(model.config, "int5")
    with pytest.raises(ValueError, match=r"key_format: invalid value 'int5'; allowed: none, int8"):
        KVQuantConfig(key_format="int5")
    with pytest.raises(ValueError, match=r"residual_length: invalid value -1"):
        KVQuantConfig(residual_length=-1)
    with pytest.raises(ValueError, match=r"layer_overrides\[0\]: invalid value 'bits'"):
        KVQuantConfig(layer_overrides={0: {"bits": 3}})
    with pytest.raises(ValueError, match="key_group_size"):
        KVQuantConfig(key_axis="channel")
