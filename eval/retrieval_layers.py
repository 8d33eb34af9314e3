"""Retrieval layers: the layers whose keys a quantized cache must keep finer to retrieve from long context.

Passkey retrieval at low bits fails on the keys, and on few layers. On SmolLM2 at 4,096 tokens (6
prompts): ``tcq2-recent`` answers 2 / 6; with full-precision values still 1 / 6, with full-precision
keys 6 / 6, and with full-precision keys in layer 18 alone 5 / 6. The keys of that layer look like
every other layer's to the quantizer (the same relative error, kurtosis and offsets): what differs
is that a retrieval head reads them. So the layers cannot be found from the keys: they are found by
asking the model, once per model, like a key map.

:func:`find_retrieval_layers` runs a greedy search on synthetic passkey prompts
(:mod:`kvquant.eval.retrieval`; a seed other than the evaluation's, so the evaluation stays held out).
Each prompt's haystack is prefilled once through a ``DynamicCache``; every candidate cache is filled
from those keys and values (the call a prefill makes) and scored by the question call alone: the
margin of the true answer's first token (its logit less the largest other), capped at the
full-precision cache's margin on that prompt (a prompt the cache already answers as well as full
precision cannot hide another it fails). Each round adds the layer whose keys, in ``protect_format``,
raise the mean capped margin most, until it is within ``tolerance`` of the full-precision mean or
``max_layers`` are chosen. The result is the cache's config with those
layers' ``key_format`` overridden (:attr:`KVQuantConfig.layer_overrides`).

:func:`find_retrieval_count` answers the other question, for the probed retrieval layers
(:mod:`kvquant.retrieval_heads`, ``KVQuantConfig.retrieval_layers``): how many of the probe's top
layers a config needs, scored the same way on the same kind of prompts.

Example:
    >>> found = find_retrieval_layers(model, tok, KVQuantConfig.resolve("tcq2-recent"))
    >>> found.layers, found.config.layer_overrides
    ([18, ...], {18: {'key_format': 'nuq4'}, ...})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from kvquant.cache import KVQuantCache
from kvquant.config import KVQuantConfig
from kvquant.eval.retrieval import answer_first_token, passkey_cases, passkey_prompt, token_margin


@dataclasses.dataclass
class RetrievalLayers:
    """What :func:`find_retrieval_layers` found.

    Attributes:
        layers: the chosen layer indices, in the order they were added.
        config: the input config with those layers' ``key_format`` set to the protected format.
        reference: mean first-token margin of the full-precision cache over the prompts.
        margins: mean capped margin after each round (``margins[0]``: the input config); at most
            ``reference``.
        gains: per round, ``{layer: mean capped margin}`` of every candidate tried.
    """

    layers: list[int]
    config: KVQuantConfig
    reference: float
    margins: list[float]
    gains: list[dict[int, float]]


@dataclasses.dataclass
class _Prompt:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [1, H, n, D] of the haystack
    question: torch.Tensor  # [1, q] ids
    first: int  # the true answer's first token


# The searches' defaults, also those of ``kvquant calibrate --retrieval`` / ``--retrieval-count``.
SEARCH_TRIALS = 4  # find_retrieval_layers: passkey prompts
SEARCH_MAX_LAYERS = 3  # find_retrieval_layers: layers chosen at most
COUNT_TRIALS = 5  # find_retrieval_count: passkey prompts
COUNT_MAX = 6  # find_retrieval_count: the largest count tried


@torch.no_grad()
def find_retrieval_layers(
    model: Any,
    tokenizer: Any,
    config: KVQuantConfig,
    *,
    length: int = 4096,
    trials: int = SEARCH_TRIALS,
    digits: int = 5,
    seed: int = 1,
    protect_format: str = "nuq4",
    max_layers: int = SEARCH_MAX_LAYERS,
    tolerance: float = 0.1,
    progress: Callable[[str], None] | None = None,
) -> RetrievalLayers:
    """Layers whose keys ``config`` should keep in ``protect_format`` for passkey retrieval (see the
    module docstring).

    Args:
        model: a causal LM (its attention implementation is the one scored).
        config: the cache config to protect; layers it already stores keys of in ``protect_format``
            or finer are still candidates (the margin decides).
        length: tokens per prompt (at most the model's context).
        trials: prompts, at depths ``(i + 0.5) / trials`` of the haystack.
        seed: prompt seed; the evaluation (``kvquant eval --tasks retrieval``) uses 0.
        protect_format: the key format of a chosen layer (one of :data:`kvquant.formats.FORMAT_NAMES`).
        max_layers: at most this many layers are chosen.
        tolerance: stop once the mean margin is within this many logits of the full-precision one.
        progress: called with one line per round.

    Returns:
        A :class:`RetrievalLayers`.
    """
    n_layers = model.config.num_hidden_layers
    dataclasses.replace(config, key_format=protect_format)  # validates the format, before the long part
    if max_layers < 0:
        raise ValueError(f"max_layers: expected an integer >= 0, got {max_layers}")
    prompts = [_prefill(model, tokenizer, case) for case in passkey_cases([length], trials, digits, seed)]
    full = _margins(model, prompts, lambda: DynamicCache(config=model.config))  # [prompts]
    reference = sum(full) / len(full)

    def score(build: Callable[[], Any]) -> float:
        return sum(min(m, r) for m, r in zip(_margins(model, prompts, build), full, strict=True)) / len(full)

    chosen: list[int] = []
    current = config
    margins = [score(lambda: KVQuantCache(model, current))]
    gains: list[dict[int, float]] = []
    if progress:
        progress(f"full precision {reference:+.3f}; {config.name} {margins[0]:+.3f}")
    while len(chosen) < max_layers and margins[-1] < reference - tolerance:
        tried = {}
        for layer in range(n_layers):
            if layer in chosen:
                continue
            cand = _protected(current, layer, protect_format)
            tried[layer] = score(lambda c=cand: KVQuantCache(model, c))
        best = max(tried, key=tried.__getitem__)
        gains.append(tried)
        if tried[best] <= margins[-1]:  # no layer helps: stop rather than spend bits
            break
        chosen.append(best)
        current = _protected(current, best, protect_format)
        margins.append(tried[best])
        if progress:
            progress(f"round {len(chosen)}: layer {best} -> {tried[best]:+.3f}")
    return RetrievalLayers(chosen, current, reference, margins, gains)


@dataclasses.dataclass
class RetrievalCount:
    """What :func:`find_retrieval_count` found for one config.

    Attributes:
        count: the chosen ``retrieval_layers``.
        config: the input config with ``retrieval_layers=count``.
        reference: per prompt, the full-precision cache's first-token margin.
        margins: ``{count: per-prompt margins}`` of every count tried.
    """

    count: int
    config: KVQuantConfig
    reference: list[float]
    margins: dict[int, list[float]]

    def capped(self, count: int) -> float:
        """Mean margin of ``count`` over the prompts, each capped at full precision's."""
        pairs = zip(self.margins[count], self.reference, strict=True)
        return sum(min(m, r) for m, r in pairs) / len(self.reference)

    def answered(self, count: int) -> int:
        """Prompts whose true first token leads (margin > 0) with ``count`` retrieval layers."""
        return sum(m > 0 for m in self.margins[count])


@torch.no_grad()
def find_retrieval_count(
    model: Any,
    tokenizer: Any,
    configs: list[KVQuantConfig],
    *,
    lengths: tuple[int, ...] = (4096,),
    trials: int = COUNT_TRIALS,
    digits: int = 5,
    seed: int = 1,
    max_count: int = COUNT_MAX,
    tolerance: float = 0.1,
    progress: Callable[[str], None] | None = None,
) -> list[RetrievalCount]:
    """How many probed retrieval layers (``KVQuantConfig.retrieval_layers``) each config needs.

    The probe (:mod:`kvquant.retrieval_heads`) orders the layers; this picks the count on passkey
    prompts of ``seed`` (not the evaluation's 0), prefilled once and shared by every config. Each
    count from 0 to ``max_count`` is scored by the mean first-token margin over the prompts, each
    capped at full precision's (a prompt answered by more than full precision cannot hide one that
    fails); the chosen count is the smallest within ``tolerance`` of the best count's score: where the
    margin stops growing. Whether each prompt is answered is not the criterion: a prompt that full
    precision itself answers narrowly flips either way with any change of the quantization noise.
    The first token is all it scores: digits copied wrong after it (``kivi2`` without sinks) show in
    whole answers only (``python -m kvquant.eval.passkey_long --seed 1``).

    Args:
        model: a causal LM the probe can read (eager attention available).
        configs: the cache configs; their own ``retrieval_layers`` is replaced.
        lengths: prompt lengths, each with ``trials`` prompts at depths ``(i + 0.5) / trials``.

    Returns:
        One :class:`RetrievalCount` per config, in order.

    Example:
        >>> [r.count for r in find_retrieval_count(model, tok, [KVQuantConfig.resolve("tcq2-recent")])]
        [3]
    """
    if max_count < 0:
        raise ValueError(f"max_count: expected an integer >= 0, got {max_count}")
    counts = range(min(max_count, model.config.num_hidden_layers) + 1)
    for config in configs:  # a format the config cannot hold raises here, before the long part
        dataclasses.replace(config, retrieval_layers=counts[-1])
    prompts = [
        _prefill(model, tokenizer, case) for case in passkey_cases(list(lengths), trials, digits, seed)
    ]
    full = _margins(model, prompts, lambda: DynamicCache(config=model.config))  # [prompts]
    if progress:
        progress(f"full precision: {sum(m > 0 for m in full)}/{len(full)} answered, margins {_fmt(full)}")
    found = []
    for config in configs:
        r = RetrievalCount(0, config, full, {})
        for n in counts:
            cfg = dataclasses.replace(config, retrieval_layers=n)
            r.margins[n] = _margins(model, prompts, lambda c=cfg: KVQuantCache(model, c))
            if progress:
                progress(f"{config.name} retrieval_layers={n}: {_fmt(r.margins[n])}")
        best = max(r.capped(n) for n in counts)
        r.count = min(n for n in counts if r.capped(n) >= best - tolerance)
        r.config = dataclasses.replace(config, retrieval_layers=r.count)
        found.append(r)
    return found


def _fmt(margins: list[float]) -> str:
    return " ".join(f"{m:+.2f}" for m in margins)


def _protected(config: KVQuantConfig, layer: int, fmt: str) -> KVQuantConfig:
    over = {i: dict(f) for i, f in config.layer_overrides.items()}
    over[layer] = {**over.get(layer, {}), "key_format": fmt}
    return dataclasses.replace(config, layer_overrides=dict(sorted(over.items())))


def _prefill(model: Any, tokenizer: Any, case: dict[str, Any]) -> _Prompt:
    device = next(model.parameters()).device
    ids, q_len = passkey_prompt(tokenizer, case["length"], case["key"], case["depth"])
    cache = (
        DynamicCache()
    )  # no config: every layer keeps every token (sliding ones too), as a prefill hands them
    model(input_ids=ids.to(device)[None, :-q_len], cache=cache, use_cache=True, logits_to_keep=1)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return _Prompt(kv, ids.to(device)[None, -q_len:], answer_first_token(tokenizer, case["key"]))


def _margins(model: Any, prompts: list[_Prompt], build: Callable[[], Any]) -> list[float]:
    margins = []
    for p in prompts:
        cache = build()
        for i, (k, v) in enumerate(p.kv):  # the update a prefill makes, from the same keys / values
            cache.update(k, v, i)
        out = model(input_ids=p.question, cache=cache, use_cache=True, logits_to_keep=1)
        margins.append(token_margin(out.logits[0, -1], p.first))
    return margins
