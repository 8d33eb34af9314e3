"""The planner's inputs: sizes (``80GiB``, ``512MiB``, bytes), a reserve (``10%`` or a size), dtype
names, and a model config without weights (the embedded model, a file, a folder or a hub id). Bad
input raises :class:`PlanError`, naming the flag.

Example:
    >>> parse_size("80GiB"), parse_reserve("10%", 1000), dtype_bytes("bf16")
    (85899345920, 100, 2)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
DEFAULT_RESERVE = "10%"


class PlanError(ValueError):
    """Bad planner input; the message names the flag / argument."""


# ------------------------------------------------------------------------------------------ parsing


def parse_size(text: str | int | float, flag: str = "size") -> int:
    """``"80GiB"``, ``"80GB"``, ``"512MiB"``, ``"1.5e9"`` or plain bytes -> bytes (int)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise PlanError(f"{flag}: expected a size >= 0, got {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"{flag}: cannot parse size {text!r} (examples: 80GiB, 80GB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_reserve(text: str | int | float, memory_bytes: int, flag: str = "reserve") -> int:
    """``"10%"`` of ``memory_bytes``, or an absolute size (``"4GiB"``)."""
    if isinstance(text, str) and text.strip().endswith("%"):
        try:
            pct = float(text.strip()[:-1])
        except ValueError:
            raise PlanError(f"{flag}: cannot parse percentage {text!r} (e.g. 10%)") from None
        if not 0 <= pct < 100:
            raise PlanError(f"{flag}: percentage must be in [0, 100), got {text!r}")
        return int(memory_bytes * pct / 100)
    return parse_size(text, flag)


def dtype_bytes(dtype: str | int | float, flag: str = "dtype") -> float:
    """Bytes per element of a dtype name (``bf16``, ``fp32``, ``int4`` ...) or a number of bytes."""
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise PlanError(f"{flag}: unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def load_config(model: str | os.PathLike[str] | None) -> Any:
    """A model config without weights: ``default`` (embedded SmolLM2), a config.json, a folder, or an HF id."""
    from transformers import AutoConfig

    from kvquant.models import EMBEDDED_ALIASES, embedded_cache_dir, ensure_embedded_copy

    name = "default" if model is None else os.fspath(model)
    if name.lower() in EMBEDDED_ALIASES:
        folder = embedded_cache_dir()
        if not (folder / "config.json").is_file():
            folder = ensure_embedded_copy()  # one-time conversion of the embedded GGUF
        return AutoConfig.from_pretrained(str(folder))
    path = Path(name).expanduser()
    if path.is_file() or path.is_dir():
        if path.is_dir() and not (path / "config.json").is_file():
            raise PlanError(f"model: folder {name!r} has no config.json")
        try:
            return AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise PlanError(f"model: cannot read a model config from {name!r}: {exc}") from None
    if name.startswith(("/", ".", "~")) or name.endswith(".json") or name.count("/") > 1:
        raise PlanError(f"model: no such config file or folder {name!r}")
    try:
        try:
            return AutoConfig.from_pretrained(name, local_files_only=True)
        except OSError:
            return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise PlanError(f"model: cannot resolve {name!r} to a model config: {exc}") from None
