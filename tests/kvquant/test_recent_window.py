"""The recent window (``recent_length``): the newest stored tokens in finer formats, re-quantized
into the main formats when they age out. Layout, exact contents, crop, row ops, bytes, and that it
lowers the error where decoding looks."""

import pytest
import torch

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.cache import QuantizedKVLayer
from kvquant.formats import dequantize, quantize
from kvquant.memory import layer_bytes

B, H, D = 2, 3, 16


def _layer(**cfg):
    base = dict(key_format="int2", value_format="int2", recent_key_format="int8", recent_value_format="int8")
    return QuantizedKVLayer(KVQuantConfig(**{**base, **cfg}), initial_capacity=4)


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _qdq(x, fmt):
    return dequantize(quantize(x, fmt), fmt, head_dim=x.shape[-1])


def test_config_fields_are_validated():
    with pytest.raises(ValueError, match="recent_length: invalid value -1"):
        KVQuantConfig(recent_length=-1)
    with pytest.raises(ValueError, match="recent_key_format: invalid value 'none'"):
        KVQuantConfig(recent_length=4, recent_key_format="none")
    with pytest.raises(ValueError, match="recent_value_format: invalid value 'int5'"):
        KVQuantConfig(recent_value_format="int5")
    with pytest.raises(ValueError, match="recent_length: invalid value 4; allowed: 0 when key_axis"):
        KVQuantConfig(key_format="int2", key_axis="channel", key_group_size=8, recent_length=4)
    with pytest.raises(ValueError, match="recent_length: invalid value .x."):  # in an override too
        KVQuantConfig(layer_overrides={0: {"recent_length": "x"}})


@pytest.mark.parametrize("chunks", [[20], [3, 1, 1, 9, 1, 1, 1, 1, 1, 1], [5, 12, 3]])
def test_layout_and_exact_contents(chunks):
    w, r = 6, 2
    layer = _layer(residual_length=r, recent_length=w)
    ks, vs = [], []
    for i, n in enumerate(chunks):
        k, v = _kv(n, i)
        ks.append(k)
        vs.append(v)
        layer.update(k, v)
        assert layer.store_end == max(layer.seq_len - r, 0)
        assert layer.main.end == max(layer.store_end - w, 0)
    k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)
    hist_k, hist_v = layer.read_history()
    n = layer.seq_len
    # the recent window: the finer format of the tokens themselves
    rec = slice(layer.main.end, layer.store_end)
    assert torch.equal(hist_k[:, :, rec], _qdq(k_all[:, :, rec], "int8"))
    # the tail: exact
    assert torch.equal(hist_v[:, :, layer.store_end : n], v_all[:, :, layer.store_end : n])
    # older tokens: the main format, of the token itself (straight from the tail) or of its recent codes
    old = hist_k[:, :, : layer.main.end]
    direct = _qdq(k_all[:, :, : layer.main.end], "int2")
    via_recent = _qdq(_qdq(k_all[:, :, : layer.main.end], "int8"), "int2")
    per_token = [
        torch.equal(old[:, :, t], direct[:, :, t]) or torch.equal(old[:, :, t], via_recent[:, :, t])
        for t in range(layer.main.end)
    ]
    assert all(per_token)
    err_recent = (hist_k[:, :, rec] - k_all[:, :, rec]).abs().max()
    err_old = (old - k_all[:, :, : layer.main.end]).abs().max()
    assert err_recent < err_old / 10


def test_one_token_steps_requantize_from_the_recent_codes():
    layer = _layer(residual_length=0, recent_length=3)
    k, v = _kv(3, 0)
    layer.update(k, v)
    assert (layer.main.end, layer.store_end) == (0, 3)
    layer.update(*_kv(1, 1))  # position 0 leaves the window: re-quantized from its int8 codes
    assert (layer.main.end, layer.store_end) == (1, 4)
    hist_k, _ = layer.read_history()
    assert torch.equal(hist_k[:, :, :1], _qdq(_qdq(k[:, :, :1], "int8"), "int2"))
    assert torch.equal(hist_k[:, :, 1:3], _qdq(k[:, :, 1:3], "int8"))


def test_crop_into_the_window_and_the_main_store():
    layer = _layer(residual_length=1, recent_length=4)
    layer.update(*_kv(12, 0))  # main [0, 7), recent [7, 11), tail [11, 12)
    full = layer.read_history()[0]
    layer.crop(-3)  # into the recent window
    assert (layer.seq_len, layer.main.end, layer.store_end) == (9, 7, 9)
    assert torch.equal(layer.read_history()[0], full[:, :, :9])
    layer.crop(-4)  # into the main store
    assert (layer.seq_len, layer.main.end, layer.store_end) == (5, 5, 5)
    assert torch.equal(layer.read_history()[0], full[:, :, :5])
    k, _ = layer.update(*_kv(1, 1))
    assert k.shape[2] == 6 and torch.equal(k[:, :, :5], full[:, :, :5])


def test_row_ops_and_bytes():
    layer = _layer(residual_length=2, recent_length=5, sink_tokens=1)
    layer.update(*_kv(11, 0))
    for step in range(3):
        layer.update(*_kv(1, step + 1))
    hist = layer.read_history()[0]
    idx = torch.tensor([1, 0])
    layer.reorder_cache(idx)
    assert torch.equal(layer.read_history()[0], hist[idx])
    # bytes: 7 main tokens in int2, 5 recent ones in int8, 2 fp32 tail tokens, 1 fp32 sink
    parts = layer.nbytes()
    int2 = D // 4 + 2 * 2  # codes + fp16 scale and zero point
    int8 = D + 2  # codes + fp16 scale
    assert parts["store"] == B * H * (7 * int2 + 5 * int8) * 2
    assert parts["tail"] == B * H * 2 * D * 4 * 2 and parts["sink"] == B * H * 1 * D * 4 * 2
    predicted = layer_bytes(layer.config, 14, B, H, D, 4)
    assert predicted["store"] == parts["store"] and predicted["total"] == sum(parts.values())


def test_recent_window_lowers_the_decode_error():
    from transformers import DynamicCache

    from kvquant.eval.decode import teacher_forced_logprobs
    from kvquant.eval.quality import compare
    from kvquant.models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, 100, (2, 72), generator=torch.Generator().manual_seed(5))
    base = teacher_forced_logprobs(model, ids, 40, DynamicCache(config=model.config))

    def kl(**cfg):
        c = KVQuantConfig(
            key_format="nuq2", value_format="nuq2", rotation="hadamard", residual_length=2, **cfg
        )
        return compare(
            base, teacher_forced_logprobs(model, ids, 40, KVQuantCache(model.config, c)), ids[:, 40:]
        )["kl_mean"]

    plain = kl()
    assert kl(recent_length=16) < 0.8 * plain
    assert kl(recent_length=16, recent_key_format="nuq3", recent_value_format="nuq3") < plain
