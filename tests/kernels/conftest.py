"""Kernel tests run the real Triton kernels: compiled on CUDA, else under Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function (``triton.knobs`` looks the
variable up on every access, so importing triton earlier is harmless); this conftest is imported
before the test modules, so setting it here at import time is early enough. Should
``kvquant.kernels`` have been imported already (compiled mode), its kernel modules are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    pkg = sys.modules.get("kvquant.kernels")
    if pkg is not None and not getattr(pkg, "INTERPRET", True):
        for name in (
            "kvquant.kernels.triton._common",
            "kvquant.kernels.triton.quantize",
            "kvquant.kernels.triton.decode_tiles",
            "kvquant.kernels.triton.decode_kernels",
            "kvquant.kernels.triton.decode_launch",
            "kvquant.kernels.triton.decode_attention",
        ):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        importlib.reload(pkg)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
