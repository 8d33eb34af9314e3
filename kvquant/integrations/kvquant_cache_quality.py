"""Hugging Face ``evaluate`` metric: the quality of a KV cache from two sets of next-token log-probs.

A thin wrapper of :func:`kvquant.eval.quality.compare`, the function kvquant's harness reports with,
so the numbers are the harness's. It ships inside the kvquant package and loads offline by path
(``evaluate``'s hub metrics such as ``perplexity`` load their own model and cannot see a cache)::

    >>> import evaluate
    >>> from kvquant.integrations import CACHE_QUALITY_METRIC   # this file's path
    >>> metric = evaluate.load(CACHE_QUALITY_METRIC)
    >>> base = teacher_forced_logprobs(model, ids, 512, DynamicCache(config=model.config))    # [B, N, V]
    >>> test = teacher_forced_logprobs(model, ids, 512, KVQuantCache(model, "int4"))
    >>> V = base.shape[-1]
    >>> metric.compute(predictions=test.reshape(-1, V), references=base.reshape(-1, V),
    ...                targets=ids[:, 512:].reshape(-1))["kl_mean"]

One example is one scored position: ``predictions`` its log-probs through the cache under test
(``[V]``), ``references`` its log-probs through the reference cache (``[V]``), ``targets`` the token
that came next. ``add_batch`` works as for any metric.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
import torch

from kvquant.eval.quality import compare

_DESCRIPTION = """Quality of a quantized KV cache against a reference, from next-token log-probabilities
on the same tokens: KL(reference || test) per position (mean, p90, p99), top-1 agreement, the
perplexity of the scored tokens through each cache and its change. kvquant's harness numbers."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: per scored position, the log-probabilities over the vocabulary through the cache
        under test (list of float, length V).
    references: the same positions' log-probabilities through the reference cache (length V).
    targets: the token id that follows each position (int).
Returns:
    kl_mean, kl_p90, kl_p99: KL(reference || test) per position, mean and percentiles (nats).
    top1_agreement: share of positions whose most likely token is the same.
    ppl_base, ppl: perplexity of the targets through the reference / the cache under test.
    delta_ppl, delta_ppl_rel: ppl - ppl_base, and ppl / ppl_base - 1.
    tokens: number of positions.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class KvquantCacheQuality(evaluate.Metric):
    """``evaluate`` metric of KV-cache quality (see the module docstring)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float32")),
                    "references": datasets.Sequence(datasets.Value("float32")),
                    "targets": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, predictions, references, targets) -> dict[str, float]:
        sizes = {len(row) for row in predictions} | {len(row) for row in references}
        if len(sizes) != 1 or not predictions:
            raise ValueError(
                "kvquant_cache_quality: predictions and references must be one vocabulary-sized row "
                f"per position, all of one size; got sizes {sorted(sizes)}"
            )
        test = torch.from_numpy(np.asarray(predictions, dtype=np.float32))[None]  # [1, N, V]
        base = torch.from_numpy(np.asarray(references, dtype=np.float32))[None]
        return compare(base, test, torch.as_tensor(np.asarray(targets, dtype=np.int64)))
