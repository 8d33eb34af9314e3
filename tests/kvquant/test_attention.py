"""The `kvquant` attention: same results as the dequantizing path on the same cache contents, the
CPU decode path matches the reference, and a decode step allocates less than the history."""

import copy
import types

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import kvquant
from kvquant import KVQuantCache, KVQuantConfig
from kvquant.attention import dense_attention, kvquant_attention_forward
from kvquant.cache import QuantizedKVLayer
from kvquant.config import preset_names
from kvquant.models import tiny_model

FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gemma3"]


def test_import_registers_attention_and_mask_functions():
    assert AttentionInterface._global_mapping["kvquant"] is kvquant_attention_forward
    assert "kvquant" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_path_matches_dequantizing_path_on_every_preset(family, greedy):
    model = tiny_model(family)
    default = model.config._attn_implementation
    ids = torch.randint(3, 100, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # a left-padded row
    for preset in preset_names():
        model.set_attn_implementation(default)
        dequantized = KVQuantCache(model.config, preset, fused=False, initial_capacity=4)
        seq_ref, logits_ref = greedy(model, dequantized, ids, 16, mask, pad_token_id=0)
        kvquant.enable(model)
        fused = KVQuantCache(model.config, preset, initial_capacity=4)
        seq, logits = greedy(model, fused, ids, 16, mask, pad_token_id=0)
        rel = ((logits - logits_ref).norm() / logits_ref.norm()).item()
        assert rel <= 1e-4, (family, preset, rel)
        assert torch.equal(seq, seq_ref), (family, preset)
    model.set_attn_implementation(default)


def test_views_only_under_the_kvquant_attention():
    model = tiny_model("llama")
    cache = KVQuantCache(model.config, "int4")
    assert not cache.uses_views()
    kvquant.enable(model)
    assert cache.uses_views()  # the cache reads the model's (shared) config at every call
    model.set_attn_implementation("sdpa")
    assert not cache.uses_views()


@pytest.mark.parametrize(
    "cfg",
    [
        dict(key_format="int4", value_format="int2", key_group_size=8, sink_tokens=2, residual_length=3),
        dict(
            key_format="int2", value_format="int4", key_axis="channel", key_group_size=4, value_group_size=8
        ),
        dict(key_format="fp8_e5m2", value_format="int8", rotation="hadamard"),
        dict(key_format="none", value_format="none", sink_tokens=1, residual_length=2),
    ],
)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_decode_step_matches_dense_attention_over_dequantized_history(cfg, softcap):
    torch.manual_seed(0)
    b, h, d, hq = 2, 2, 16, 6  # GQA ratio 3
    layer = QuantizedKVLayer(KVQuantConfig(**cfg), initial_capacity=4)
    layer.update(torch.randn(b, h, 21, d), torch.randn(b, h, 21, d))
    for _ in range(9):
        k, v, q = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d), torch.randn(b, hq, 1, d)
        twin = copy.deepcopy(layer)
        keys, values = layer.update(k, v)
        ref, _ = dense_attention(q, keys, values, None, 0.3, softcap)
        twin.return_view = True
        view, _ = twin.update(k, v)
        out, _ = kvquant_attention_forward(None, q, view, view, None, scaling=0.3, softcap=softcap)
        torch.testing.assert_close(out.transpose(1, 2).float(), ref, rtol=1e-5, atol=1e-5)


def test_decode_step_allocates_less_than_a_full_precision_history():
    """Profiler: the largest allocation inside a fused decode step stays below one full-precision
    copy of the history (K alone), while the dequantizing path allocates at least that much."""
    torch.manual_seed(0)
    b, h, d, n = 1, 2, 64, 8192
    cfg = KVQuantConfig(key_format="int4", value_format="int4")
    layer = QuantizedKVLayer(cfg, initial_capacity=n + 64)
    layer.update(torch.randn(b, h, n, d), torch.randn(b, h, n, d))
    history_bytes = b * h * n * d * 4  # fp32 K of the whole history
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)

    def largest_single(fused):
        twin = copy.deepcopy(layer)
        twin.return_view = fused
        q, k, v = torch.randn(b, 2 * h, 1, d), torch.randn(b, h, 1, d), torch.randn(b, h, 1, d)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            keys, values = twin.update(k, v)
            kvquant_attention_forward(module, q, keys, values, None, scaling=0.125)
        return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)

    assert largest_single(True) < history_bytes
    assert largest_single(False) >= history_bytes


def test_decode_steps_reuse_one_plan_until_a_tier_moves():
    """The decode plans its kernel call once per tier buffers: the same plan step after step, a new
    one once the store moved to new buffers (it grew); the step that moved it keeps none, so that
    nothing holds the old buffers past that step."""
    import weakref

    layer = QuantizedKVLayer(KVQuantConfig.resolve("int4"), initial_capacity=8)
    layer.return_view = True
    torch.manual_seed(0)
    layer.update(torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64))
    q = torch.randn(1, 4, 1, 64)
    last_run, last_cap, grows = None, None, 0
    for _ in range(60):
        view, same = layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
        kvquant_attention_forward(None, q, view, view, None, scaling=0.125)
        cap = view.reads[0].k.codes.shape[2]
        if layer.main.k_store.capacity != cap:  # this step's append moved the store
            assert "run" not in layer.plans
            old_codes = weakref.ref(view.reads[0].k.codes)
            del view, same
            last_run = last_cap = run = None  # (the test's own references to the last plan)
            assert old_codes() is None
            grows += 1
            continue
        run = layer.plans["run"]
        assert (run is last_run) == (cap == last_cap)
        last_run, last_cap = run, cap
    assert grows >= 2
