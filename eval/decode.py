"""Quality with the cache in the loop: teacher-forced decoding, one token per forward call.

``teacher_forced_logprobs`` prefills ``prefix_len`` tokens, then feeds the reference tokens one at a
time, exactly as generation would, and returns the log-probabilities of every prediction. Comparing
two caches on the same tokens gives KL divergence, top-1 agreement and perplexity.

``simulated_logprobs`` is the fast screen: one forward over the whole window through a cache whose
``update`` returns the keys / values quantize-dequantized, the call's own tokens included (see
:func:`kvquant.eval.caches.simulate_quantization`). It differs from decoding in what each query sees:
in decode mode the prefill attends to full-precision K/V (so prediction 0 is never affected) and each
decoded query sees its own token and the cache's full-precision residual window unquantized; in
simulated mode every query sees every token, itself included, as stored, and the full-precision
residual / sink tokens are those of the whole window (its last ``residual_length`` tokens), not of
each query. transformers' QuantizedCache keeps its 128-token full-precision residual in decode mode
but quantizes everything in simulated mode. Use decode mode for the numbers you report.

Example:
    >>> ids = tok(text, return_tensors="pt").input_ids[:, :768]         # [1, P + N]
    >>> base = teacher_forced_logprobs(model, ids, 512, DynamicCache(config=model.config))
    >>> quant = teacher_forced_logprobs(model, ids, 512, KVQuantCache(model, "int8"))
    >>> compare(base, quant, ids[:, 512:])["kl_mean"]   # kvquant.eval.quality.compare
"""

from __future__ import annotations

from typing import Any

import torch

from kvquant.eval.caches import simulate_quantization


@torch.no_grad()
def teacher_forced_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    prefix_len: int,
    cache: Any,
    *,
    progress: Any | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[B, N, V]`` (fp32, CPU) of tokens ``prefix_len .. prefix_len + N - 1``.

    ``input_ids[B, P + N]``: the prefix is prefilled in one call; then each of the N - 1 following
    reference tokens is fed alone, through ``cache``. Prediction ``i`` scores token
    ``input_ids[:, P + i]``.
    """
    total = input_ids.shape[1]
    if not 0 < prefix_len < total:
        raise ValueError(f"prefix_len: {prefix_len} must be in [1, {total - 1}] for {total} tokens")
    device = next(model.parameters()).device
    out = model(input_ids=input_ids[:, :prefix_len].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1].float().log_softmax(-1).cpu()  # [B, V]
    return continued_logprobs(model, input_ids, prefix_len, cache, first, progress=progress)


@torch.no_grad()
def continued_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    prefix_len: int,
    cache: Any,
    first: torch.Tensor,
    *,
    progress: Any | None = None,
) -> torch.Tensor:
    """The decode half of :func:`teacher_forced_logprobs`: ``cache`` already holds the prefix of
    ``input_ids[B, P + N]`` and ``first[B, V]`` is prediction 0's log-probs; feeds the N - 1 following
    reference tokens one at a time and returns ``[B, N, V]`` (fp32, CPU)."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    steps = [first]
    rng = range(prefix_len, ids.shape[1] - 1)
    for t in progress(rng) if progress is not None else rng:
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits[:, -1].float().log_softmax(-1).cpu())
    return torch.stack(steps, dim=1)


@torch.no_grad()
def single_pass_logprobs(model: Any, input_ids: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """The same predictions as :func:`teacher_forced_logprobs` from one full forward, no cache."""
    device = next(model.parameters()).device
    keep = input_ids.shape[1] - prefix_len + 1
    logits = model(input_ids=input_ids.to(device), use_cache=False, logits_to_keep=keep).logits
    return logits[:, -keep:-1].float().log_softmax(-1).cpu()


@torch.no_grad()
def simulated_logprobs(model: Any, input_ids: torch.Tensor, prefix_len: int, cache: Any) -> torch.Tensor:
    """The same predictions from one forward with K/V quantize-dequantized through ``cache`` (empty)."""
    device = next(model.parameters()).device
    keep = input_ids.shape[1] - prefix_len + 1
    cache = simulate_quantization(cache)
    logits = model(input_ids=input_ids.to(device), cache=cache, use_cache=True, logits_to_keep=keep).logits
    return logits[:, -keep:-1].float().log_softmax(-1).cpu()
