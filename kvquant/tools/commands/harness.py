"""``kvquant eval`` and ``kvquant sweep``: the harness's two commands. Their flags are derived
from the config dataclasses (:mod:`kvquant.eval.flags`): a new field is a new flag.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys


def _overrides(args: argparse.Namespace, cls: type) -> dict:
    """``--set``, then ``--tasks``, then the flags derived from ``cls``: later wins. A quality-budget
    flag replaces the YAML's whole budget (``--budget-dppl 1`` drops its ``max_kl``)."""
    from kvquant.eval.config import parse_set
    from kvquant.eval.flags import config_overrides, tasks_overrides

    overrides = parse_set(args.set or [])
    if getattr(args, "tasks", None) is not None:
        overrides |= tasks_overrides(args.tasks)
    flags = config_overrides(args, cls)
    if any(key.startswith("recommend.") for key in flags):
        overrides |= {"recommend.max_kl": None, "recommend.max_dppl_pct": None}
    return overrides | flags


@contextlib.contextmanager
def _messages(command: str, level: int):
    """The harness's log messages on stderr, as ``kvquant <command>: ...``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"kvquant {command}: %(message)s"))
    log = logging.getLogger("kvquant.eval")
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _set_flag(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override any key, e.g. {example}")


def _cmd_eval(args: argparse.Namespace) -> int:
    from kvquant.eval import EvalConfig, load_config, run_eval

    with _messages("eval", logging.INFO):
        result = run_eval(load_config(args.config, _overrides(args, EvalConfig)))
    print(result.table)
    print(f"\nresults: {result.run_dir}")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.config import TASKS, EvalConfig
    from kvquant.eval.flags import add_config_flags

    p = sub.add_parser(
        "eval",
        help="quality, retrieval, memory and speed of cache configs against DynamicCache",
        description="Settings: dataclass defaults -> --config YAML -> --set KEY=VALUE -> --tasks -> "
        "the flags below. See eval/README.md.",
    )
    p.add_argument(
        "--config", default=None, help="YAML file, or a name shipped in configs/eval/ (e.g. default)"
    )
    _set_flag(p, "speed.repeats=5")
    p.add_argument("--tasks", help=f"comma-separated subset of {','.join(TASKS)} (default: all)")
    add_config_flags(p, EvalConfig)
    p.set_defaults(func=_cmd_eval)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from kvquant.eval.sweep import run_sweep
    from kvquant.eval.sweep_config import SweepConfig

    overrides = _overrides(args, SweepConfig)
    with _messages("sweep", logging.INFO if overrides.get("progress", True) else logging.WARNING):
        result = run_sweep(args.config, overrides=overrides)
    print(result.table)
    print()
    for rec in result.recommendations:
        print(("" if len(result.recommendations) == 1 else f"{rec['model']}: ") + rec["text"])
    if result.warnings:
        print()
        print("\n".join(result.warnings))
    print(f"\nresults: {result.out_dir} (results.md, results.csv, results.jsonl, plots/)")
    return 0


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.flags import add_config_flags
    from kvquant.eval.sweep_config import SweepConfig

    p = sub.add_parser(
        "sweep",
        help="cache configs x context lengths x batch sizes: table, plots and a recommendation",
        description="Settings: dataclass defaults (shown below) -> the sweep YAML -> --set KEY=VALUE -> "
        "the flags below; a --budget-* flag replaces the YAML's whole budget. "
        "See configs/sweep_default.yaml (every key, commented) and README.md.",
    )
    p.add_argument("config", help="sweep YAML, or a shipped name (default = configs/sweep_default.yaml)")
    _set_flag(p, "grid.contexts=[256]")
    add_config_flags(p, SweepConfig)
    p.set_defaults(func=_cmd_sweep)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant eval`` and ``kvquant sweep`` to the command's subparsers."""
    _add_eval(sub)
    _add_sweep(sub)
