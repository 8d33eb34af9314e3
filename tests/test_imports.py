"""Imports run one way: the import-linter contracts of pyproject.toml, as `make lint` runs them.

Layers, top to bottom: tools > integrations > eval > planning > attention | models > cache > transforms > config |
kernels > formats > env (pyproject's ``[tool.importlinter]`` names every module). The library never
imports the harness (``kvquant.eval``) and neither imports the tools (``kvquant.tools``). The imports
that still break a layer while issue 12 is under way are the contract's ``ignore_imports``; an
ignore that no longer matches fails too.
(That no top-level ``kernels`` / ``eval`` module resolves into this repository is
tests/test_packaging.py.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("lint_imports", REPO / ".ci" / "lint_imports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_import_contracts_hold(tmp_path):
    """``make lint``'s lint-imports step: every contract in pyproject.toml is kept."""
    run = _runner()
    run.stage(tmp_path)
    res = run.lint(tmp_path, capture=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("module", "line", "expect"),
    [
        ("eval/_probe.py", "import kvquant.tools.plan", "kvquant.eval._probe -> kvquant.tools.plan"),
        ("formats", "import kvquant.eval.corpus", "kvquant.formats -> kvquant.eval.corpus"),
        ("kernels/_probe.py", "import kvquant.cache", "kvquant.kernels._probe -> kvquant.cache"),
        ("tools/plan.py", "import kvquant.tools.cli", "kvquant.tools.plan -> kvquant.tools.cli"),
        ("_unplaced.py", "", "kvquant._unplaced"),
    ],
)
def test_contracts_catch_a_wrong_import(tmp_path, module, line, expect):
    """A wrong import added to a copy of the package is reported (and so is a module no layer names)."""
    run = _runner()
    run.stage(tmp_path)
    path = tmp_path / "kvquant" / module
    if module == "formats":  # a module today, a package once it is split
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    path.write_text((path.read_text() if path.exists() else "") + f"\n{line}\n")
    res = run.lint(tmp_path, capture=True)
    assert res.returncode != 0
    assert expect in res.stdout, res.stdout + res.stderr
