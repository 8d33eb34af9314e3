"""``kvquant check``: the ~30-second preflight of one cache config on one model."""

from __future__ import annotations

import argparse

from kvquant.tools.arguments import (
    check_cache,
    int_at_least,
)


def _cmd_check(args: argparse.Namespace) -> int:
    from kvquant.tools.check import run

    check_cache("--cache", args.cache)
    return run(
        args.model,
        args.cache,
        strict=args.strict,
        prefix_len=args.prefix_len,
        score_len=args.tokens,
        windows=args.windows,
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant check`` to the command's subparsers."""
    from kvquant.eval.preflight import MAX_KL, MIN_TOP1, PREFIX_LEN, SCORE_LEN, WINDOWS

    p = sub.add_parser(
        "check",
        help="~30 s preflight: teacher-forced KL / ppl / top-1 and bits of one cache config, risk warning",
        description="Teacher-forced decode-mode comparison of one cache config against DynamicCache on "
        f"short windows of the embedded corpus. Warns when mean KL > {MAX_KL:g} or top-1 < "
        f"{100 * MIN_TOP1:g}%%. Exit status: 0 (also when risky, unless --strict: then 1); bad input 2.",
    )
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--cache", required=True, help="preset name or YAML path")
    p.add_argument("--strict", action="store_true", help="exit status 1 when the config is risky")
    p.add_argument(
        "--prefix-len",
        type=int_at_least(1),
        default=PREFIX_LEN,
        help=f"tokens prefilled per window (default {PREFIX_LEN})",
    )
    p.add_argument(
        "--tokens",
        type=int_at_least(2),
        default=SCORE_LEN,
        help=f"tokens teacher-forced and scored per window (default {SCORE_LEN})",
    )
    p.add_argument(
        "--windows", type=int_at_least(1), default=WINDOWS, help=f"corpus windows (default {WINDOWS})"
    )
    p.set_defaults(func=_cmd_check)
