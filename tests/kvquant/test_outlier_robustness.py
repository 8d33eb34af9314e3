"""Every shipped preset on a model nobody tuned for: keys with per-channel offsets and outlier channels.

Real models (Gemma 3, Llama, Qwen) carry in their keys a per-channel offset (the same for every
token) and a few channels 10-50x larger than the rest, in the slow RoPE dimensions where they stay
put across positions. Per-token scales then spend their range on those channels and crush the rest.
:func:`outlier_model` is a tiny random Gemma-3-shaped model built to have that structure:

- Gemma 3 text layout: head_dim 256, one KV head, 4 query heads, 3 sliding (window 128) + 1 global
  layer, q / k RMS norms, hidden 128, vocab 256, float32, seed 0;
- ``k_proj`` has a bias: an offset per channel of N(0, 1) against a per-token spread of 1, and
  +-2 on 4 outlier channels per layer (2 RoPE pairs among the 32 slowest) whose token part is
  halved; ``k_norm`` makes those 10-50x larger (RMS over tokens) than an ordinary channel;
- the queries load on the keys: ``q_norm`` gains 1.5 on the ordinary channels and 8 / (the key's
  gain) on the outliers (attention is peaked: its largest weight averages ~0.4), and the next-token
  logits spread by 3 (entropy ~2.5 nats: peaked, as a trained model's are);
- each block's output (Gemma's post-attention / post-feedforward norms) is scaled by 0.2.

The last two knobs set how much a cache error moves the output. They were chosen (query gain from
1 / 1.5 / 2 / 3, block gain from 0.2 / 0.3 / 0.5 / 1) so that four presets measured on a real
Gemma-shaped model (issue 16: int4 KL 0.22-0.24, int4-rot 0.027-0.031, nuq4 0.0067-0.0083, kivi4
0.002) land near those numbers with the presets as they were then (0.223, 0.032, 0.0085, 0.0031);
the other presets' numbers are predictions. KL is measured in decode mode
(:func:`kvquant.eval.decode.teacher_forced_logprobs`: a 256-token prefix prefilled, then 64 tokens
fed one at a time through the cache) against a ``DynamicCache``.

The bounds: a preset whose format bits at 16 bits (:func:`kvquant.memory.format_bits`, K and V
averaged, head_dim 256) lie in [4, 5] keeps KL <= 0.01; any other keeps KL <= 2x its KL on the
embedded model (``EMBEDDED_KL``). ``python tests/kvquant/test_outlier_robustness.py`` prints the table.

Example:
    >>> model = outlier_model()                       # deterministic (seed 0)
    >>> ids = outlier_tokens(model, 256 + 64)         # [1, 320] token ids
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.config import preset_names
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.eval.quality import compare
from kvquant.memory import format_bits

HEAD_DIM = 256
OUTLIERS_PER_LAYER = 4
LOGIT_SPREAD = 3.0  # std of the next-token logits (the final norm gives RMS-1 states)


def outlier_config(layers: int = 4, sliding_window: int = 128) -> Gemma3TextConfig:
    """The Gemma-3-shaped config (1 KV head of 256, sliding + global layers)."""
    kinds = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    return Gemma3TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
        sliding_window=sliding_window, layer_types=kinds, max_position_embeddings=4096,
        attention_bias=True, tie_word_embeddings=False, initializer_range=0.02,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


@torch.no_grad()
def outlier_model(
    seed: int = 0,
    outlier_gain: tuple[float, float] = (10.0, 50.0),
    key_offset: float = 1.0,
    query_gain: float = 1.5,
    block_gain: float = 0.2,
) -> torch.nn.Module:
    """The model in eval mode, float32, weights a function of ``seed`` alone (see the module doc)."""
    torch.manual_seed(seed)
    cfg = outlier_config()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    hidden, half = cfg.hidden_size, HEAD_DIM // 2
    # Gemma multiplies the embedding by sqrt(hidden): inputs of RMS 1, as each block's output is
    model.model.embed_tokens.weight.normal_(0.0, hidden**-0.5, generator=gen)
    model.lm_head.weight.normal_(0.0, LOGIT_SPREAD * hidden**-0.5, generator=gen)
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.weight.normal_(0.0, proj.in_features**-0.5, generator=gen)
            proj.bias.zero_()
        # 2 RoPE pairs (channel i and i + 128 rotate together) among the 32 slowest-turning ones
        pairs = half - 1 - torch.randperm(32, generator=gen)[: OUTLIERS_PER_LAYER // 2]
        outliers = torch.cat([pairs, pairs + half])
        lo, hi = outlier_gain
        gain = lo + (hi - lo) * torch.rand(len(outliers), generator=gen)
        # each channel's key = gain * (offset + the token's part); the token's part has std 1 (a
        # unit-norm k_proj row against RMS-1 inputs), the offset is N(0, key_offset) per channel and
        # +-2 * key_offset on the outliers, whose token part is halved (they are mostly offset)
        offset = key_offset * torch.randn(HEAD_DIM, generator=gen)
        offset[outliers] = 2.0 * key_offset * torch.sign(torch.randn(len(outliers), generator=gen))
        attn.k_proj.weight[outliers] *= 0.5
        attn.k_proj.bias.copy_(offset)
        # the outliers' magnitude (RMS over tokens) is `gain` times an ordinary channel's
        ordinary = (1.0 + key_offset**2) ** 0.5
        k_gain = torch.ones(HEAD_DIM)
        k_gain[outliers] = gain * ordinary / (0.25 + 4.0 * key_offset**2) ** 0.5
        q_gain = torch.full((HEAD_DIM,), float(query_gain))
        q_gain[outliers] = 8.0 / k_gain[outliers]
        attn.k_norm.weight.copy_(k_gain - 1.0)  # Gemma's RMSNorm scales by (1 + weight)
        attn.q_norm.weight.copy_(q_gain - 1.0)
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            proj.weight.normal_(0.0, proj.in_features**-0.5, generator=gen)
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight.fill_(block_gain - 1.0)
    return model


def outlier_tokens(model: torch.nn.Module, length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` token ids, uniform over the vocabulary (ids 3+), a function of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, length), generator=gen)


# ------------------------------------------------------------------------------------------ bounds

PREFIX, SCORED = 256, 64
KL_4_TO_5_BITS = 0.01

# Mean KL of each preset on the embedded SmolLM2 (WikiText-2, decode mode, 4 x (1,024 + 64) tokens) as
# issue 16 took them: README "Measured", quality table, at f4e4879 (now in docs/measured.md); kivi2, fp8-e5m2 and none from
# eval/README.md "Reference run". int8, k8v4, int4 and int4-rot are their numbers before they took
# on key smoothing (which lowered them on the embedded model too): a reference, not to be lowered
# when a preset gets better there. A new preset adds its own row.
EMBEDDED_KL = {
    "none": 0.0,
    "int8": 0.00020,
    "fp8": 0.00360,
    "fp8-e5m2": 0.01438,
    "k8v4": 0.00133,
    "kivi4": 0.00727,
    "int4": 0.0190,
    "nuq4": 0.00341,
    "nuq3": 0.0205,
    "kivi2": 0.230,
    "k3v2": 0.0415,
    "k3v2-recent": 0.0294,
    "tcq3v2-recent": 0.0151,
    "nuq2-recent": 0.0700,
    "tcq2-recent": 0.0424,
    "tcq2v1-recent": 0.0989,  # 2026-12-03 (issue16 config, the same protocol)
    "nuq2": 0.152,
}


def preset_bits(config: KVQuantConfig) -> float:
    """Format bits per element at 16 bits, K and V averaged, on this model's 256-wide heads."""
    return (format_bits(config, "key", HEAD_DIM) + format_bits(config, "value", HEAD_DIM)) / 2


