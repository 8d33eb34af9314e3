"""``run_eval`` end to end on a tiny random llama: the results folder, resume, the records."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import DynamicCache

from kvquant.eval import CacheSpec, EvalConfig, load_config, run_eval
from kvquant.eval import runner as runner_mod

FAST: dict = {}


@pytest.fixture(autouse=True)
def _fast(fast):
    FAST.clear()
    FAST.update(fast)


def _run(tmp_path, tiny, tok, names, **kw):
    overrides = {**FAST, "output.dir": str(tmp_path), "caches": names, **kw.pop("overrides", {})}
    return run_eval(overrides=overrides, model=tiny, tokenizer=tok, **kw)


def test_results_folder_contents(tmp_path, tiny, byte_tok):
    result = _run(tmp_path, tiny, byte_tok, ["int8"])
    run_dir = result.run_dir
    assert run_dir.parent == tmp_path and run_dir.name.startswith("llama-embedded-decode-")
    names = {p.name for p in run_dir.iterdir()}
    assert {
        "config.yaml",
        "env.json",
        "results.jsonl",
        "results.json",
        "results.md",
        "baseline_logprobs.pt",
    } <= names

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved.pop("resolved_caches")["int8"]["key_format"] == "int8"
    assert load_config(saved) == load_config(
        overrides={**FAST, "output.dir": str(tmp_path), "caches": ["int8"]}
    )

    env = json.loads((run_dir / "env.json").read_text())
    assert (
        env["versions"]["torch"] == torch.__version__.split("+")[0]
        or env["versions"]["torch"] == torch.__version__
    )
    assert env["versions"]["transformers"] and "commit" in env["git"]

    lines = (run_dir / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["cache"] for line in lines] == ["dynamic", "int8"]  # dynamic always first
    full = json.loads((run_dir / "results.json").read_text())
    assert [r["cache"] for r in full["records"]] == ["dynamic", "int8"]
    assert full["model"]["layers"] == 2 and full["corpus"]["name"] == "embedded"
    md = (run_dir / "results.md").read_text().strip()
    assert md.startswith(f"Weights: {full['model']['name']}.") and md.endswith(result.table)
    assert result.table.count("\n") == 3  # header, rule, two rows

    dyn, int8 = result.records
    assert dyn["quality"]["kl_mean"] == 0.0 and dyn["quality"]["top1_agreement"] == 1.0
    assert 0 < int8["quality"]["kl_mean"] < 0.05
    mem = int8["memory"]
    assert mem["tokens"] == 48 + 12 - 1
    assert mem["bytes_per_token"] < dyn["memory"]["bytes_per_token"] / 3  # fp32 model: int8 + scales
    assert dyn["memory"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 heads, dim 16, fp32
    assert dyn["speed"]["rows"][0]["decode_x"] == 1.0 and "decode_x" in int8["speed"]["rows"][0]
    assert set(int8["retrieval"]["accuracy"]) == {"360"}


def test_full_precision_caches_match_the_baseline_in_a_run(tmp_path, tiny, byte_tok):
    overrides = {"memory.enabled": False, "speed.enabled": False, "retrieval.enabled": False}
    result = _run(tmp_path, tiny, byte_tok, ["none"], overrides=overrides)
    none = result.records[1]["quality"]
    assert abs(none["delta_ppl_rel"]) < 1e-4 and none["top1_agreement"] == 1.0


def test_broken_cache_is_worse_in_a_run(tmp_path, tiny, byte_tok):
    gen = torch.Generator().manual_seed(0)  # the same noise in every run (the global RNG varies)

    class Noisy(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            noise = torch.randn(k.shape, generator=gen, dtype=k.dtype)
            return super().update(k + 0.5 * k.std() * noise, v, layer_idx, *args, **kwargs)

    noisy = CacheSpec.custom("noisy-keys", lambda m: Noisy(config=m.config), noise=0.5)
    overrides = {"memory.enabled": False, "speed.enabled": False, "retrieval.enabled": False}
    result = _run(tmp_path, tiny, byte_tok, ["int8"], caches=[noisy], overrides=overrides)
    _, int8, bad = (r["quality"] for r in result.records)
    assert bad["kl_mean"] > 10 * int8["kl_mean"] and bad["top1_agreement"] < int8["top1_agreement"]


def test_resume_skips_finished_configs(tmp_path, tiny, byte_tok, monkeypatch):
    overrides = {"speed.enabled": False, "retrieval.enabled": False}
    evaluated = []
    real = runner_mod.EvalContext.evaluate

    def interrupted(self, spec):
        if spec.name == "int4":
            raise KeyboardInterrupt
        evaluated.append(spec.name)
        return real(self, spec)

    monkeypatch.setattr(runner_mod.EvalContext, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, tiny, byte_tok, ["int8", "int4"], overrides=overrides)
    assert evaluated == ["dynamic", "int8"]
    (run_dir,) = tmp_path.iterdir()
    baseline_mtime = (run_dir / "baseline_logprobs.pt").stat().st_mtime_ns

    def counting(self, spec):
        evaluated.append(spec.name)
        return real(self, spec)

    evaluated.clear()
    monkeypatch.setattr(runner_mod.EvalContext, "evaluate", counting)
    result = _run(tmp_path, tiny, byte_tok, ["int8", "int4"], overrides=overrides)
    assert result.run_dir == run_dir
    assert evaluated == ["int4"] and result.skipped == ["dynamic", "int8"]
    assert [r["cache"] for r in result.records] == ["dynamic", "int8", "int4"]
    assert (run_dir / "baseline_logprobs.pt").stat().st_mtime_ns == baseline_mtime  # reused, not recomputed

    # adding a cache to a finished run reuses the folder; everything else is skipped
    evaluated.clear()
    result = _run(tmp_path, tiny, byte_tok, ["int8", "int4", "k8v4"], overrides=overrides)
    assert evaluated == ["k8v4"] and len((run_dir / "results.jsonl").read_text().splitlines()) == 4


def test_other_settings_get_another_folder(tmp_path, tiny, byte_tok):
    overrides = {"memory.enabled": False, "speed.enabled": False, "retrieval.enabled": False}
    a = _run(tmp_path, tiny, byte_tok, ["int8"], overrides=overrides)
    b = _run(tmp_path, tiny, byte_tok, ["int8"], overrides={**overrides, "quality.windows": 3})
    c = _run(tmp_path, tiny, byte_tok, ["int8"], overrides={**overrides, "quality.mode": "simulated"})
    assert len({a.run_dir, b.run_dir, c.run_dir}) == 3 and "-simulated-" in c.run_dir.name
    assert c.records[1]["quality"]["kl_mean"] > 0


def test_default_yaml_mirrors_the_dataclass_defaults():
    assert load_config("default") == EvalConfig()
