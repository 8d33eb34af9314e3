"""The ``kvquant`` command.

Example::

    kvquant demo                      # embedded SmolLM2: generate with a KV cache, print the text
    kvquant demo --prompt "Hi" -n 16
    kvquant eval --cache int4 --corpus wikitext2   # quality/memory/speed

Subcommands are added with one ``_add_<name>`` function each, registered in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import pickle
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

# ------------------------------------------------------------------------------------------ errors

USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    yaml.YAMLError,
    pickle.UnpicklingError,
)
"""The exception types :func:`main` reports as bad input: one line ``kvquant <command>: error: ...`` on
stderr and exit status 2, no traceback (``kvquant --debug ...`` re-raises them).

Why these and no others:

- ``ValueError`` is how every layer of kvquant says "bad input": the config checks
  (``KVQuantConfig``), the harness (``EvalError``, ``SweepError``), the planner (``PlanError``), model
  loading (``load_model``: no such model), the benchmark settings, the calibration checks; and
  ``UnicodeDecodeError`` (a binary file where text was expected) is one. The checks word their
  messages to name the field or flag and the allowed values.
- ``FileNotFoundError``, ``FileExistsError``, ``IsADirectoryError``, ``NotADirectoryError``,
  ``PermissionError``: a path the user gave (an input file, an output folder) that is missing, of the
  wrong kind, or not writable. Other ``OSError``\ s (disk full, I/O errors) are the machine's, and
  are left to surface with their traceback.
- ``yaml.YAMLError`` and ``pickle.UnpicklingError``: a file the user named that is not YAML / not a
  torch file, wherever a loader let one through unwrapped.

Everything else (``TypeError``, ``KeyError``, ``IndexError``, ``AttributeError``, ``RuntimeError``,
``AssertionError`` ...) is taken for a bug in kvquant or below it and keeps its traceback (exit 1):
the bad inputs that used to end in one of those are now caught by checks that raise ``ValueError``.
``KeyboardInterrupt`` (Ctrl-C) prints one line and exits 130.
"""


def describe(exc: BaseException) -> str:
    """The one-line message of a user error."""
    if isinstance(exc, OSError) and exc.filename is not None:
        where = repr(str(exc.filename)) + (f" -> {str(exc.filename2)!r}" if exc.filename2 else "")
        return f"{where}: {(exc.strerror or type(exc).__name__).lower()}"
    if isinstance(exc, yaml.YAMLError):
        return f"not valid YAML ({' '.join(str(exc).split())})"
    if isinstance(exc, UnicodeDecodeError):
        return f"an input file is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, pickle.UnpicklingError):
        return f"an input file is not a readable torch file ({str(exc).strip().splitlines()[0][:160]})"
    return " ".join(str(exc).split()) or type(exc).__name__


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``kvquant <command>: error: <what>`` (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " ".join(message.split()).removeprefix("argument ")  # "--steps: expected ..."
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------------------------------ flag types


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def float_above(low: float, inclusive: bool = False) -> Callable[[str], float]:
    """argparse ``type``: a finite number > ``low`` (>= with ``inclusive``)."""
    want = f"a finite number {'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    return parse


def ints_at_least(low: int) -> Callable[[str], list[int]]:
    """argparse ``type``: a non-empty comma-separated list of integers >= ``low``."""
    one = int_at_least(low)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low}, got {text!r}")
        try:
            return [one(x) for x in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= {low}, got {text!r}"
            ) from None

    return parse


def _flagged(flag: str, fn: Callable, *args, **kwargs):
    """``fn(*args)``, its ``ValueError`` prefixed with the flag the value came from."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        msg = " ".join(str(exc).split()).removeprefix(f"{flag.lstrip('-')}: ")  # not "--corpus: corpus:"
        raise ValueError(f"{flag}: {msg}") from None


def check_output_file(flag: str, path: str) -> None:
    """An output file that can be written: not a folder, its folder created (before any slow work)."""
    from kvquant.eval.config import check_output_dir

    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag}: {path!r} is a folder; give a file name")
    check_output_dir(flag, out.parent)


def check_cache(flag: str, spec: str):
    """A cache config (preset name or YAML path) and its static-scales file, checked before the model
    loads; ``ValueError`` naming ``flag``."""
    from kvquant.config import KVQuantConfig
    from kvquant.eval.caches import check_static_scales

    cfg = _flagged(flag, KVQuantConfig.resolve, spec)
    _flagged(flag, check_static_scales, cfg)
    return cfg


# ------------------------------------------------------------------------------------------ demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvquant.tools.demo import run

    check_cache("--cache", args.cache)
    return run(args.model, args.prompt, args.max_new_tokens, args.cache)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate with the embedded model and a KV cache, print the text")
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--prompt", default=None, help="user message (default: a fixed paragraph request)")
    p.add_argument("-n", "--max-new-tokens", type=int_at_least(1), default=128, help="(default: 128)")
    p.add_argument("--cache", default="int4", help="preset name or YAML path (default: int4)")
    p.set_defaults(func=_cmd_demo)


