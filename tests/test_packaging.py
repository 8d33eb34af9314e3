"""Packaging: kernels/, eval/ and configs/ are installed only under `kvquant.`, never top-level.

Hugging Face's own `kernels` package owns the top-level name `kernels` and transformers probes for it;
a top-level `kernels` (or `eval`, `configs`) from this repo would shadow it and confuse that probe.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _origin_paths(spec) -> list[Path]:
    paths = []
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        paths.append(Path(spec.origin).resolve())
    paths += [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    return paths


@pytest.mark.parametrize("name", ["kernels", "eval", "configs"])
def test_no_top_level_module_from_this_repo(name):
    assert str(REPO) not in [str(Path(p).resolve()) for p in sys.path if p], "repo root is on sys.path"
    spec = importlib.util.find_spec(name)
    if spec is None:
        return  # nothing by that name: fine (HF's `kernels` may also be installed elsewhere: also fine)
    for path in _origin_paths(spec):
        assert not path.is_relative_to(REPO), f"top-level {name!r} resolves into this repo: {path}"


@pytest.mark.parametrize(
    ("module", "folder"),
    [
        ("kvquant", "kvquant"),
        ("kvquant.kernels", "kernels"),
        ("kvquant.eval", "eval"),
        ("kvquant.configs", "configs"),
    ],
)
def test_subpackages_map_to_repo_folders(module, folder):
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{module} is not importable"
    locations = [Path(p).resolve() for p in spec.submodule_search_locations or []]
    if locations and locations[0].is_relative_to(REPO):  # editable install (make setup)
        assert locations == [REPO / folder]
    else:  # a regular (wheel) install: the package lives in site-packages under kvquant/
        parts = tuple(module.split("."))
        assert locations and locations[0].parts[-len(parts) :] == parts


def test_preset_yamls_are_package_data():
    """Every shipped preset is installed with the package (a missing one fails, never skips)."""
    from kvquant.config import preset_names

    presets = importlib.resources.files("kvquant.configs") / "presets"
    assert presets.is_dir(), "configs/presets/ is missing from the installed package"
    yamls = [p for p in presets.iterdir() if p.name.endswith((".yaml", ".yml"))]
    installed = {p.name.rsplit(".", 1)[0] for p in yamls}
    in_repo = {p.stem for p in (REPO / "configs" / "presets").glob("*.yaml")}
    assert in_repo and in_repo <= installed, (
        f"presets missing from the package: {sorted(in_repo - installed)}"
    )
    assert set(preset_names()) == installed
    for p in yamls:
        assert p.read_text().strip(), f"{p.name} is empty"


def test_console_script_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "kvquant"]
    assert ep.value == "kvquant.tools.cli:main"
    assert callable(ep.load())
    (lm,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "kvquant-lm-eval"]
    assert lm.value == "kvquant.integrations:lm_eval_main" and callable(lm.load())


def test_evaluate_metric_module_is_installed_with_the_package():
    """The ``evaluate`` metric is loaded by path: its file must be in the installed package."""
    from kvquant.integrations import CACHE_QUALITY_METRIC

    shipped = importlib.resources.files("kvquant.integrations") / "kvquant_cache_quality.py"
    assert shipped.is_file() and Path(str(shipped)).resolve() == Path(CACHE_QUALITY_METRIC).resolve()
