"""The harness's input checks, shared by ``kvquant eval`` and ``kvquant sweep``: each bad value raises
one :class:`EvalError` naming the field and what is allowed (the CLI prints it on one line and exits
with status 2). Devices and output folders are checked before any slow work.

Example:
    >>> check_choice("quality.mode", "prefill", ("decode", "simulated"))
    Traceback (most recent call last):
    kvquant.eval.checks.EvalError: quality.mode: invalid value 'prefill'; allowed: decode, simulated
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


class EvalError(ValueError):
    """Bad input (unknown preset, missing file, too short a corpus, ...). The CLI prints the message on
    one line and exits with status 2."""


def check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise EvalError(f"{name}: invalid value {value!r}; expected an integer >= {low}")


def check_ints(name: str, values: Any, also: tuple[str, ...] = ()) -> None:
    """A non-empty list of positive integers (or of the words in ``also``)."""
    allowed = "positive integers" + "".join(f" or {a!r}" for a in also)
    if not isinstance(values, list) or not values:
        raise EvalError(f"{name}: expected a non-empty list of {allowed}, got {values!r}")
    for v in values:
        if (not isinstance(v, int) or isinstance(v, bool) or v < 1) and v not in also:
            raise EvalError(f"{name}: invalid value {v!r}; allowed: {allowed}")


def check_caches(caches: Any) -> None:
    if not isinstance(caches, list) or not caches:
        raise EvalError(f"caches: expected a non-empty list of cache specs, got {caches!r}")


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EvalError(f"{name}: invalid value {value!r}; allowed: {', '.join(allowed)}")


def check_device(name: str, value: Any) -> None:
    """``auto``, or a torch device string this machine has (``cuda`` only where torch sees CUDA)."""
    import torch

    allowed = "auto, cpu, cuda, cuda:N" if torch.cuda.is_available() else "auto, cpu (no CUDA device here)"
    if value == "auto":
        return
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise EvalError(f"{name}: invalid value {value!r}; allowed: {allowed}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise EvalError(f"{name}: {value!r}, but torch sees {count} CUDA device(s); allowed: {allowed}")
    elif device.type != "cpu" and not _backend_available(device.type):
        raise EvalError(f"{name}: {value!r} is not available here; allowed: {allowed}")


def _backend_available(kind: str) -> bool:
    import torch

    module = getattr(torch, kind, None) or getattr(torch.backends, kind, None)
    try:
        return bool(module is not None and module.is_available())
    except Exception:  # a backend module without a working is_available()
        return False


def attention_names() -> list[str]:
    """The attention implementations transformers knows here (``kvquant`` included); a hub kernel
    (``org/name``) is accepted as well, unchecked."""
    from transformers import AttentionInterface

    import kvquant.attention  # noqa: F401  (registers "kvquant")

    return ["eager", *AttentionInterface._global_mapping]


def check_output_dir(name: str, value: Any) -> None:
    """A folder results can be written to, checked before any slow work and without creating it: the
    folder (or, when it does not exist yet, its nearest existing parent) must be a writable folder."""
    if not isinstance(value, (str, Path)) or not str(value):
        raise EvalError(f"{name}: invalid value {value!r}; allowed: a folder path")
    path = Path(value).expanduser().absolute()
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise EvalError(f"{name}: {str(base)!r} is a file, not a folder")
    try:  # os.access says yes to root even on a read-only file system: try it
        tempfile.TemporaryDirectory(dir=base).cleanup()
    except OSError as exc:
        raise EvalError(f"{name}: cannot write to the folder {str(path)!r} ({exc.strerror or exc})") from None