def kl_bound(name: str) -> float:
    """0.01 for a preset of 4 to 5 bits; else 2x its embedded-model KL (1e-6 for ``none``)."""
    if 4.0 <= preset_bits(KVQuantConfig.resolve(name)) <= 5.0:
        return KL_4_TO_5_BITS
    if name not in EMBEDDED_KL:
        raise KeyError(
            f"preset {name!r} has no embedded-model KL in EMBEDDED_KL: measure it "
            f"(kvquant eval --config smollm2-wikitext2 --caches dynamic,{name}), add its row to the README "
            f"quality table and to EMBEDDED_KL"
        )
    return max(2.0 * EMBEDDED_KL[name], 1e-6)


# ------------------------------------------------------------------------------------------ tests

_INT4_PLAIN = dict(
    key_format="int4", value_format="int4", key_group_size=64, value_group_size=64,
    sink_tokens=4, residual_length=16,
)  # fmt: skip


class Case(tuple):
    """(model, ids [1, PREFIX + SCORED], full-precision log-probs [1, SCORED, V]); a short repr, so
    that a failing assertion does not print the model and the tensors."""

    def __repr__(self) -> str:
        return "<outlier model, seed 0>"


@pytest.fixture(scope="module")
def setup() -> Case:
    return build_case()


def build_case() -> Case:
    model = outlier_model()
    ids = outlier_tokens(model, PREFIX + SCORED)
    return Case((model, ids, teacher_forced_logprobs(model, ids, PREFIX, DynamicCache(config=model.config))))


def kl(setup, spec) -> float:
    """Decode-mode KL of a cache of ``spec`` given the model, as a user builds it (``smoothing: query``
    probes it), with no retrieval layers (this model has 4 layers: the presets' formats are measured)."""
    model, ids, base = setup
    cfg = dataclasses.replace(KVQuantConfig.resolve(spec), retrieval_layers=0)
    test = teacher_forced_logprobs(model, ids, PREFIX, KVQuantCache(model, cfg))
    return compare(base, test, ids[:, PREFIX:])["kl_mean"]


# Presets that miss their bound, reported to their owners (strict: a fix turns the XPASS into a failure,
# and the entry is then removed). Measured on this model at this commit.
KNOWN_MISSES: dict[str, str] = {}


def _marked(name: str):
    if name in KNOWN_MISSES:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[name]))
    return name


