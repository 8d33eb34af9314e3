"""``kvquant sweep`` / ``run_sweep`` on a tiny random llama: resume, outputs, plots, Pareto, recommendation."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import yaml

from kvquant.eval import runner as runner_mod
from kvquant.eval import sweep as sweep_mod
from kvquant.eval.config import _configs_dir
from kvquant.eval.recommend import pareto_front, recommend
from kvquant.eval.sweep import SweepError, load_sweep_config, run_sweep
from kvquant.tools.cli import main

CACHES = ["dynamic", "int8", "int4"]
FAST = {
    "corpus.name": "embedded",
    "caches": CACHES,
    "quality.prefix_len": 48,
    "quality.score_len": 12,
    "quality.windows": 2,
    "grid.contexts": [32, 64],
    "grid.batches": [1, 2],
    "speed.decode_tokens": 2,
    "speed.repeats": 1,
    "capacity.budget": "1GiB",
    "capacity.contexts": [128],
    "recommend.max_kl": 0.05,
    "progress": False,
}
PNG = b"\x89PNG\r\n\x1a\n"


def _sweep(tmp_path, tiny, tok, **overrides):
    return run_sweep(
        overrides={**FAST, "out": str(tmp_path / "sweep"), **overrides}, model=tiny, tokenizer=tok
    )


def _csv_rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _num(text):
    return None if text == "" else float(text)


def _points_table(markdown: str) -> list[list[str]]:
    section = markdown.split("## Points", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


# ------------------------------------------------------------------------------------------ resume


REAL = (runner_mod.EvalContext.evaluate, sweep_mod._memory_point, sweep_mod.measure_speed)


class Counter:
    """Counts the pieces a sweep measures: quality per cache, memory runs, interleaved speed calls."""

    def __init__(self, monkeypatch, kill_after_memory: int | None = None):
        self.quality, self.memory, self.speed = [], [], []
        real_eval, real_memory, real_speed = REAL  # not an earlier Counter's wrappers

        def evaluate(ctx, spec):
            self.quality.append(spec.name)
            return real_eval(ctx, spec)

        def memory(model, spec, stream, context, batch, decode):
            if kill_after_memory is not None and len(self.memory) == kill_after_memory:
                raise KeyboardInterrupt  # the sweep is killed here
            self.memory.append((spec.name, context, batch))
            return real_memory(model, spec, stream, context, batch, decode)

        def speed(model, builds, stream, **kw):
            self.speed.append((kw["context_lengths"][0], kw["batch_sizes"][0], sorted(builds)))
            return real_speed(model, builds, stream, **kw)

        monkeypatch.setattr(runner_mod.EvalContext, "evaluate", evaluate)
        monkeypatch.setattr(sweep_mod, "_memory_point", memory)
        monkeypatch.setattr(sweep_mod, "measure_speed", speed)


def test_killed_sweep_resumes_without_recomputing(tmp_path, tiny, byte_tok, monkeypatch):
    first = Counter(monkeypatch, kill_after_memory=4)
    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path, tiny, byte_tok)
    out = tmp_path / "sweep"
    assert first.quality == CACHES
    assert first.memory == [(c, 32, 1) for c in CACHES] + [("dynamic", 32, 2)]
    assert [s[:2] for s in first.speed] == [(32, 1)]
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    kinds = [(r["kind"], r["cache"], r["context"], r["batch"]) for r in lines]
    assert len(kinds) == len(set(kinds)) == 3 + 3 + 3 + 1  # quality, memory @32x1, speed @32x1, dynamic @32x2
    assert ("memory", "dynamic", 32, 2) in kinds and not (out / "results.csv").exists()
    assert all(r["id"] == f"llama|{r['key']}|{r['kind']}|{r['context']}|{r['batch']}" for r in lines)
    baseline = out / "models" / "llama" / "baseline_logprobs.pt"
    mtime = baseline.stat().st_mtime_ns

    second = Counter(monkeypatch)
    result = _sweep(tmp_path, tiny, byte_tok)
    assert second.quality == []  # every cache's quality was finished
    done_before = {(c, x, b) for c, x, b in first.memory}
    assert not done_before & set(second.memory)
    assert done_before | set(second.memory) == {(c, x, b) for c in CACHES for x in (32, 64) for b in (1, 2)}
    assert [s[:2] for s in second.speed] == [(32, 2), (64, 1), (64, 2)]
    assert all("dynamic" in s[2] and len(s[2]) == 3 for s in second.speed)  # interleaved with DynamicCache
    assert baseline.stat().st_mtime_ns == mtime
    assert result.skipped == 10 and result.measured == 3 + 12 + 12 - 10
    assert len(result.points) == 12 and all(p["decode_tok_s"] > 0 for p in result.points)

    third = Counter(monkeypatch)
    again = _sweep(tmp_path, tiny, byte_tok)
    assert (third.quality, third.memory, third.speed) == ([], [], [])
    assert again.measured == 0 and again.skipped == 3 + 12 + 12
    assert again.points == result.points


def test_other_settings_in_the_same_folder_are_refused(tmp_path, tiny, byte_tok):
    overrides = {"caches": ["dynamic"], "grid.contexts": [32], "grid.batches": [1]}
    _sweep(tmp_path, tiny, byte_tok, **overrides)
    with pytest.raises(SweepError, match=r"^out: .* other model / corpus / quality / speed settings"):
        _sweep(tmp_path, tiny, byte_tok, **overrides, **{"quality.prefix_len": 40})


# ------------------------------------------------------------------------------------------ outputs


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny, byte_tok):
    tmp = tmp_path_factory.mktemp("swept")
    return run_sweep(overrides={**FAST, "out": str(tmp / "sweep")}, model=tiny, tokenizer=byte_tok)


def test_csv_and_markdown_have_one_row_per_point(swept):
    rows = _csv_rows(swept.out_dir / "results.csv")
    points = [(r["cache"], int(r["context"]), int(r["batch"])) for r in rows]
    assert points == [(c, x, b) for c in CACHES for x in (32, 64) for b in (1, 2)]
    md = (swept.out_dir / "results.md").read_text()
    assert md == swept.markdown
    table = _points_table(md)
    assert [(r[1], int(r[2]), int(r[3])) for r in table] == points
    for csv_row, md_row in zip(rows, table, strict=True):  # the markdown shows the CSV's numbers
        assert md_row[9] == f"{float(csv_row['decode_tok_s']):.2f}"
        assert md_row[4] == f"{float(csv_row['effective_bits']):.2f}"
        assert md_row[11] == f"{float(csv_row['kl_mean']):.5f}"
    by = {(r["cache"], int(r["context"]), int(r["batch"])): r for r in rows}
    dyn, int8 = by[("dynamic", 64, 1)], by[("int8", 64, 1)]
    # fp32 tiny llama: 2 layers x 2 kv heads x 16 dims x (K + V) x 4 bytes
    assert float(dyn["bytes_per_token"]) == 2 * 2 * 16 * 2 * 4 and float(dyn["effective_bits"]) == 32.0
    assert float(dyn["effective_bits_16bit"]) == 16.0  # what a 16-bit model's DynamicCache holds
    assert float(dyn["kl_mean"]) == 0.0 and float(dyn["decode_x"]) == 1.0
    assert 8 < float(int8["effective_bits"]) < 10 and float(int8["kl_mean"]) > 0
    assert int(int8["tokens_held"]) == 64 + 2 and int(by[("int8", 64, 2)]["bytes_held"]) == 2 * int(
        int8["bytes_held"]
    )
    assert float(int8["decode_x"]) == pytest.approx(
        float(int8["decode_tok_s"]) / float(int8["reference_decode_tok_s"])
    )
    assert all(float(r["peak_bytes"]) > 0 for r in rows)
    assert "## Recommendation" in md and swept.recommendation["text"] in md


def test_plots_exist_and_their_data_matches_the_table(swept):
    from matplotlib.image import imread

    plots = swept.out_dir / "plots"
    names = ["quality_vs_bits", "decode_speed", "memory_vs_context", "capacity"]
    assert [p.name for p in swept.plots] == [f"{n}.png" for n in names]
    for n in names:
        png = plots / f"{n}.png"
        assert png.read_bytes()[:8] == PNG
        img = imread(png)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
        assert img[..., :3].std() > 0.05  # something drawn, not a blank canvas
        assert f"plots/{n}.png" in swept.markdown
    rows = _csv_rows(swept.out_dir / "results.csv")
    by = {(r["cache"], int(r["context"]), int(r["batch"])): r for r in rows}

    speed = json.loads((plots / "decode_speed.json").read_text())["batches"]
    memory = json.loads((plots / "memory_vs_context.json").read_text())["batches"]
    for b in (1, 2):
        for cache in CACHES:
            for plotted, field in (
                (speed[str(b)]["decode_tok_s"][cache], "decode_tok_s"),
                (speed[str(b)]["decode_x"][cache], "decode_x"),
                (memory[str(b)]["bytes_per_token"][cache], "bytes_per_token"),
                (memory[str(b)]["peak_mib"][cache], "peak_mib"),
            ):
                assert plotted["context"] == [32, 64]
                assert plotted[field] == [_num(by[(cache, x, b)][field]) for x in (32, 64)]

    quality = json.loads((plots / "quality_vs_bits.json").read_text())
    assert (quality["context"], quality["batch"]) == (64, 1)  # cost: largest context, smallest batch
    for metric in ("kl_mean", "delta_ppl_pct"):
        panel = quality["panels"][metric]
        assert [p["cache"] for p in panel] == CACHES
        for p in panel:
            assert p["effective_bits"] == _num(by[(p["cache"], 64, 1)]["effective_bits"])
            assert p["value"] == _num(by[(p["cache"], 64, 1)][metric])
        assert [p["pareto"] for p in panel] == pareto_front(
            [(p["effective_bits"], p["value"]) for p in panel]
        )

    cap = json.loads((plots / "capacity.json").read_text())
    assert cap["contexts"] == [32, 64, 128] and cap["budget"] == "1GiB"
    for cache in CACHES:
        s = cap["series"][cache]
        assert s["context"] == [32, 64, 128]
        assert s["max_sequences"][:2] == [int(by[(cache, x, 1)]["max_sequences"]) for x in (32, 64)]


def test_capacity_is_the_planners(swept, tiny):
    from kvquant.config import KVQuantConfig
    from kvquant.planning import plan

    rows = plan(
        tiny.config, "1GiB", 128, presets=[KVQuantConfig.resolve("int8"), KVQuantConfig.resolve("int4")]
    )
    cap = json.loads((swept.out_dir / "plots" / "capacity.json").read_text())["series"]
    expect = {"int8": rows[0]["max_batch"], "int4": rows[1]["max_batch"], "dynamic": rows[2]["max_batch"]}
    assert {c: cap[c]["max_sequences"][-1] for c in CACHES} == expect
    assert expect["int4"] > expect["dynamic"] > 0


def test_out_of_memory_point_is_recorded_and_the_sweep_goes_on(tmp_path, tiny, byte_tok, monkeypatch):
    real = sweep_mod.time_once

    def time_once(model, cache, ids, decode):
        if ids.shape[1] == 64 and type(cache).__name__ == "KVQuantCache":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(model, cache, ids, decode)

    monkeypatch.setattr(sweep_mod, "time_once", time_once)
    result = _sweep(tmp_path, tiny, byte_tok, **{"caches": ["dynamic", "int8"], "grid.batches": [1]})
    by = {(p["cache"], p["context"]): p for p in result.points}
    assert by[("int8", 64)]["error"].startswith("out of memory") and by[("int8", 64)]["decode_tok_s"] is None
    assert by[("int8", 32)]["error"] is None and by[("dynamic", 64)]["decode_tok_s"] > 0
    assert [r[9] for r in _points_table(result.markdown)][3] == "OOM"


# ------------------------------------------------------------------------------------------ Pareto


def test_pareto_front_hand_made():
    pts = [
        (4.0, 0.5),
        (8.0, 0.1),
        (5.0, 0.6),
        (16.0, 0.0),
        (8.0, 0.2),
        (3.0, math.nan),
        (4.0, 0.5),
        (2.0, 9.0),
    ]
    #        front       front       worse than (4, .5)  front  worse than (8, .1)  no number  tie: front  front
    assert pareto_front(pts) == [True, True, False, True, False, False, True, True]
    assert pareto_front([]) == [] and pareto_front([(1.0, 1.0)]) == [True]


# ------------------------------------------------------------------------------------------ recommend

CONFIGS = [
    {"cache": "dynamic", "cache_kind": "dynamic", "effective_bits": 32.0, "bytes_per_token": 46080,
     "kl_mean": 0.0, "delta_ppl_pct": 0.0, "max_sequences": 100, "context": 2048},
    {"cache": "int8", "effective_bits": 8.5, "bytes_per_token": 12240, "kl_mean": 0.0002, "delta_ppl_pct": -0.05,
     "max_sequences": 370, "context": 2048},
    {"cache": "k8v4", "effective_bits": 6.4, "bytes_per_token": 9333, "kl_mean": 0.0016, "delta_ppl_pct": 0.04},
    {"cache": "kivi4", "effective_bits": 5.2, "bytes_per_token": 7448, "kl_mean": 0.0099, "delta_ppl_pct": -0.9,
     "max_sequences": 610, "context": 2048},
    {"cache": "int4", "effective_bits": 4.6, "bytes_per_token": 6654, "kl_mean": 0.024, "delta_ppl_pct": 3.4},
    {"cache": "kivi2", "effective_bits": 3.8, "bytes_per_token": 5490, "kl_mean": 0.27, "delta_ppl_pct": 31.0},
]  # fmt: skip


def test_recommend_picks_the_cheapest_config_within_the_budget():
    rec = recommend(CONFIGS, max_kl=0.01, budget_label="24GiB")
    assert rec["pick"] == "kivi4" and rec["next_cheaper"] == "int4"
    text = rec["text"]
    assert "use kivi4" in text and "5.20 effective bits" in text and "6.2x less" in text
    assert "610 instead of 100 sequences in 24GiB" in text
    assert "int4 (4.60 bits), missed it with KL 0.024 > 0.01" in text

    assert recommend(CONFIGS, max_kl=0.001)["pick"] == "int8"  # k8v4's 0.0016 is over
    # both budgets apply: int4 is within KL 0.03 but not within Δppl 1%
    both = recommend(CONFIGS, max_kl=0.03, max_dppl_pct=1.0)
    assert both["pick"] == "kivi4" and "Δppl +3.40% > +1%" in both["text"]
    assert recommend(CONFIGS, max_dppl_pct=5.0)["pick"] == "int4"
    cheapest = recommend(CONFIGS, max_kl=1.0)
    assert cheapest["pick"] == "kivi2" and "No measured config is cheaper" in cheapest["text"]


def test_recommend_ties_on_bits_go_to_fewer_bytes():
    a = {"cache": "a", "effective_bits": 4.5, "bytes_per_token": 7000, "kl_mean": 0.01, "delta_ppl_pct": 1.0}
    b = {**a, "cache": "b", "bytes_per_token": 6900}
    assert recommend([a, b], max_kl=0.02)["pick"] == "b"


def test_recommend_says_when_nothing_meets_the_budget():
    rec = recommend(CONFIGS, max_kl=1e-5)
    assert rec["pick"] is None
    assert "no quantized config meets it" in rec["text"] and "keep DynamicCache" in rec["text"]
    assert rec["closest"] == "int8" and "KL 0.0002 > 1e-05" in rec["text"]
    assert recommend(CONFIGS)["pick"] is None and "No quality budget" in recommend(CONFIGS)["text"]


# ------------------------------------------------------------------------------------------ config


BAD = {
    "quality: {mode: fast}": "quality.mode: invalid value 'fast'; allowed: decode, simulated",
    "grid: {contexts: [256, -1]}": "grid.contexts: invalid value -1; allowed: positive integers",
    "grid: {batches: []}": "grid.batches: expected a non-empty list",
    "grid: {lengths: [1]}": "unknown key 'grid.lengths'; allowed: contexts, batches",
    "caches: [dynamic, int3]": "caches: unknown cache or preset 'int3'; allowed: dynamic,",
    "model: {attn_implementation: flash}": "model.attn_implementation: invalid value 'flash'; allowed: sdpa, eager",
    "model: {device: tpu}": "model.device: invalid value 'tpu'; allowed: auto, cpu, cuda, cuda:N",
    "model: {dtype: float8}": "model.dtype: invalid value 'float8'; allowed: float32, float16, bfloat16",
    "capacity: {budget: lots}": "capacity.budget: cannot parse size 'lots'",
    "capacity: {weights_dtype: int3}": "capacity.weights_dtype: unknown dtype 'int3'; allowed: fp32",
    "recommend: {max_kl: low}": "recommend.max_kl: invalid value 'low'; allowed: a number or null",
    "speed: {repeats: 0}": "speed.repeats: invalid value 0; expected an integer >= 1",
    "models: []": "models: expected a non-empty list",
}


@pytest.mark.parametrize("text", list(BAD))
def test_bad_yaml_field_is_named(text, tmp_path):
    path = tmp_path / "sweep_bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(SweepError) as info:
        load_sweep_config(path)
    assert BAD[text] in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_sweep_is_refused_without_cuda():
    with pytest.raises(
        ValueError, match=r"^model\.device: 'cuda' asks for CUDA, but torch sees no CUDA device"
    ):
        load_sweep_config("gpu_8b")
    cfg = load_sweep_config("gpu_8b", {"model.device": "cpu"})  # the rest of the file is valid
    assert cfg.models == ["meta-llama/Llama-3.1-8B-Instruct"] and cfg.model.dtype == "bfloat16"
    assert max(cfg.grid.contexts) == 32768 and cfg.grid.batches == [1, 8, 32]


def test_default_sweep_file():
    cfg = load_sweep_config("default")
    assert cfg.name == "default" and cfg.models == ["smollm2"] and cfg.grid.batches == [1]
    assert cfg.caches[:7] == ["dynamic", "int8", "fp8", "k8v4", "int4", "kivi4", "kivi2"]
    assert "peers" in cfg.caches and cfg.corpus.fallback == "embedded"
    path = _configs_dir() / "sweep_default.yaml"
    assert load_sweep_config(str(path)) == cfg  # by path or by name


# ------------------------------------------------------------------------------------------ CLI


def test_cli_sweep_runs(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import kvquant.eval.preflight as preflight

    monkeypatch.setattr(preflight, "MAX_KL", 0.0)  # every cache that changes a logit is "risky"
    spec = {
        "models": [str(tiny_model_dir)],
        **{k: v for k, v in FAST.items() if "." not in k},
        "corpus": {"name": "embedded"},
        "quality": {"prefix_len": 48, "score_len": 12, "windows": 1},
        "grid": {"contexts": [32], "batches": [1]},
        "speed": {"decode_tokens": 2},
        "capacity": {"budget": "1GiB"},
    }
    path = tmp_path / "sweep_tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    rc = main(
        ["sweep", str(path), "--out", str(out), "--no-progress", "--budget-dppl", "50", "--set", "seed=1"]
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert printed.out.startswith("| model | cache | context |") and "| int4 | 32 | 1 |" in printed.out
    assert "Budget Δppl <= +50%: use " in printed.out  # the flag replaced the YAML's KL budget
    # the risk line kvquant check prints, from the sweep's own quality numbers; DynamicCache is fine
    warned = [line for line in printed.out.splitlines() if line.startswith("warning: ")]
    assert [w.split()[2] for w in warned] == ["int8", "int4"], warned
    assert all(" > 0 " in w or w.endswith("> 0") or "> 0," in w for w in warned)
    assert warned[1] in (out / "results.md").read_text()
    assert {p.name for p in (out / "plots").glob("*.png")} == {
        "quality_vs_bits.png",
        "decode_speed.png",
        "memory_vs_context.png",
        "capacity.png",
    }
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["recommend"] == {"max_kl": None, "max_dppl_pct": 50.0} and saved["seed"] == 1

    rc = main(["sweep", str(path), "--out", str(out), "--no-progress", "--set", "grid.contexts=[0]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "kvquant sweep: error: grid.contexts: invalid value 0; allowed: positive integers"
    ]
