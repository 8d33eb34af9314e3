"""What the ``kvquant`` command accepts: the user-error types it reports in one line, argparse types
that range-check numeric flags, and checks of paths and cache configs run before any slow work.

Example::

    p.add_argument("--steps", type=int_at_least(1))   # "--steps: expected an integer >= 1, got -1"
"""

from __future__ import annotations

import argparse
import math
import pickle
from collections.abc import Callable
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
  wrong kind, or not writable. Other ``OSError`` errors (disk full, I/O errors) are the machine's, and
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


class OneLineParser(argparse.ArgumentParser):
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


def float_in(low: float, high: float) -> Callable[[str], float]:
    """argparse ``type``: a number in ``[low, high]``."""
    want = f"a number from {low:g} to {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not low <= value <= high:  # (NaN fails too)
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


def flagged(flag: str, fn: Callable, *args, **kwargs):
    """``fn(*args)``, its ``ValueError`` prefixed with the flag the value came from."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        msg = " ".join(str(exc).split()).removeprefix(f"{flag.lstrip('-')}: ")  # not "--corpus: corpus:"
        raise ValueError(f"{flag}: {msg}") from None


def flagged_fields(flags: dict[str, str], fn: Callable, *args, **kwargs):
    """``fn(*args)``, its ``ValueError`` ``"field: ..."`` reported under ``flags[field]``, the flag that
    value came from (left as it is for a field with no flag).

    Example::

        flagged_fields({"base": "--base", "pinned": "--pin"}, tune, ...)  # "--pin: invalid key layer 99; ..."
    """
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        msg = " ".join(str(exc).split())
        field, sep, rest = msg.partition(": ")
        raise ValueError(f"{flags[field]}: {rest}" if sep and field in flags else msg) from None


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
    from kvquant.eval.caches import check_calibration_files

    cfg = flagged(flag, KVQuantConfig.resolve, spec)
    flagged(flag, check_calibration_files, cfg)
    return cfg