# ------------------------------------------------------------------------------------------ eval, sweep
# Their flags are derived from the config dataclasses (kvquant.eval.flags): a new field is a new flag.


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


# ------------------------------------------------------------------------------------------ bench, calibrate


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "kernels":
        import torch

        from kvquant.tools.bench_kernels import main as kernels_main

        if not torch.cuda.is_available():
            raise ValueError(
                "kernels: needs a CUDA GPU, and torch sees none here; allowed on this machine: cpu"
            )

        return kernels_main(["--out", args.out or "runs/bench-kernels"])
    if args.target == "gpu-check":
        from kvquant.tools.gpu_check import main as gpu_check_main

        argv = ["--out", args.out or "runs/gpu-check", "--device", args.device]
        return gpu_check_main(argv + (["--tiny"] if args.tiny else []))
    from kvquant.tools.bench import bench_cpu, check_settings, resolve_presets

    # bad flags fail here, before the model loads
    check_settings(args.contexts, args.steps, args.repeats, args.warmup, args.prefill)
    presets = resolve_presets(args.presets)
    if args.out:
        from kvquant.eval.config import check_output_dir

        check_output_dir("--out", args.out)
    from kvquant.models import load_model

    model, _ = _flagged("--model", load_model, args.model)
    bench_cpu(
        args.model,
        tuple(args.contexts),
        tuple(presets),
        args.steps,
        args.repeats,
        args.warmup,
        out_dir=args.out,
        prefill=args.prefill,
        dequant=not args.no_dequant,
        model=model,
    )
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.flags import flag_type

    p = sub.add_parser(
        "bench",
        help="speed: 'cpu' (every preset vs DynamicCache), 'kernels' (GPU kernels), 'gpu-check' (GPU)",
        description="cpu: decode tok/s and prefill time of every preset against DynamicCache "
        "(kvquant.tools.bench). kernels: the GPU kernel benchmark. gpu-check: GPU test grid + short kernel "
        "benchmark + long-context generate, JSON + markdown in --out (kvquant.tools.gpu_check).",
    )
    p.add_argument("target", choices=["cpu", "kernels", "gpu-check"])
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--contexts", type=ints_at_least(1), default=[2048, 4096], help="(default: 2048,4096)")
    p.add_argument(
        "--presets", type=flag_type(list[str]), default=["all"], help="comma-separated, or all (default)"
    )
    p.add_argument("--steps", type=int_at_least(1), default=16, help="decode steps per timed round")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="timed rounds (median)")
    p.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed runs first")
    p.add_argument(
        "--prefill",
        type=int_at_least(0),
        default=1024,
        help="prompt tokens of the prefill column (0: no column)",
    )
    p.add_argument(
        "--no-dequant", action="store_true", help="leave out the dequantizing contenders (half the time)"
    )
    p.add_argument("--out", default=None, help="folder for JSON + markdown results")
    p.add_argument("--device", default="cuda", help="gpu-check: cuda, or cpu with --tiny (plumbing test)")
    p.add_argument("--tiny", action="store_true", help="gpu-check: tiny shapes (plumbing test)")
    p.set_defaults(func=_cmd_bench)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from kvquant.config import KVQuantConfig
    from kvquant.eval.config import CorpusSection
    from kvquant.eval.corpus import load_corpus, tokenize
    from kvquant.models import load_model
    from kvquant.tools.calibrate import calibrate_static_scales

    cfg = KVQuantConfig(key_format=args.format, value_format=args.format, rotation=args.rotation)
    check_output_file("--out", args.out)
    corpus = _flagged("--corpus", load_corpus, CorpusSection(name=args.corpus))
    model, tok = _flagged("--model", load_model, args.model)
    ids = tokenize(tok, corpus.text)[None, : args.tokens]  # [1, N]
    scales = calibrate_static_scales(model, ids, cfg, args.out, margin=args.margin)
    print(
        f"wrote {args.out}: keys {tuple(scales['keys'].shape)}, values {tuple(scales['values'].shape)} "
        f"from {ids.shape[1]} tokens; use it as `static_scales: {args.out}` with key/value_format {args.format}"
    )
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="static per-(layer, head) int8 / fp8 scales from calibration text")
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--corpus", default="embedded", help="'embedded', 'wikitext2' or a local .txt/.jsonl file")
    p.add_argument("--tokens", type=int_at_least(1), default=4096, help="calibration tokens (default: 4096)")
    p.add_argument("--format", default="int8", choices=["int8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--rotation", default="none", choices=["none", "hadamard"])
    p.add_argument(
        "--margin", type=float_above(0), default=1.0, help="multiplies the observed maximum (default: 1.0)"
    )
    p.add_argument("--out", required=True, help="output file (.pt)")
    p.set_defaults(func=_cmd_calibrate)


# ------------------------------------------------------------------------------------------ plan


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from kvquant.tools.plan import PlanError, format_table, load_config, parse_size, plan

    try:
        memory = parse_size(args.memory, "--memory")
        presets = None
        if args.presets is not None:
            presets = [x.strip() for x in args.presets.split(",") if x.strip()]
        config = load_config(args.model)
        rows = plan(
            config,
            memory,
            args.context,
            batch=args.batch,
            weights_dtype=args.weights_dtype,
            kv_dtype=args.kv_dtype,
            reserve=args.reserve,
            presets=presets,
        )
    except PlanError as exc:
        flag = str(exc).split(":", 1)[0].strip().lstrip("-").replace("_", "-")
        msg = str(exc).split(":", 1)[1].strip() if ":" in str(exc) else str(exc)
        print(f"kvquant plan: error: --{flag}: {' '.join(msg.split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows}, indent=2))
    else:
        print(format_table(rows, args.model))
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planner: KV bytes, max batch and max context per preset, from the model config alone",
    )
    p.add_argument("--model", default="default", help="HF id, local folder, config.json, or default")
    p.add_argument("--memory", required=True, help="accelerator memory, e.g. 80GiB, 80GB, 512MiB, bytes")
    p.add_argument("--context", type=int_at_least(1), required=True, help="tokens per sequence")
    p.add_argument(
        "--batch", type=int_at_least(1), default=1, help="batch for the max-context column (default 1)"
    )
    p.add_argument("--weights-dtype", default="bf16", help="bf16 (default), fp16, fp32, fp8, int8, int4")
    p.add_argument("--kv-dtype", default="bf16", help="model dtype of the full-precision KV (default bf16)")
    p.add_argument(
        "--reserve", default="10%", help="activation reserve: a percentage or a size (default 10%%)"
    )
    p.add_argument("--presets", default=None, help="comma-separated presets (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.set_defaults(func=_cmd_plan)


# ------------------------------------------------------------------------------------------ tune


def _cmd_tune(args: argparse.Namespace) -> int:
    from kvquant.eval.config import CorpusSection
    from kvquant.eval.corpus import load_corpus, make_windows, tokenize
    from kvquant.models import load_model
    from kvquant.tools.tune import tune

    if args.base is not None:
        check_cache("--base", args.base)
    check_output_file("--out", args.out)
    corpus = _flagged("--corpus", load_corpus, CorpusSection(name=args.corpus))
    model, tok = _flagged("--model", load_model, args.model)
    ids = make_windows(tokenize(tok, corpus.text), args.window_len // 2, args.window_len // 2, args.windows)
    result = tune(
        model,
        ids,
        budget_kl=args.budget_kl,
        budget_bits=args.budget_bits,
        base=args.base,
        progress=not args.no_progress,
    )
    result.config.to_yaml(args.out)
    print("layer  rung   " + "  ".join(f"{r:>8s}" for r in result.sensitivity))
    for i, rung in enumerate(result.rungs):
        kls = "  ".join(f"{result.sensitivity[r][i]:8.5f}" for r in result.sensitivity)
        print(f"{i:5d}  {rung:5s}  {kls}")
    print(result.summary())
    print(f"wrote {args.out}; measure it: kvquant eval --caches {args.out}")
    return 0 if result.met else 1


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="per-layer K/V bit allocation meeting a KL or bits budget (writes a config YAML)"
    )
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument(
        "--corpus", default="embedded", help="calibration text: 'embedded', 'wikitext2' or a local file"
    )
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--budget-kl", type=float_above(0), help="largest predicted mean KL vs full precision (> 0)"
    )
    budget.add_argument(
        "--budget-bits", type=float_above(0), help="largest mean format bits per element (> 0)"
    )
    p.add_argument(
        "--base", default=None, help="preset / YAML with the shared settings (default: nuq ladder)"
    )
    p.add_argument("--windows", type=int_at_least(1), default=2, help="calibration windows")
    p.add_argument(
        "--window-len",
        type=int_at_least(2),
        default=512,
        help="tokens per window (the second half is scored)",
    )
    p.add_argument("--out", required=True, help="output config (.yaml)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_tune)


def build_parser() -> argparse.ArgumentParser:
    from kvquant import __version__

    parser = _Parser(prog="kvquant", description="KV-cache quantization for HF transformers")
    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of its one line"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_eval(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_sweep(sub)
    _add_calibrate(sub)
    _add_tune(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status. Bad input (:data:`USER_ERRORS`, and argument errors):
    one line on stderr, status 2; Ctrl-C: one line, status 130; ``--debug`` re-raises both with their
    traceback. Anything else is a bug and propagates with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, prog = "--debug" in argv, "kvquant"
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # argparse: an argument error (2), --help or --version (0)
            return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
        debug, prog = args.debug, f"kvquant {args.command}"
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if debug:
            raise
        print(f"{prog}: error: {describe(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
