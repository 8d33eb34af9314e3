"""Every model family a new user is likely to try either works or is refused with a reason.

For each family, a tiny random-init config (2 layers, hidden 64, vocab 128, float32):

- under the ``kvquant`` attention with the pass-through ``none`` cache, greedy generation equals the
  model's own eager attention with a ``DynamicCache`` token for token, logits within 1e-4 (a batch of
  two, one row left-padded);
- the quantized presets generate the requested tokens, finite, after quantizing part of the prompt
  (a 24-token prompt: past every preset's sinks and residual window), and ``int8``'s first logits
  stay within 5% of ``none``'s;
- or it is refused, at ``KVQuantCache`` construction or at ``kvquant.enable`` / load, by a message
  naming the architecture and the reason.

Families: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma, gemma2, gemma3_text, phi3, olmo2,
cohere, starcoder2, gpt_neox, gpt2, gpt_oss, deepseek_v3 (multi-head latent attention: the cache
stores the compressed latent and the RoPE key, each at its own width), qwen3_next (hybrid: gated
DeltaNet layers keep their recurrent state as transformers does); falcon (its own attention only),
falcon_h1 (refused) and t5 (self- and cross-attention caches) below.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kvquant
from kvquant import KVQuantCache

PRESETS = ("int8", "int4", "nuq4", "tcq2-recent", "k3v2-recent")

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_TWO_KINDS = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])

# model_type -> config fields beyond _COMMON (None: the fields are the whole config)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=6),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": _MOE,
    "gemma": {},
    "gemma2": dict(sliding_window=6, query_pre_attn_scalar=16),  # softcap, alternating sliding
    "gemma3_text": dict(query_pre_attn_scalar=16, **_TWO_KINDS),
    "phi3": {},
    "olmo2": {},
    "cohere": {},
    "starcoder2": dict(sliding_window=6),
    "gpt_neox": {},
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, n_positions=256, head_dim=None, num_key_value_heads=None),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, **_TWO_KINDS),  # attention sinks
    "deepseek_v3": dict(
        head_dim=None,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
    ),  # fmt: skip
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        shared_expert_intermediate_size=32,
        **_MOE,
    ),  # fmt: skip
}


@functools.cache
def _model(family: str) -> torch.nn.Module:
    """The family's tiny model (built once per session; each test sets its attention)."""
    fields = {k: v for k, v in {**_COMMON, **FAMILIES[family]}.items() if v is not None}
    cfg = AutoConfig.for_model(family, **fields)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    return model.eval()


def _prompt(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (2, n), generator=torch.Generator().manual_seed(n))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_none_under_kvquant_is_eager_with_a_dynamic_cache(family, greedy):
    model = _model(family)
    ids, mask = _prompt()
    model.set_attn_implementation("eager")
    seq_ref, logits_ref = greedy(model, DynamicCache(config=model.config), ids, 6, mask)
    kvquant.enable(model)
    try:
        seq, logits = greedy(model, KVQuantCache(model.config, "none"), ids, 6, mask)
    finally:
        model.set_attn_implementation("eager")
    assert torch.equal(seq, seq_ref), family
    assert torch.allclose(logits, logits_ref, rtol=1e-4, atol=1e-4), (logits - logits_ref).abs().max()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_presets_generate(family, greedy):
    model = kvquant.enable(_model(family))
    ids, mask = _prompt()
    try:
        _, logits_none = greedy(model, KVQuantCache(model.config, "none"), ids, 1, mask)
        for preset in PRESETS:
            cache = KVQuantCache(model.config, preset)
            seq, logits = greedy(model, cache, ids, 3, mask)
            assert seq.shape == (2, 27) and torch.isfinite(logits).all(), (family, preset)
            assert any(layer.store_end > 0 for layer in cache._kv_layers()), (family, preset)  # quantized
            if preset == "int8":  # the first step (later ones may follow another token)
                rel = ((logits[0] - logits_none[0]).norm() / logits_none[0].norm()).item()
                assert rel < 0.05, (family, rel)
    finally:
        model.set_attn_implementation("eager")


def test_latent_attention_stores_each_stream_at_its_own_width():
    model = _model("deepseek_v3")
    cache = KVQuantCache(model.config, "int4")
    ids, mask = _prompt()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
    layer = cache.layers[0]
    assert (layer.head_dim, layer.value_head_dim) == (32, 8)  # kv_lora_rank, qk_rope_head_dim
    assert layer.main.k_store.group_size == 32 and layer.main.v_store.group_size == 8
    assert layer.store_end == 24 - 16  # quantized: all but the residual window (16)
    k, v = layer.keys, layer.values  # what the model expands into keys and values
    assert k.shape == (2, 1, 24, 32) and v.shape == (2, 1, 24, 8)


