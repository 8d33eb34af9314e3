"""Tiny random-init causal LMs of five families, for tests: :func:`tiny_config`, :func:`tiny_model`
(also importable from :mod:`kvquant.models`).

Example::

    >>> model = tiny_model("gemma3")  # 4 layers: 3 sliding (window 8) + 1 full, random weights
    >>> model.config.layer_types
    ['sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


TINY_FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gemma3")

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,  # GQA ratio 2
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # Larger than transformers' 0.02 so attention is peaked and logits are well separated: quantization
    # error then shows up in outputs instead of vanishing in near-uniform attention / near-tie argmaxes.
    "initializer_range": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_TINY_FAMILY: dict[str, tuple[str, dict[str, Any]]] = {
    # family -> (model_type, overrides)
    "llama": ("llama", {"num_hidden_layers": 2}),  # all full attention
    "qwen2": ("qwen2", {"num_hidden_layers": 2}),  # full attention, q/k/v biases
    # every layer sliding (window 8): DynamicCache(config=...) makes them all sliding-window layers
    "mistral": ("mistral", {"num_hidden_layers": 2, "sliding_window": 8}),
    # alternating sliding (window 8) / full, attention-logit softcapping (50; so no sdpa: eager attention),
    # query_pre_attn_scalar scaling
    "gemma2": (
        "gemma2",
        {"num_hidden_layers": 4, "sliding_window": 8, "query_pre_attn_scalar": 16},
    ),
    # 3 sliding (window 8) : 1 full, q/k norms, separate local/global RoPE
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
        },
    ),
}


def _gemma3_layer_types(num_layers: int) -> list[str]:
    # Every 4th layer and the last one full, the rest sliding: [s, s, s, f] for 4 layers, [s, f] for 2.
    return [
        "full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "sliding_attention"
        for i in range(num_layers)
    ]


_TINY_DEFAULT_ATTN = {"gemma2": "eager"}  # Gemma2ForCausalLM._supports_sdpa is False


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A tiny random-init-ready config of a model family (vocab 128, hidden 64, 4 q / 2 kv heads, head_dim 16).

    Families: ``"llama"``, ``"qwen2"`` (2 layers, full attention), ``"mistral"`` (2 layers, all
    sliding, window 8), ``"gemma2"`` (4 layers, sliding/full alternating, window 8) and ``"gemma3"``
    (``Gemma3TextConfig``, 4 layers: 3 sliding (window 8) + 1 full). ``overrides`` replace any field.

    Example::

        >>> cfg = tiny_config("gemma3", num_hidden_layers=2)
        >>> cfg.model_type, cfg.sliding_window, cfg.layer_types
        ('gemma3_text', 8, ['sliding_attention', 'full_attention'])
    """
    from transformers import AutoConfig

    try:
        model_type, family_kwargs = _TINY_FAMILY[family]
    except KeyError:
        raise ValueError(
            f"tiny_config(family={family!r}): unknown family; choose one of {TINY_FAMILIES}"
        ) from None
    kwargs = {**_TINY_COMMON, **family_kwargs, **overrides}
    if family == "gemma3" and "layer_types" not in overrides:
        kwargs["layer_types"] = _gemma3_layer_types(kwargs["num_hidden_layers"])
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(
    family: str, seed: int = 0, *, attn_implementation: str | None = None, **overrides: Any
) -> PreTrainedModel:
    """A tiny randomly initialised causal LM of ``family`` (float32, CPU, eval mode).

    Attention is ``"sdpa"``, except for ``"gemma2"``, whose transformers class refuses sdpa (attention
    softcapping) and gets ``"eager"``; pass ``attn_implementation`` to choose. Weights depend only on
    ``seed`` (the global RNG state is left untouched). ``overrides`` go to :func:`tiny_config`.

    Example::

        >>> model = tiny_model("llama")
        >>> ids = torch.tensor([[1, 5, 7, 9]])  # [B, T]
        >>> model.generate(ids, max_new_tokens=5, do_sample=False).shape  # [B, T + 5]
        torch.Size([1, 9])
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    if attn_implementation is None:
        attn_implementation = _TINY_DEFAULT_ATTN.get(family, "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32
        )
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()
