"""kvquant inside the evaluation tools users already run (optional extras; nothing here is imported
by the rest of kvquant).

- :mod:`kvquant.integrations.lm_eval_model`: lm-evaluation-harness model ``kvquant`` (extra
  ``lmeval``); ``kvquant-lm-eval`` is lm-eval's command line with that model registered.
- ``kvquant_cache_quality.py`` (:data:`CACHE_QUALITY_METRIC`, its path): Hugging Face ``evaluate``
  metric of cache quality, a thin wrapper of :func:`kvquant.eval.quality.compare` (extra
  ``evaluate``), loaded by path and offline::

      >>> import evaluate
      >>> from kvquant.integrations import CACHE_QUALITY_METRIC
      >>> metric = evaluate.load(CACHE_QUALITY_METRIC)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

CACHE_QUALITY_METRIC = str(Path(__file__).with_name("kvquant_cache_quality.py"))
"""Path of the ``evaluate`` metric module (installed with the package): ``evaluate.load(it)``."""


def lm_eval_main(argv: Sequence[str] | None = None) -> None:
    """``kvquant-lm-eval``: lm-eval's command line (same arguments) with model ``kvquant`` registered.

    Example::

        kvquant-lm-eval --model kvquant --model_args pretrained=smollm2,cache=int4 --tasks T --include_path D
    """
    try:
        from lm_eval.__main__ import cli_evaluate

        import kvquant.integrations.lm_eval_model  # noqa: F401  (registers "kvquant")
    except ImportError as exc:
        print(
            f"kvquant-lm-eval: error: needs lm-eval ({exc}); pip install 'kvquant[lmeval]'", file=sys.stderr
        )
        sys.exit(2)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
