"""Retrieval heads, found by one probe of the model: the layers where a quantized cache must stay finer.

Passkey retrieval at <= 3 bits fails on few layers: those whose heads copy from far back. Such a head,
reading a sequence it has seen before, attends from each token to that token's earlier occurrence (an
*echo* head) or to the token after it (an *induction* head). Feeding the model a random token sequence
twice and reading where each head looks from the second copy scores every head in one forward pass,
with no data and no search (the probe of RazorAttention, Tang et al., 2024). On SmolLM2 it ranks
layers 18, 17 and 8 first (the same order from seeds 0-2); the passkey search of
:mod:`kvquant.eval.retrieval_layers`, which asks the model with passkey prompts for 20 minutes, had
found 18 and 8.

``KVQuantConfig.retrieval_layers`` asks the cache for it: ``KVQuantCache(model, "tcq2-recent")`` probes
the model once (kept per model object) and keeps the keys and values of that many top-scoring layers
in ``retrieval_format``.

With ``retrieval_unit: head`` the cache keeps as many single KV heads instead (``retrieval_layers``
times the KV heads of a layer: the same bytes), the best-scoring ones of any layer (:func:`top_heads`).

Example:
    >>> scores = retrieval_scores(model)            # [layers, query heads]: max(echo, induction)
    >>> top_layers(scores, 3)
    [18, 17, 8]
    >>> top_heads(scores, 3, kv_heads=3)            # (layer, KV head)
    [(18, 2), (17, 1), (8, 0)]
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvquant.layer_kinds import ATTENTION

PROBE_TOKENS = 128  # random tokens per copy; the probe holds 2 * PROBE_TOKENS + 1 positions
_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(tokens, seed): scores}


@torch.no_grad()
def retrieval_scores(model: Any, *, tokens: int = PROBE_TOKENS, seed: int = 0) -> torch.Tensor:
    """Per-head retrieval scores of ``model``'s attention layers, ``[num_layers, query_heads]`` fp32.

    One forward pass over ``[bos] + s + s`` (``s``: ``tokens`` random ids from the middle of the
    vocabulary, ``seed``) with eager attention; a head's score is the larger of its mean attention,
    from position ``i`` of the second copy, to ``s[i]`` in the first (echo) and to ``s[i + 1]``
    (induction). Layers without attention (recurrent-state layers of hybrids) score 0. Kept per model
    object, so a second cache of the same model does not probe again.
    """
    if tokens < 2:
        raise ValueError(f"tokens: expected an integer >= 2, got {tokens!r}")
    memo = _SCORES.setdefault(model, {})
    if (tokens, seed) not in memo:
        memo[(tokens, seed)] = _probe(model, tokens, seed)
    return memo[(tokens, seed)].clone()


def top_layers(scores: torch.Tensor, count: int) -> list[int]:
    """The ``count`` layers (indices, best first) whose best head scores highest in ``scores [L, H]``
    (ties: the lower index first)."""
    best = scores.max(dim=1).values  # [L]
    order = sorted(range(best.numel()), key=lambda i: (-float(best[i]), i))
    return order[: max(0, min(count, best.numel()))]


def top_heads(scores: torch.Tensor, count: int, kv_heads: int) -> list[tuple[int, int]]:
    """The ``count`` KV heads ``(layer, kv_head)``, best first, whose best query head scores highest in
    ``scores [L, Hq]`` (``Hq / kv_heads`` query heads per KV head, transformers' ``repeat_kv`` order;
    ties: the lower layer, then the lower head, first); heads scoring 0 are left out.

    Example:
        >>> top_heads(torch.tensor([[0.1, 0.9, 0.2, 0.0], [0.5, 0.0, 0.0, 0.3]]), 2, kv_heads=2)
        [(0, 0), (1, 0)]
    """
    layers, hq = scores.shape
    if kv_heads < 1 or hq % kv_heads:
        raise ValueError(f"kv_heads: {kv_heads} does not divide the {hq} query heads of the scores")
    per_kv = scores.view(layers, kv_heads, hq // kv_heads).max(dim=2).values  # [L, H_kv]
    ranked = sorted(
        (-float(per_kv[i, h]), i, h) for i in range(layers) for h in range(kv_heads) if per_kv[i, h] > 0
    )
    return [(i, h) for _, i, h in ranked[: max(0, count)]]


def probe_ids(model: Any, tokens: int = PROBE_TOKENS, seed: int = 0) -> tuple[torch.Tensor, int]:
    """The probe's input ``[bos] + s + s`` as ``ids [1, T]`` on the model's device, and the position
    of ``s[0]`` (``s``: ``tokens`` random ids from the middle of the vocabulary, clear of special ids;
    fewer where the model has fewer positions)."""
    config = model.config.get_text_config(decoder=True)
    vocab = config.vocab_size
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 4:
        tokens = min(tokens, (positions - 1) // 2)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    s = torch.randint(vocab // 10, vocab // 2, (tokens,), generator=gen)  # [n]
    bos = getattr(config, "bos_token_id", None)
    if bos is None:
        bos = getattr(model.config, "bos_token_id", None)
    head = [] if bos is None or isinstance(bos, list) else [int(bos)]
    ids = torch.tensor(head + s.tolist() + s.tolist(), device=device)[None]  # [1, T]
    return ids, len(head)


def _probe(model: Any, tokens: int, seed: int) -> torch.Tensor:
    config = model.config.get_text_config(decoder=True)
    num_layers = config.num_hidden_layers
    ids, first = probe_ids(model, tokens, seed)  # first: position of s[0]
    tokens = (ids.shape[1] - first) // 2  # (fewer where the model has fewer positions)
    previous = attn_implementation(model)
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    maps = [a for a in out.attentions if a is not None]
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    attending = [i for i, t in enumerate(types) if t in ATTENTION]
    if len(maps) != len(attending):
        raise ValueError(
            f"retrieval_layers: the probe got {len(maps)} attention maps for {len(attending)} attention "
            f"layers of {getattr(config, 'model_type', '?')}; set retrieval_layers: 0 for this model"
        )
    heads = maps[0].shape[1]
    scores = torch.zeros(num_layers, heads)
    i = torch.arange(tokens - 1)
    rows = first + tokens + i  # second copy, s[i]
    for layer, a in zip(attending, maps, strict=True):
        a = a[0].float()  # [H, T, T]
        echo = a[:, rows, first + i].mean(-1)  # [H]
        induction = a[:, rows, first + i + 1].mean(-1)  # [H]
        scores[layer] = torch.maximum(echo, induction).cpu()
    return scores


def attn_implementation(model: Any) -> str | dict:
    impl = getattr(model.config, "_attn_implementation", None)
    return impl if impl is not None else "sdpa"