# ------------------------------------------------------------------------------------------- falcon


def _falcon_config():
    from transformers import FalconConfig

    return FalconConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, pad_token_id=0
    )


def test_falcon_loaded_with_the_kvquant_attention_is_refused_by_name():
    with pytest.raises(
        ValueError, match="falcon does not dispatch attention through transformers' AttentionInterface"
    ):
        AutoModelForCausalLM.from_config(_falcon_config(), attn_implementation="kvquant")
    model = AutoModelForCausalLM.from_config(_falcon_config())
    with pytest.raises(ValueError, match="falcon does not dispatch"):
        kvquant.enable(model)
    model.set_attn_implementation("kvquant")  # transformers: a warning, and nothing changes
    assert model.config._attn_implementation != "kvquant"


def test_falcon_works_with_its_own_attention(greedy):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_falcon_config(), dtype=torch.float32).eval()
    ids, mask = _prompt()
    seq_ref, logits_ref = greedy(model, DynamicCache(config=model.config), ids, 4, mask)
    seq, logits = greedy(model, KVQuantCache(model.config, "none"), ids, 4, mask)
    assert torch.equal(seq, seq_ref) and torch.allclose(logits, logits_ref, rtol=1e-4, atol=1e-4)
    seq, logits = greedy(model, KVQuantCache(model.config, "int4"), ids, 4, mask)
    assert seq.shape == (2, 28) and torch.isfinite(logits).all()


def test_a_model_with_a_composite_class_is_not_refused():
    # Llava's modeling module does no lookup itself; its language model does
    from transformers import LlavaForConditionalGeneration

    from kvquant.attention import check_dispatches_attention

    check_dispatches_attention(LlavaForConditionalGeneration.__new__(LlavaForConditionalGeneration))


# ------------------------------------------------------------------------------------------- hybrid


def test_a_hybrid_attention_and_state_layer_is_refused_by_name():
    cfg = AutoConfig.for_model(
        "falcon_h1",
        **{**_COMMON, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8},
    )
    with pytest.raises(ValueError, match=r"falcon_h1 layer 0 is 'hybrid'.*attention and a recurrent state"):
        KVQuantCache(cfg, "int4")


# ------------------------------------------------------------------------------------------- t5


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T5ForConditionalGeneration(cfg).eval()


def _t5_generate(model, cache, ids, mask):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, min_new_tokens=6,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("attn", ["eager", "kvquant"])
def test_t5_cross_attention_cache_is_written_once_and_read_every_step(attn):
    from transformers import EncoderDecoderCache

    model = _t5()
    ids, mask = _prompt(40)  # past int4's sinks and residual window: the encoder states are quantized
    model.set_attn_implementation("eager")
    seq_ref, logits_ref = _t5_generate(model, EncoderDecoderCache(DynamicCache(), DynamicCache()), ids, mask)
    model.set_attn_implementation(attn)
    both = EncoderDecoderCache(KVQuantCache(model.config, "none"), KVQuantCache(model.config, "none"))
    seq, logits = _t5_generate(model, both, ids, mask)
    assert torch.equal(seq, seq_ref)
    assert torch.allclose(logits, logits_ref, rtol=1e-4, atol=1e-4)
    cross = KVQuantCache(model.config, "int4")
    seq, logits = _t5_generate(
        model, EncoderDecoderCache(KVQuantCache(model.config, "int4"), cross), ids, mask
    )
    assert seq.shape == seq_ref.shape and torch.isfinite(logits).all()
    assert cross.get_seq_length() == 40 and cross.layers[0].store_end > 0  # written once, quantized
    rel = ((logits[0] - logits_ref[0]).norm() / logits_ref[0].norm()).item()
    assert rel < 0.2, rel


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deepseek_v3"])  # (latent: no per-head keys)
def test_the_query_probe_reads_every_family_and_the_cache_uses_it(family, greedy):
    """``smoothing: query`` (``int4``) probes the model for its query sizes: one ``[kv_heads, head_dim]``
    per attention layer, positive, and the attention left as it was; the cache then generates."""
    from kvquant.query_scales import query_channel_rms

    model = _model(family)
    model.set_attn_implementation("eager")
    rms = query_channel_rms(model)
    cache = KVQuantCache(model, "int4")
    layers = cache._kv_layers()
    assert model.config._attn_implementation == "eager"
    assert layers and all(layer.query_rms is not None for layer in layers)
    for layer in layers:
        assert bool((layer.query_rms > 0).all()) and torch.isfinite(layer.query_rms).all()
    assert len(rms) == len(layers)
    ids, mask = _prompt()
    seq, logits = greedy(model, cache, ids, 3, mask)
    assert torch.isfinite(logits).all() and any(layer.store_end > 0 for layer in layers)
