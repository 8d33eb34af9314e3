"""lm-evaluation-harness model ``kvquant``: Hugging Face models evaluated with a quantized KV cache.

Importing this module registers ``kvquant`` with lm-eval (``@register_model``); lm-eval finds no
third-party model by itself, so run it through ``kvquant-lm-eval`` (lm-eval's own command line with
this module imported first) or import this module before ``lm_eval.simple_evaluate``::

    kvquant-lm-eval --model kvquant --model_args pretrained=smollm2,cache=int4,dtype=float32 \\
        --tasks my_task --include_path ./tasks --device cpu

    >>> import lm_eval, kvquant.integrations.lm_eval_model  # noqa: F401  (registers "kvquant")
    >>> lm_eval.simple_evaluate(model="kvquant", model_args="pretrained=smollm2,cache=int4", tasks=[...])

``model_args`` are those of lm-eval's ``hf`` model plus ``cache``: a kvquant preset name (``none``,
``int8``, ``int4``, ``tcq3v2-recent``, ...), a cache YAML path, ``dynamic`` (transformers'
``DynamicCache``) or a transformers peer (``hf-quanto-int4``, ...); default ``none``, the
full-precision pass-through. ``pretrained=smollm2`` is the embedded SmolLM2-135M-Instruct (its weights
dequantized from a 4-bit GGUF).

What differs from ``hf``: ``hf`` scores a continuation with one forward over context + continuation
and no cache, so no quantized cache is ever read. Here every log-likelihood request prefills its
context into a fresh cache, then feeds the continuation one token at a time through that cache, as
generation would (:func:`kvquant.eval.decode.teacher_forced_logprobs`): each continuation token
attends to the context as the cache stores it. Rolling log-likelihoods (perplexity tasks) are the
same requests with a one-token context, so the whole text goes through the cache token by token.
Generation passes a fresh cache to ``model.generate``. Log-likelihood requests run one at a time
(``batch_size`` applies to generation only); with ``cache=none`` the numbers are those of ``hf``
within float tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from kvquant.eval.caches import CacheSpec, resolve_spec
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.models import EMBEDDED_ALIASES, ensure_embedded_copy


def continuation_logprob(
    model: Any, context: list[int], continuation: list[int], cache: Any
) -> tuple[float, bool]:
    """``(sum of log p(continuation | context), whether greedy decoding gives the continuation)``.

    ``context`` (at least one token) is prefilled into ``cache`` (empty); the continuation's tokens
    are then fed one at a time through it, so each one attends to the context as the cache stores it.
    """
    if not context or not continuation:
        raise ValueError(
            f"continuation_logprob: context and continuation need a token each; got "
            f"{len(context)} and {len(continuation)}"
        )
    ids = torch.tensor([context + continuation], dtype=torch.long)  # [1, P + C]
    logprobs = teacher_forced_logprobs(model, ids, len(context), cache)[0]  # [C, V]
    target = torch.tensor(continuation, dtype=torch.long)
    total = logprobs.gather(-1, target[:, None]).sum()
    return float(total), bool((logprobs.argmax(-1) == target).all())


@register_model("kvquant")
class KVQuantLM(HFLM):
    """lm-eval's ``HFLM`` with a kvquant (or transformers) cache in the loop; see the module docstring.

    Args:
        pretrained: a Hugging Face id, a local folder, a model object, or ``smollm2`` (embedded).
        cache: the cache spec (preset name, YAML path, ``dynamic``, a peer); ``None`` means ``none``.
        device: default ``cuda`` when available, else ``cpu``.
        **kwargs: the other ``hf`` model arguments (``dtype``, ``max_length``, ``batch_size``, ...).
    """

    def __init__(
        self, pretrained: Any = "smollm2", cache: str | None = "none", device: str | None = None, **kwargs
    ) -> None:
        # lm-eval reads model_args "cache=none" as None
        name = "none" if cache is None else str(cache)
        try:
            self.cache_spec: CacheSpec = resolve_spec(name)
        except ValueError as exc:
            raise ValueError(f"kvquant model_args cache={name}: {' '.join(str(exc).split())}") from None
        if isinstance(pretrained, str) and pretrained.lower() in EMBEDDED_ALIASES:
            pretrained = str(ensure_embedded_copy())
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"kvquant model: pretrained must be a causal LM (backend {self.backend!r})")

    def new_cache(self) -> Any:
        """A fresh, empty cache of ``self.cache_spec`` for this model."""
        return self.cache_spec.build(self.model)

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood, is greedy)`` per request, in order, each through its own cache."""
        out = []
        for request, context, continuation in tqdm(
            requests, disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood ({self.cache_spec.name})"
        ):
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"kvquant model: a continuation of {len(continuation)} tokens is longer than "
                    f"max_length {self.max_length}"
                )
            # as hf does: keep the last max_length + 1 tokens (the last one is only scored)
            tokens = (context + continuation)[-(self.max_length + 1) :]
            split = len(tokens) - len(continuation)
            answer = continuation_logprob(self.model, tokens[:split], continuation, self.new_cache())
            out.append(answer)
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return out

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """``HFLM._model_generate`` with a fresh cache of ``self.cache_spec``."""
        return super()._model_generate(
            context, max_length=max_length, stop=stop, cache=self.new_cache(), **generation_kwargs
        )