@pytest.mark.parametrize("name", [_marked(n) for n in preset_names()])
def test_preset_kl_on_outlier_keys(setup, name):
    bound = kl_bound(name)
    got = kl(setup, name)
    bits = preset_bits(KVQuantConfig.resolve(name))
    assert got <= bound, f"{name} ({bits:.2f} bits): KL {got:.4f} > {bound:.4f} on the outlier model"


def test_every_preset_has_a_reference():
    """A preset below 4 or above 5 bits needs its embedded-model KL, for its bound."""
    missing = [n for n in preset_names() if not 4.0 <= preset_bits(KVQuantConfig.resolve(n)) <= 5.0]
    missing = [n for n in missing if n not in EMBEDDED_KL]
    assert not missing, f"add the embedded-model KL of {missing} to EMBEDDED_KL (see kl_bound)"


def _keys(model, ids, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(the global layer's keys after a prefill through ``spec``, dequantized; the exact ones)."""
    exact, cache = DynamicCache(config=model.config), KVQuantCache(model.config, spec)
    with torch.no_grad():
        model(input_ids=ids, cache=exact, use_cache=True)
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache.layers[-1].keys.float(), exact.layers[-1].keys.float()


def test_outliers_break_plain_int4_and_smoothing_fixes_the_keys(setup):
    """The structure bites: plain per-token int4 passes the 4-bit bound on the same model without
    offsets and outliers and fails it with them; mean smoothing, then rotation, cut the key error
    they target (the store's keys, sinks and newest tokens exact), and with them int4 passes."""
    model, ids, _ = setup
    plain = kl(setup, _INT4_PLAIN)
    assert plain > KL_4_TO_5_BITS
    clean = outlier_model(outlier_gain=(1.0, 1.0), key_offset=0.0)
    clean_base = teacher_forced_logprobs(clean, ids, PREFIX, DynamicCache(config=clean.config))
    clean_test = teacher_forced_logprobs(clean, ids, PREFIX, KVQuantCache(clean.config, _INT4_PLAIN))
    assert compare(clean_base, clean_test, ids[:, PREFIX:])["kl_mean"] < plain / 4

    prompt = ids[:, :PREFIX]
    errors = {}
    for label, extra in {"plain": {}, "mean": dict(smoothing="mean"),
                         "mean+rot": dict(smoothing="mean", rotation="hadamard")}.items():  # fmt: skip
        got, exact = _keys(model, prompt, {**_INT4_PLAIN, **extra})
        errors[label] = ((got - exact).pow(2).mean() / exact.pow(2).mean()).item()
    assert errors["mean"] < errors["plain"] / 2, errors
    assert errors["mean+rot"] < errors["mean"] / 2, errors
    assert kl(setup, {**_INT4_PLAIN, "smoothing": "mean", "rotation": "hadamard"}) <= KL_4_TO_5_BITS


@pytest.mark.parametrize(("name", "other"), [("nuq3", "mean"), ("int4", "mean")])
def test_query_smoothing_lowers_the_kl(setup, name, other):
    """Weighing the key channels by the model's query sizes (``smoothing: query``, probed from the
    model) lowers the decode-mode KL against the same preset with ``mean`` smoothing by at least a
    fifth (measured: nuq3 0.036 -> 0.024, int4 (rotated) 0.0077 -> 0.0048)."""
    cfg = KVQuantConfig.resolve(name)
    assert cfg.smoothing == "query"
    plain, weighed = kl(setup, dataclasses.replace(cfg, smoothing=other)), kl(setup, cfg)
    assert weighed < 0.8 * plain, (plain, weighed)


@pytest.mark.parametrize("name", ["nuq3", "tcq2-recent"])
def test_a_calibrated_key_map_lowers_the_kl(setup, name, tmp_path):
    """The outlier model's queries are small where its keys are large: a key map calibrated on other
    tokens of the model (``kvquant calibrate --key-map``) moves the key error to where the queries
    look less, and the decode-mode KL falls by at least a quarter (measured: nuq3 0.036 -> 0.022,
    tcq2-recent 0.036 -> 0.019)."""
    from kvquant.tools.calibrate import calibrate_key_map

    model = setup[0]
    cfg = dataclasses.replace(KVQuantConfig.resolve(name), smoothing="mean")  # (a map weighs by the queries)
    calibrate_key_map(model, outlier_tokens(model, 2048, seed=5), cfg, tmp_path / "km.pt", window=512)
    plain, mapped = kl(setup, cfg), kl(setup, cfg.with_key_map(str(tmp_path / "km.pt")))
    assert mapped < 0.75 * plain, (plain, mapped)


if __name__ == "__main__":  # the table: python tests/kvquant/test_outlier_robustness.py
    torch.set_num_threads(1)
    case = build_case()
    print("| preset | bits @16-bit | KL | bound |\n|---|---|---|---|")
    for n in preset_names():
        bits, got = preset_bits(KVQuantConfig.resolve(n)), kl(case, n)
        print(f"| `{n}` | {bits:.2f} | {got:.4f} | {kl_bound(n):.4f} |")
