"""What a model's attention takes beyond q, k, v and the mask is honoured by the ``kvquant``
attention: gpt-oss's learned attention sinks (``s_aux``), on the prefill, the fused decode and the
dequantizing path, against the model's own eager attention."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GptOssConfig

import kvquant
from kvquant import KVQuantCache


def _gpt_oss() -> torch.nn.Module:
    cfg = GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        for layer in model.model.layers:  # sinks large enough to matter (init leaves them small)
            layer.self_attn.sinks.data = torch.randn(4) * 2
    return model.eval()


def test_gpt_oss_sinks_are_honoured(greedy):
    model = _gpt_oss()
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    seq_ref, logits_ref = greedy(model, DynamicCache(config=model.config), ids, 8, pad_token_id=0)
    kvquant.enable(model)
    seq, logits = greedy(model, KVQuantCache(model.config, "none"), ids, 8, pad_token_id=0)
    assert torch.equal(seq, seq_ref)
    assert torch.allclose(logits, logits_ref, rtol=1e-4, atol=1e-4)
    seq_plain, logits_plain = greedy(
        model, DynamicCache(config=model.config), ids, 8, pad_token_id=0
    )  # plain tensors in
    assert torch.allclose(logits_plain, logits_ref, rtol=1e-4, atol=1e-4)
    model.set_attn_implementation("eager")


@pytest.mark.parametrize("preset", ["int4", "nuq4", "k3v2-recent"])
def test_gpt_oss_sinks_fused_as_dequantized(preset, greedy):
    model = _gpt_oss()
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    dequantized = KVQuantCache(model.config, preset, fused=False)  # under eager
    seq_ref, logits_ref = greedy(model, dequantized, ids, 8, pad_token_id=0)
    kvquant.enable(model)
    seq, logits = greedy(model, KVQuantCache(model.config, preset), ids, 8, pad_token_id=0)
    assert torch.equal(seq, seq_ref)
    rel = ((logits - logits_ref).norm() / logits_ref.norm()).item()
    assert rel <= 1e-4, rel
    model.set_attn_implementation("eager")


def test_a_model_whose_attention_bypasses_the_interface_is_refused_by_enable(greedy):
    from transformers import FalconConfig

    cfg = FalconConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    before = model.config._attn_implementation
    with pytest.raises(
        ValueError, match="falcon does not dispatch attention through transformers' AttentionInterface"
    ):
        kvquant.enable(model)
    assert model.config._attn_implementation == before  # nothing half-done
    ids = torch.randint(3, 100, (1, 6))
    seq, _ = greedy(
        model, KVQuantCache(model.config, "int8"), ids, 3, pad_token_id=0
    )  # its own attention still works
    assert seq.shape == (1, 9)


def test_t5_position_bias_is_honoured():
    from transformers import EncoderDecoderCache, T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(3))

    def run(cache):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(
                input_ids=ids, past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        return out.sequences, torch.stack(out.logits)

    model.set_attn_implementation("eager")
    seq_ref, logits_ref = run(EncoderDecoderCache(DynamicCache(), DynamicCache()))
    kvquant.enable(model)
    seq, logits = run(EncoderDecoderCache(KVQuantCache(model.config, "none"), DynamicCache()))
    assert torch.equal(seq, seq_ref)
    assert torch.allclose(logits, logits_ref, rtol=1e-4, atol=1e-4)
    model.set_attn_implementation("eager")
