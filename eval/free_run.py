"""Free-running generation: how far a cache's own greedy output drifts from full precision.

Teacher forcing (:mod:`kvquant.eval.decode`) feeds every cache the reference tokens, so an error never
compounds: a cache that changes one greedy token and then wanders off scores as well as one that
changes that token and comes back. Here each cache generates on its own: from a prompt of the corpus,
``tokens`` greedy tokens with the cache in the loop (``model.generate`` greedy: prompt prefilled into
the cache, then one token per call, no stop at end-of-text). The full-precision model then scores each continuation: the
log-probs of the generated tokens given the prompt and the tokens before them, from one forward of
``prompt + continuation`` without a cache (:func:`~kvquant.eval.decode.single_pass_logprobs`: the
same predictions as a DynamicCache fed the tokens one by one).

Per cache, against DynamicCache's own greedy continuation of the same prompt:

``ppl_dynamic``          full-precision perplexity of DynamicCache's continuation (its own output: low)
``ppl``                  full-precision perplexity of the cache's continuation
``ppl_ratio``            ``ppl / ppl_dynamic`` (1.0: as likely as full precision's own text)
``first_divergence``     mean over prompts of the first position where the two continuations differ
                         (``tokens`` when they never do)
``identical_fraction``   fraction of positions holding the same token in both continuations

Example:
    >>> prompts = make_windows(ids, 256, 256, 1)[:, :256]                     # [1, 256]
    >>> ref = greedy_continuations(model, prompts, lambda: DynamicCache(config=model.config), 256)
    >>> got = greedy_continuations(model, prompts, lambda: KVQuantCache(model, "nuq2"), 256)
    >>> free_run_numbers(model, prompts, ref, got)["first_divergence"]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvquant.eval.decode import single_pass_logprobs


@torch.no_grad()
def greedy_continuation(model: Any, prompt: torch.Tensor, cache: Any, tokens: int) -> torch.Tensor:
    """``[tokens]`` greedy ids after ``prompt [T]`` through ``cache``: ``model.generate`` greedy, with
    no end-of-text stop (``eos_token_id=None``: an end-of-text token is generated and run on)."""
    import warnings

    device = next(model.parameters()).device
    ids = prompt.to(device)[None]  # [1, T]
    with warnings.catch_warnings():  # generate's notes on the pad / eos tokens it was told to ignore
        warnings.simplefilter("ignore")
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
    return out[0, ids.shape[1] :].cpu()


def greedy_continuations(
    model: Any, prompts: torch.Tensor, build_cache: Callable[[], Any], tokens: int, progress: Any = None
) -> torch.Tensor:
    """``[P, tokens]``: :func:`greedy_continuation` of each prompt of ``prompts [P, T]``, a fresh cache each."""
    rows = progress(prompts) if progress is not None else prompts
    return torch.stack([greedy_continuation(model, p, build_cache(), tokens) for p in rows])


def continuation_nll(model: Any, prompts: torch.Tensor, continuations: torch.Tensor) -> torch.Tensor:
    """``[P]`` full-precision mean negative log-likelihood of each continuation given its prompt."""
    seq = torch.cat([prompts, continuations], dim=1)  # [P, T + N]
    t = prompts.shape[1]
    out = []
    for row in seq:
        logprobs = single_pass_logprobs(model, row[None], t)[0]  # [N, V]: prediction i scores row[t + i]
        out.append(-logprobs.gather(-1, row[t:, None].cpu()).mean())
    return torch.stack(out)


def free_run_numbers(
    model: Any,
    prompts: torch.Tensor,
    reference: torch.Tensor,
    continuations: torch.Tensor,
    reference_nll: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The numbers of the module docstring for ``continuations [P, N]`` against ``reference [P, N]``
    (DynamicCache's), both after ``prompts [P, T]``. ``reference_nll``: :func:`continuation_nll` of
    the reference, when already known."""
    if reference.shape != continuations.shape:
        raise ValueError(f"free_run: shapes differ: {tuple(reference.shape)} vs {tuple(continuations.shape)}")
    n = reference.shape[1]
    ref_nll = continuation_nll(model, prompts, reference) if reference_nll is None else reference_nll
    same = reference == continuations  # [P, N]
    if torch.equal(reference, continuations):
        nll = ref_nll
    else:
        nll = continuation_nll(model, prompts, continuations)
    first = [int((~row).nonzero()[0]) if not bool(row.all()) else n for row in same]
    ppl_dyn, ppl = ref_nll.mean().exp().item(), nll.mean().exp().item()
    return {
        "prompts": int(prompts.shape[0]),
        "prompt_len": int(prompts.shape[1]),
        "tokens": n,
        "ppl_dynamic": ppl_dyn,
        "ppl": ppl,
        "ppl_ratio": ppl / ppl_dyn,
        "first_divergence": sum(first) / len(first),
        "first_divergence_each": first,
        "identical_fraction": same.float().mean().item(),
    }
