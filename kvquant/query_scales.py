"""Query channel scales, from one probe of the model: what ``smoothing: query`` weighs key channels by.

A score's error is ``q . e`` for a key error ``e``, so a key channel matters as much as the queries
that read it. Dividing key channel ``c`` by ``d_c`` before quantizing (and folding ``d_c`` into the
query, so every score stays exact) turns the expected squared score error of a rotated head into
``(sum_c sk_c^2 / d_c^2) * (sum_c sq_c^2 d_c^2)`` (``sk``: the key channel's spread, ``sq``: the
query channel's root mean square; the rotation spreads each key's error evenly over its channels).
By Cauchy-Schwarz that is least at ``d_c = sqrt(sk_c / sq_c)``: the exponent 1/2 of
:data:`QUERY_EXPONENT_ROTATED`. Without a rotation each 64-channel group's range is set by its
largest channel, which argues for ``d_c = sk_c`` (``smoothing: channel``); the queries still pull,
and :data:`QUERY_EXPONENT_PLAIN` (1/4) keeps part of their pull. This is the diagonal of a key map
(:mod:`kvquant.key_map`), which needs calibration text; the diagonal needs only each query channel's
size, which the model shows on any input: the probe is the random-token sequence of
:mod:`kvquant.retrieval_heads` (``2 * 128 + 1`` tokens, one forward pass, kept per model object).

The weighting is applied only in heads whose key channels' spreads differ widely (the heads
``smoothing: auto`` divides, :mod:`kvquant.transforms`): weighing every head by the average query
cost passkey retrieval on SmolLM2, whose queries that look far back are few. What it buys, measured
on real models, is in the README ("Query-weighted key smoothing").

Example:
    >>> rms = query_channel_rms(model)        # {layer: [kv_heads, head_dim]} fp32
    >>> rms[0].shape
    torch.Size([3, 64])
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvquant.retrieval_heads import PROBE_TOKENS, attn_implementation, probe_ids

QUERY_EXPONENT_ROTATED = 0.5  # d_c = sk_c^(1-a) / sq_c^a after a Hadamard rotation (the optimum above)
QUERY_EXPONENT_PLAIN = 0.25  # without one (measured: 0.25 beat 0 and 0.5 on both models)
_RECORDER = "kvquant_query_probe"
_RMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(tokens, seed): {layer: rms}}


def pooled_query_rms(power: torch.Tensor) -> torch.Tensor:
    """``[Hk, G, D]`` mean square of each query channel, per query head of each KV head's group ->
    ``[Hk, D]``: the query size one KV head's keys are weighed by.

    Each query head's channels are first taken as shares of its own total (its scores' error counted
    relative to its scores' size), then the shares are averaged over the group. Summed over the
    group's heads, the relative squared score error is least at this pooling (the Cauchy-Schwarz
    argument above, with each head weighed by its own total). Pooling the raw mean squares instead lets
    the heads with the largest queries set the weights alone: on Gemma 3 270M (four query heads per
    KV head) that cost passkey retrieval (README "Query-weighted key smoothing").

    Example:
        >>> power = torch.tensor([[[100.0, 100.0, 100.0, 100.0], [4.0, 0.0, 0.0, 0.0]]])  # [1, 2, 4]
        >>> pooled_query_rms(power) ** 2  # head 1 reads channel 0 only, and that counts fully
        tensor([[0.6250, 0.1250, 0.1250, 0.1250]])
    """
    share = power / power.sum(-1, keepdim=True).clamp_min(torch.finfo(power.dtype).tiny)  # [Hk, G, D]
    return share.mean(1).sqrt()


class _QueryRecorder:
    """Attention function that records each layer's query channel RMS, then attends with sdpa."""

    def __init__(self, first: int):
        self.first = first  # positions before it (the bos) are left out
        self.rms: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        hq, d, hk = query.shape[1], query.shape[3], key.shape[1]
        q = query[:, :, self.first :].float()  # [B, Hq, n', D]
        power = q.pow(2).mean((0, 2)).view(hk, hq // hk, d)  # [Hk, G, D], per query head
        self.rms[int(module.layer_idx)] = pooled_query_rms(power).cpu()
        kwargs.pop("softcap", None)  # (sdpa has none; the probe only needs the queries)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.no_grad()
def query_channel_rms(model: Any, *, tokens: int = PROBE_TOKENS, seed: int = 0) -> dict[int, torch.Tensor]:
    """Root mean square of each query channel as the attention sees it (after any norm and RoPE),
    per attention layer: ``{layer: [kv_heads, head_dim]}`` fp32, each KV head's query heads pooled by
    :func:`pooled_query_rms`.

    One forward pass over the random-token probe of :func:`kvquant.retrieval_heads.probe_ids`; kept per
    model object. ``ValueError`` when no attention layer reported (a model whose attention does not
    go through transformers' attention functions)."""
    memo = _RMS.setdefault(model, {})
    if (tokens, seed) not in memo:
        memo[(tokens, seed)] = _probe(model, tokens, seed)
    return {i: t.clone() for i, t in memo[(tokens, seed)].items()}


def _probe(model: Any, tokens: int, seed: int) -> dict[int, torch.Tensor]:
    from transformers import AttentionInterface

    ids, first = probe_ids(model, tokens, seed)
    recorder = _QueryRecorder(first)
    AttentionInterface.register(_RECORDER, recorder)
    previous = attn_implementation(model)
    model.set_attn_implementation(_RECORDER)
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    if not recorder.rms:
        arch = getattr(model.config, "model_type", type(model).__name__)
        raise ValueError(f"the query probe saw no attention layer of {arch}")
    return recorder.rms
