"""Masks with holes under the `kvquant` attention: a decode step whose mask hides more than each row's
left padding (a hole in the middle, a hidden cached token) is answered like the dequantizing path;
multi-token calls honour their mask; assisted decoding gives the same tokens."""

import copy
import dataclasses
import types
import warnings

import pytest
import torch

import kvquant
import kvquant.attention as kva
from kvquant import KVQuantCache, KVQuantConfig
from kvquant.attention import decode_mask_is_fused, dense_attention, kvquant_attention_forward
from kvquant.cache import QuantizedKVLayer
from kvquant.cache.view import KVView
from kvquant.models import tiny_model

L, PAD = 28, 5  # prompt length; row 0's left padding
# a trellis preset with a short recent window, so that the holes below land in the main trellis store,
# the recent window, the sinks and the tail
PRESETS = {
    "int4": "int4",
    "tcq3v2-recent": dataclasses.replace(KVQuantConfig.resolve("tcq3v2-recent"), recent_length=8),
}
# call index -> {row: positions hidden from that call on}; call 0 is the prompt
HOLES = {4: {1: [10]}, 6: {0: [PAD + 3, 14], 1: [2]}, 9: {2: [20, 33]}}
CHUNK_AT, RESTORE_AT, CALLS = 8, 12, 15  # a 3-token call; every hole removed again; number of calls


