"""Evaluation harness for kvquant, installed as ``kvquant.eval`` (never as a top-level ``eval``).

Quality (perplexity, KL, top-1 agreement against a full-precision baseline, in ``decode`` or
``simulated`` mode), long-context passkey retrieval, memory (bytes held per token, peak) and speed
(prefill, decode tokens/s) of any cache config on any Hugging Face causal LM. See ``eval/README.md``.

Example:
    >>> from kvquant.eval import run_eval
    >>> result = run_eval(overrides={"caches": ["dynamic", "int4"], "speed.enabled": False})
    >>> print(result.table)          # also in result.run_dir / "results.md"
"""

from kvquant.eval.caches import (
    CacheSpec,
    cache_nbytes,
    resolve_specs,
    simulate_quantization,
    theoretical_bits,
)
from kvquant.eval.config import EvalConfig, EvalError, config_names, load_config
from kvquant.eval.decode import simulated_logprobs, single_pass_logprobs, teacher_forced_logprobs
from kvquant.eval.memory import PeakMemory, measure_memory
from kvquant.eval.quality import compare
from kvquant.eval.retrieval import passkey_accuracy
from kvquant.eval.runner import EvalResult, run_eval
from kvquant.eval.speed import measure_speed

__all__ = [
    "CacheSpec",
    "EvalConfig",
    "EvalError",
    "EvalResult",
    "PeakMemory",
    "cache_nbytes",
    "compare",
    "config_names",
    "load_config",
    "measure_memory",
    "measure_speed",
    "passkey_accuracy",
    "resolve_specs",
    "run_eval",
    "simulate_quantization",
    "simulated_logprobs",
    "single_pass_logprobs",
    "teacher_forced_logprobs",
    "theoretical_bits",
]
