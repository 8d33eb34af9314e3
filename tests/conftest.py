"""Shared pytest setup: `gpu`-marked tests are skipped without CUDA; without CUDA the Triton kernels
run under Triton's interpreter for the whole session (set here, before any test module can import
``kvquant.kernels``: Triton reads the variable when ``@triton.jit`` decorates the kernels)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
