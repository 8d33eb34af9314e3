"""Environment variables and on-disk folders, read in one place.

==========================  ==============================================================
``KVQUANT_CACHE``           root of kvquant's on-disk cache (default ``$XDG_CACHE_HOME/kvquant``
                            or ``~/.cache/kvquant``): the converted embedded model, built C kernels
``KVQUANT_NATIVE``          ``0`` disables the C kernels on CPU (the torch paths run instead)
``CC``                      the C compiler for the CPU kernels (default ``cc``)
``KVQUANT_WIKITEXT2``       a local copy of the WikiText-2 raw test split (``eval``, tests)
``HF_HUB_OFFLINE``          transformers' / datasets' offline switch, read here for kvquant too
==========================  ==============================================================

Example:
    >>> from kvquant.env import cache_root
    >>> cache_root()
    PosixPath('/root/.cache/kvquant')
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")


def cache_root() -> Path:
    """Root of kvquant's on-disk cache: ``$KVQUANT_CACHE``, else ``$XDG_CACHE_HOME/kvquant``, else
    ``~/.cache/kvquant``."""
    env = os.environ.get("KVQUANT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvquant"


def native_enabled() -> bool:
    """Whether the C kernels may be built and used (``KVQUANT_NATIVE`` is not ``0``)."""
    return os.environ.get("KVQUANT_NATIVE", "1") != "0"


def c_compiler() -> str:
    """The C compiler command for the CPU kernels (``$CC``, default ``cc``)."""
    return os.environ.get("CC", "cc")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for no hub access."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in _TRUE


def wikitext2_path() -> Path | None:
    """``$KVQUANT_WIKITEXT2`` as a path, or None when unset."""
    env = os.environ.get("KVQUANT_WIKITEXT2")
    return Path(env).expanduser() if env else None
