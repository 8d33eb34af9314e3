"""Run ``lint-imports`` (the contracts in pyproject.toml) on the package as it is installed.

The repository keeps ``kernels/`` and ``eval/`` beside ``kvquant/`` and pyproject maps them under
``kvquant.``; import-linter finds a package's modules by walking its folder, so in an editable
install it would see neither. This copies the ``.py`` files into a temporary folder laid out as a
wheel installs them (``kvquant/``, ``kvquant/kernels/``, ``kvquant/eval/``, ``kvquant/configs/``) and
runs ``lint-imports`` there, where that copy comes first on ``sys.path``.

    .venv/bin/python .ci/lint_imports.py      # what `make lint` runs; exit status of lint-imports
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# installed package -> repository folder (pyproject's [tool.setuptools.package-dir])
LAYOUT = {
    "kvquant": "kvquant",
    "kvquant/kernels": "kernels",
    "kvquant/eval": "eval",
    "kvquant/configs": "configs",
}


def stage(dest: Path) -> None:
    """Copy every ``.py`` file of the package into ``dest`` in its installed layout."""
    for target, folder in LAYOUT.items():
        for src in (REPO / folder).rglob("*.py"):
            rel = src.relative_to(REPO / folder)
            if "__pycache__" in rel.parts:
                continue
            out = dest / target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)


def lint_imports_exe() -> str:
    beside = Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.is_file() else shutil.which("lint-imports")
    if found is None:
        sys.exit("lint-imports not found: pip install import-linter (it is in the dev extra)")
    return found


def lint(tree: Path, capture: bool = False) -> subprocess.CompletedProcess:
    """``lint-imports`` with pyproject's contracts, run in ``tree`` (a folder filled by :func:`stage`)."""
    # lint-imports puts its working directory first on sys.path: the copy shadows the editable install
    cmd = [lint_imports_exe(), "--no-cache", "--no-logo", str(REPO / "pyproject.toml")]
    return subprocess.run(cmd, cwd=tree, capture_output=capture, text=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvquant-imports-") as tmp:
        stage(Path(tmp))
        return lint(Path(tmp)).returncode


if __name__ == "__main__":
    sys.exit(main())
