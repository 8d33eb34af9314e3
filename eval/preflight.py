"""The short preflight check of one cache config on one model, and the risk warning it shares.

:func:`preflight` is ``kvquant check`` (and ``kvquant demo --check``): a few short windows of the
embedded corpus, teacher-forced with the cache in the loop (decode mode: the prefix prefilled into the
cache, then the reference tokens fed one at a time, :func:`~kvquant.eval.decode.teacher_forced_logprobs`)
through DynamicCache and through the cache under test, compared by
:func:`~kvquant.eval.quality.compare`. The defaults (:data:`PREFIX_LEN`, :data:`SCORE_LEN`,
:data:`WINDOWS`) keep it near 30 s on a 2-core CPU with the embedded SmolLM2, model load included.

:func:`risk_warning` is the one place that decides when a config is risky for a model. It reads the
dict :func:`compare` returns, so ``kvquant check``, ``kvquant demo`` and ``kvquant sweep`` (from the
quality numbers it measures anyway) print the same line. A config is risky when either

- mean KL(full precision || cache) > :data:`MAX_KL` (0.02): about where 4-bit per-token ``int4`` and
  ``nuq3`` sit on WikiText-2 (README, quality table); above it the table's caches lose 5-25% ppl; or
- top-1 agreement < :data:`MIN_TOP1` (90%): more than one greedy token in ten changes. Every cache of
  the README's table below 90% (hqq int4, ``k3v2``, ``nuq2-recent``, ``nuq2``, the int2 peers) costs
  at least +5% perplexity, and greedy output that differs every ~10 tokens drifts within a sentence.

A short check is noisy: over ``n`` scored tokens top-1 has a binomial standard error of about
``sqrt(0.9 * 0.1 / n)`` (3.1 points at n = 96), which the warning states.

Example:
    >>> res = preflight(model, tok, "nuq2")                   # a CacheSpec or a spec string
    >>> res["quality"]["kl_mean"], res["bits_16bit"]
    >>> print(risk_warning(res["quality"], "nuq2") or "fine")
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from kvquant.eval.caches import (
    CacheSpec,
    cache_nbytes_16bit,
    fp16_bytes_per_token,
    resolve_spec,
    theoretical_bits,
)
from kvquant.eval.config import CorpusSection, EvalError
from kvquant.eval.corpus import load_corpus, make_windows, tokenize
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.eval.quality import compare
from kvquant.eval.runner import check_context, model_max_context

MAX_KL = 0.02
MIN_TOP1 = 0.90
PREFIX_LEN = 256
SCORE_LEN = 32
WINDOWS = 3


def risk_reasons(
    quality: dict[str, Any], max_kl: float | None = None, min_top1: float | None = None
) -> list[str]:
    """What makes ``quality`` (a :func:`compare` dict) risky, one phrase per broken bound; ``[]`` when
    fine. A missing or NaN number breaks no bound. Bounds default to :data:`MAX_KL`, :data:`MIN_TOP1`."""
    max_kl = MAX_KL if max_kl is None else max_kl
    min_top1 = MIN_TOP1 if min_top1 is None else min_top1
    out = []
    kl, top1 = quality.get("kl_mean"), quality.get("top1_agreement")
    if kl is not None and not math.isnan(kl) and kl > max_kl:
        out.append(f"mean KL {kl:.4f} > {max_kl:g}")
    if top1 is not None and not math.isnan(top1) and top1 < min_top1:
        out.append(f"top-1 {100 * top1:.1f}% < {100 * min_top1:g}%")
    return out


def risk_warning(
    quality: dict[str, Any],
    name: str,
    model: str | None = None,
    max_kl: float | None = None,
    min_top1: float | None = None,
) -> str | None:
    """One line saying why cache ``name`` is risky for ``model``, with its numbers; ``None`` when fine.

    >>> q = {"kl_mean": 0.15, "top1_agreement": 0.82, "delta_ppl_rel": 0.26, "tokens": 64}
    >>> risk_warning(q, "nuq2", "smollm2")
    'warning: cache nuq2 is risky for smollm2: mean KL 0.1500 > 0.02, top-1 82.0% < 90% (Δppl +26.0%, 64 tokens scored, top-1 ±3.8 points)'
    """
    reasons = risk_reasons(quality, max_kl, min_top1)
    if not reasons:
        return None
    who = f"cache {name} is risky" + (f" for {model}" if model else "")
    extra = []
    rel = quality.get("delta_ppl_rel")
    if rel is not None:
        extra.append(f"Δppl {100 * rel:+.1f}%")
    n = quality.get("tokens")
    if n:
        p = MIN_TOP1 if min_top1 is None else min_top1
        se = 100 * math.sqrt(p * (1 - p) / n)
        extra.append(f"{n} tokens scored, top-1 ±{se:.1f} points")
    tail = f" ({', '.join(extra)})" if extra else ""
    return f"warning: {who}: {', '.join(reasons)}{tail}"


@torch.no_grad()
def preflight(
    model: Any,
    tokenizer: Any,
    cache: CacheSpec | str,
    *,
    prefix_len: int = PREFIX_LEN,
    score_len: int = SCORE_LEN,
    windows: int = WINDOWS,
    corpus: CorpusSection | None = None,
) -> dict[str, Any]:
    """Teacher-forced decode-mode quality of ``cache`` against DynamicCache on short corpus windows.

    ``windows`` windows of ``prefix_len + score_len`` tokens of ``corpus`` (default: the embedded
    one), evenly spaced. Returns ``quality`` (the :func:`compare` dict over ``windows * score_len``
    predictions), ``bits_16bit`` (bits per K/V element a 16-bit model's cache holds after a window,
    scales, sinks and full-precision tokens included), ``bits_format`` (the format alone), the
    settings, ``seconds`` and ``warning`` (:func:`risk_warning`, ``None`` when fine).
    """
    for name, value in (("prefix_len", prefix_len), ("score_len", score_len), ("windows", windows)):
        if not isinstance(value, int) or value < (2 if name == "score_len" else 1):
            raise EvalError(
                f"{name}: expected an integer >= {2 if name == 'score_len' else 1}, got {value!r}"
            )
    spec = resolve_spec(cache) if isinstance(cache, str) else cache
    check_context("prefix_len + score_len", prefix_len + score_len, model_max_context(model))
    start = time.perf_counter()
    corpus = corpus or CorpusSection()
    text = load_corpus(corpus).text
    ids = make_windows(tokenize(tokenizer, text), prefix_len, score_len, windows, corpus.name)  # [W, P + D]
    dynamic = resolve_spec("dynamic")
    base, test, held = [], [], None
    for window in ids:
        base.append(teacher_forced_logprobs(model, window[None], prefix_len, dynamic.build(model)))
        built = spec.build(model)
        test.append(teacher_forced_logprobs(model, window[None], prefix_len, built))
        held = built
    quality = compare(torch.cat(base), torch.cat(test), ids[:, prefix_len:])
    tokens = held.get_seq_length()
    return {
        "cache": spec.name,
        "quality": quality,
        "bits_16bit": 16.0 * cache_nbytes_16bit(held) / tokens / fp16_bytes_per_token(model),
        "bits_format": theoretical_bits(spec, model),
        "held_tokens": tokens,
        "prefix_len": prefix_len,
        "score_len": score_len,
        "windows": windows,
        "seconds": time.perf_counter() - start,
        "warning": risk_warning(quality, spec.name),
    }
