"""Cache quality from two sets of next-token log-probabilities: the one implementation.

:func:`compare` is what every quality number of kvquant goes through: the harness
(:mod:`kvquant.eval.runner`), ``kvquant demo``, and the Hugging Face ``evaluate`` metric shipped as
``kvquant/integrations/kvquant_cache_quality.py`` (a thin wrapper). :func:`kl_per_prediction` is its
KL term alone (``kvquant tune`` ranks layers by its mean).

Example:
    >>> base = torch.randn(1, 8, 50).log_softmax(-1)        # [B, N, V] reference log-probs
    >>> targets = torch.randint(0, 50, (1, 8))                 # [B, N] the scored tokens
    >>> m = compare(base, base, targets)                      # same caches: KL 0, same perplexity
    >>> m["kl_mean"], m["top1_agreement"], m["delta_ppl"]
    (0.0, 1.0, 0.0)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_per_prediction(base: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """KL(base || test) of each prediction, ``[...]`` from log-probs ``[..., V]`` (clamped at 0)."""
    return F.kl_div(test, base, log_target=True, reduction="none").sum(-1).clamp_min(0)


def compare(base: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """KL(base || test) per prediction (mean, p90, p99), top-1 agreement and both perplexities.

    ``base``, ``test``: log-probabilities ``[B, N, V]`` (the reference and the cache under test, on
    the same tokens); ``targets``: the scored tokens ``[B, N]`` (any shape with ``B * N`` elements).
    Returns ``kl_mean``, ``kl_p90``, ``kl_p99``, ``top1_agreement`` (argmax of both equal),
    ``ppl_base``, ``ppl``, ``delta_ppl`` (``ppl - ppl_base``), ``delta_ppl_rel`` and ``tokens``.
    """
    if base.shape != test.shape or base.dim() != 3:
        raise ValueError(
            f"compare: base and test must be log-probs of one shape [B, N, V]; got "
            f"{tuple(base.shape)} and {tuple(test.shape)}"
        )
    if targets.numel() != base.shape[0] * base.shape[1]:
        raise ValueError(
            f"compare: targets must hold one token per prediction ({base.shape[0] * base.shape[1]}); "
            f"got {targets.numel()}"
        )
    kl = kl_per_prediction(base, test).flatten()  # [B*N]
    targets = targets.reshape(base.shape[:2]).to(base.device)
    nll_base = -base.gather(-1, targets[..., None]).mean()
    nll_test = -test.gather(-1, targets[..., None]).mean()
    ppl_base, ppl_test = nll_base.exp().item(), nll_test.exp().item()
    return {
        "kl_mean": kl.mean().item(),
        "kl_p90": kl.quantile(0.9).item(),
        "kl_p99": kl.quantile(0.99).item(),
        "top1_agreement": (base.argmax(-1) == test.argmax(-1)).float().mean().item(),
        "ppl_base": ppl_base,
        "ppl": ppl_test,
        "delta_ppl": ppl_test - ppl_base,
        "delta_ppl_rel": ppl_test / ppl_base - 1.0,
        "tokens": int(kl.numel()),
    }
