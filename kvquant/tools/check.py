"""``kvquant check``: a ~30-second preflight of one cache config on one model.

Teacher-forced decode-mode KL / Δppl / top-1 against DynamicCache on short windows of the embedded
corpus, the bits the cache holds, and a warning with the numbers when the config is risky for the
model (:func:`kvquant.eval.preflight.risk_warning`). Exit status: 0 when fine, and also 0 when risky
(the warning is printed) unless ``--strict``, which makes a risky config exit 1; bad input exits 2.

Example::

    kvquant check --cache nuq2                 # embedded SmolLM2; prints the numbers and a warning
    kvquant check --cache my.yaml --strict     # exit 1 when risky (for scripts / CI)
"""

from __future__ import annotations

import time
from typing import Any

from kvquant.eval.caches import resolve_spec
from kvquant.eval.preflight import MAX_KL, MIN_TOP1, preflight, risk_warning
from kvquant.eval.runner import check_context, model_max_context
from kvquant.models import load_model, weights_label
from kvquant.tools.arguments import flagged


def format_result(res: dict[str, Any]) -> list[str]:
    """The lines ``kvquant check`` prints for a :func:`~kvquant.eval.preflight.preflight` result."""
    q = res["quality"]
    fmt = res["bits_format"]
    return [
        f"  mean KL {q['kl_mean']:.4f} (p90 {q['kl_p90']:.4f}, p99 {q['kl_p99']:.4f}), "
        f"top-1 {100 * q['top1_agreement']:.1f}%, ppl {q['ppl_base']:.3f} -> {q['ppl']:.3f} "
        f"(Δppl {q['delta_ppl']:+.3f}, {100 * q['delta_ppl_rel']:+.2f}%) over {q['tokens']} tokens",
        f"  bits per K/V element: {res['bits_16bit']:.2f} held by a 16-bit model after "
        f"{res['held_tokens']} tokens (scales, sinks, full-precision tokens included)"
        + ("" if fmt is None else f"; the format alone {fmt:.2f}"),
    ]


def run(
    model_name: str | None,
    cache: str,
    *,
    strict: bool = False,
    prefix_len: int,
    score_len: int,
    windows: int,
) -> int:
    spec = flagged("--cache", resolve_spec, cache)  # before the model loads
    start = time.perf_counter()
    model, tok = flagged("--model", load_model, model_name)
    label = weights_label(model_name)
    print(f"loaded {label} in {time.perf_counter() - start:.1f} s")
    check_context("--prefix-len + --tokens", prefix_len + score_len, model_max_context(model))
    print(
        f"check {spec.name}: {windows} window(s) of {prefix_len} prefilled + {score_len} teacher-forced "
        "tokens of the embedded corpus, decode mode, against DynamicCache"
    )
    res = flagged(
        "--windows", preflight, model, tok, spec, prefix_len=prefix_len, score_len=score_len, windows=windows
    )
    for line in format_result(res):
        print(line)
    warning = risk_warning(res["quality"], spec.name, model_name or "smollm2")
    if warning:
        print(warning)
    else:
        print(f"  ok: mean KL <= {MAX_KL:g} and top-1 >= {100 * MIN_TOP1:g}%")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 1 if strict and warning else 0