def _schedule(batch=3, seed=0, holes=True):
    """Teacher-forced calls: ``[(ids [B, q], mask [B, n], position_ids [B, q])]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, L + CALLS + 2), generator=gen)
    ids[0, :PAD] = 0
    pos = (torch.arange(ids.shape[1]) - torch.tensor([PAD] + [0] * (batch - 1))[:, None]).clamp(min=0)
    hidden = torch.zeros_like(ids, dtype=torch.bool)
    hidden[0, :PAD] = True
    calls, n = [], L
    for i in range(CALLS):
        n0, n = n, (L if i == 0 else n + (3 if i == CHUNK_AT else 1))
        if holes and i in HOLES:
            for row, ps in HOLES[i].items():
                hidden[row, ps] = True
        if holes and i == RESTORE_AT:
            hidden[:], hidden[0, :PAD] = False, True
        lo = 0 if i == 0 else n0
        calls.append((ids[:, lo:n], (~hidden[:, :n]).long(), pos[:, lo:n]))
    return calls


def _logits(model, preset, fused, calls):
    cache = KVQuantCache(model.config, preset, fused=fused, initial_capacity=4)
    out = []
    with torch.no_grad():
        for ids, mask, pos in calls:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache).logits
            out.append(logits[:, -1])  # [B, V]
    return torch.stack(out)  # [calls, B, V]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_with_holes_matches_the_dequantizing_path(family, preset, monkeypatch):
    model = tiny_model(family)
    default = model.config._attn_implementation
    calls = _schedule()
    ref = _logits(model, PRESETS[preset], False, calls)
    no_holes = _logits(model, PRESETS[preset], False, _schedule(holes=False))
    kvquant.enable(model)
    fused_steps = []
    decode = kva._decode
    full = lambda view: view.hist_begin == 0  # noqa: E731  (a sliding layer's window moves on)
    monkeypatch.setattr(
        kva,
        "_decode",
        lambda view, *a: full(view) and fused_steps.append(view.seq_before) or decode(view, *a),
    )
    out = _logits(model, PRESETS[preset], None, calls)
    model.set_attn_implementation(default)
    for i in range(CALLS):
        assert _rel(out[i], ref[i]) <= 1e-4, (family, preset, i, _rel(out[i], ref[i]))
    # the holes change the answer (so the equality above says something) ...
    assert _rel(no_holes[min(HOLES)], ref[min(HOLES)]) > 1e-3
    assert _rel(no_holes[RESTORE_AT - 1], ref[RESTORE_AT - 1]) > 1e-3
    # ... and the full-attention layers' fused decode ran exactly on the decode steps without holes
    # (gemma3's sliding layers stay fused while the holes lie outside their window)
    seq = [L + i - 1 + (2 if i > CHUNK_AT else 0) for i in range(CALLS)]  # positions before call i
    want = {seq[i] for i in [*range(1, 4), *range(RESTORE_AT, CALLS)]}
    assert set(fused_steps) == want


def test_the_decision_is_taken_once_per_forward_and_mask(monkeypatch):
    model = kvquant.enable(tiny_model("gemma3"))  # sliding and full layers: two masks per forward
    calls = _schedule()[:4]
    seen = []
    attended = KVView.attended
    monkeypatch.setattr(KVView, "attended", lambda self: seen.append(self.seq_before) or attended(self))
    _logits(model, "int4", None, calls)
    assert len(seen) == 2 * 3  # 3 decode steps x 2 masks, not x 4 layers


def _layer_with_history(cfg, b=2, h=2, d=16, n=21, pads=(3, 0)):
    torch.manual_seed(0)
    layer = QuantizedKVLayer(KVQuantConfig(**cfg), initial_capacity=4)
    pos = (torch.arange(n)[None] - torch.tensor(pads)[:, None]).clamp(min=0)
    layer.update(torch.randn(b, h, n, d), torch.randn(b, h, n, d), kwargs={"position_ids": pos})
    return layer


CFGS = [
    dict(key_format="int4", value_format="int2", key_group_size=8, sink_tokens=2, residual_length=3),
    dict(key_format="int2", value_format="int4", key_axis="channel", key_group_size=4, value_group_size=8),
]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("additive", [False, True])
def test_a_direct_decode_call_honours_a_mask_with_holes(cfg, additive):
    layer = _layer_with_history(cfg)
    b, h, d, hq, n = 2, 2, 16, 6, 22
    k, v, q = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d), torch.randn(b, hq, 1, d)
    mask = (torch.arange(n)[None] >= torch.tensor([3, 0])[:, None])[:, None, None]  # [B, 1, 1, n]
    module = types.SimpleNamespace(num_key_value_groups=hq // h, is_causal=True)
    for holes in ([], [1], [4, 19]):
        mask_h = mask.clone()
        mask_h[1, ..., holes] = False  # the quantized store, a sink, the tail
        if additive:
            mask_h = torch.zeros(mask_h.shape).masked_fill(~mask_h, torch.finfo(torch.float32).min)
        twin = copy.deepcopy(layer)
        keys, values = twin.update(k, v)
        ref, _ = dense_attention(q, keys, values, mask_h, 0.3)
        twin = copy.deepcopy(layer)
        twin.return_view = True
        view, _ = twin.update(k, v)
        assert decode_mask_is_fused(view, mask_h) == (not holes)
        out, _ = kvquant_attention_forward(module, q, view, view, mask_h, scaling=0.3)
        torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-5)


def test_a_bias_that_is_not_a_mask_goes_to_the_dequantizing_path():
    layer = _layer_with_history(CFGS[0], pads=(0, 0))
    layer.return_view = True
    view, _ = layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    assert decode_mask_is_fused(view, torch.zeros(2, 1, 1, 22))
    assert not decode_mask_is_fused(view, torch.full((2, 1, 1, 22), -1.0))
    assert not decode_mask_is_fused(view, torch.zeros(2, 1, 1, 23))  # a shape the view does not have


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_chunk_without_mask_after_cached_tokens_is_lower_right_causal(softcap):
    layer = _layer_with_history(CFGS[0], pads=(0, 0))
    b, h, d, hq = 2, 2, 16, 6
    k, v, q = torch.randn(b, h, 3, d), torch.randn(b, h, 3, d), torch.randn(b, hq, 3, d)
    twin = copy.deepcopy(layer)
    keys, values = twin.update(k, v)
    causal = torch.ones(3, 24, dtype=torch.bool).tril(21)
    ref, _ = dense_attention(q, keys, values, causal, 0.3, softcap)
    layer.return_view = True
    view, _ = layer.update(k, v)
    module = types.SimpleNamespace(num_key_value_groups=hq // h, is_causal=True)
    out, _ = kvquant_attention_forward(module, q, view, view, None, scaling=0.3, softcap=softcap)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-5)


def _assisted(model, cache, ids, assistant=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(
            input_ids=ids,
            cache=cache,
            assistant_model=assistant,
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )


def test_assisted_decoding_gives_the_same_tokens():
    """Assisted decoding (transformers verifies the assistant's candidates in one multi-token call and
    crops the cache back by the rejected ones) with a KVQuantCache under the `kvquant` attention: the
    pass-through preset gives plain greedy decoding's tokens, int4 the dequantizing path's."""
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)  # a poor assistant: many crops
    default = model.config._attn_implementation
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = _assisted(model, None, ids)
    int4_ref = _assisted(model, KVQuantCache(model.config, "int4", fused=False), ids, assistant)
    kvquant.enable(model)
    assert torch.equal(_assisted(model, KVQuantCache(model.config, "none"), ids, assistant), plain)
    assert torch.equal(_assisted(model, KVQuantCache(model.config, "int4"), ids, assistant), int4_ref)
    model.set_attn_implementation(default)
