"""``kvquant bench gpu-check``: its plumbing runs here on CPU (tiny generate, the parts' commands, the
time limits, the report); the GPU parts themselves run only on a machine with CUDA."""

import json
import sys

import pytest
import torch

from kvquant.formats import FORMAT_NAMES
from kvquant.kernels.backend import DecodeCall
from kvquant.kernels.triton.backend import BACKEND as TRITON
from kvquant.tools import gpu_check, gpu_generate
from kvquant.tools.bench_kernels import triton_formats
from kvquant.tools.cli import main as cli_main

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")


@no_cuda
def test_without_cuda_it_refuses_in_one_line(tmp_path, capsys):
    assert cli_main(["bench", "gpu-check", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "kvquant bench gpu-check: error: no CUDA device\n"
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu"]) == 2  # cpu only with --tiny
    assert not (tmp_path / "gpu_check.json").exists()


def test_cpu_tiny_runs_the_generate_part_and_reports_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path.parent)  # a relative --out: the parts run in other working directories
    (tmp_path / "generate.json").write_text('{"rows": [{"cache": "stale"}]}')  # an earlier run's
    assert cli_main(["bench", "gpu-check", "--out", tmp_path.name, "--device", "cpu", "--tiny"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parts"]["tests"]["status"] == report["parts"]["kernels"]["status"] == "skipped: needs CUDA"
    gen = report["parts"]["generate"]
    assert gen["rc"] == 0 and not gen["timed_out"]
    assert [r["cache"] for r in gen["rows"]] == ["DynamicCache", *gpu_generate.PRESETS]
    for r in gen["rows"]:
        assert r["status"] == "ok" and r["new_tokens"] == gpu_generate.TINY["new_tokens"]
        assert r["decode_tok_s"] > 0 and r["prefill_s"] > 0 and r["cache_mib"] > 0
    assert gen["rows"][0]["vs_dynamic"] == 1.0
    assert gpu_check.passed(report)
    md = (tmp_path / "gpu_check.md").read_text()
    assert md in capsys.readouterr().out
    assert all(f"| {p} | ok |" in md for p in gpu_generate.PRESETS)


def test_a_part_over_its_limit_is_killed_and_keeps_its_output(tmp_path):
    code = "import time; print('started', flush=True); time.sleep(120)"
    r = gpu_check.run_part([sys.executable, "-c", code], 3, tmp_path / "slow.log")
    assert r["timed_out"] and r["seconds"] < 30
    assert "started" in (tmp_path / "slow.log").read_text()


def test_pytest_counts_come_from_the_verbose_log(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert False\n\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip():\n    pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -q\n")  # as the project's
    log = tmp_path / "run.log"
    cmd = [*gpu_check.pytest_command(), str(tmp_path / "test_three.py")]
    r = gpu_check.run_part(cmd, 120, log, cwd=tmp_path)
    assert r["rc"] == 1 and not r["timed_out"]
    counts = gpu_check.pytest_counts(log)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert [t.split("::")[-1] for t in counts["failed_ids"]] == ["test_bad"]


def test_pytest_counts_read_xdist_lines_and_skip_the_summary(tmp_path):
    log = tmp_path / "grid.log"
    log.write_text(
        "[gw0] [ 33%] PASSED tests/kernels/test_a.py::test_x[64]\n"
        "[gw1] [ 66%] FAILED tests/kernels/test_a.py::test_y[128-int4]\n"
        "[gw0] [100%] SKIPPED tests/kernels/test_b.py::test_z\n"
        "FAILED tests/kernels/test_a.py::test_y[128-int4] - AssertionError\n"
    )
    counts = gpu_check.pytest_counts(log)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failed_ids"] == ["tests/kernels/test_a.py::test_y[128-int4]"]


@no_cuda
def test_the_kernel_part_command_parses(tmp_path):
    """Its flags are accepted: the benchmark gets as far as looking for CUDA."""
    r = gpu_check.part_kernels(tmp_path, 120)
    assert r["rc"] == 2 and r["summary"] == [] and not r["complete"]
    assert "needs a CUDA GPU" in (tmp_path / "kernel_bench.log").read_text()


def test_kernel_formats_are_what_the_triton_backend_declares():
    def declared(f):
        call = DecodeCall.of(f, f, head_dim=128, device="cuda", k_scale_dtype=torch.float16,
                             v_scale_dtype=torch.float16)  # fmt: skip
        return TRITON.supports_decode(call) is None

    formats = triton_formats(128)
    assert "int4" in formats and "none" not in formats
    assert set(formats) == {f for f in FORMAT_NAMES if f != "none" and declared(f)}


def test_kernel_summary_and_markdown():
    rows = [
        {
            "batch": 8,
            "context": c,
            "impl": impl,
            "us": us,
            "speedup_vs_sdpa-fp16": x,
            "pct_copy": 50.0,
            "note": n,
        }
        for c in (1024, 32768)
        for impl, us, x, n in (
            ("sdpa-fp16", 10.0, 1.0, ""),
            ("ours-int4", 5.0, 2.0, ""),
            ("ours-tcq2", None, None, "failed: RuntimeError: x"),
        )  # fmt: skip
    ] + [{"batch": 8, "context": 131072, "impl": "*", "us": None, "note": "skipped: does not fit"}]
    summary = gpu_check.kernel_summary(rows)
    assert [s["impl"] for s in summary] == ["sdpa-fp16", "ours-int4", "ours-tcq2"]
    assert summary[1]["x_sdpa@32768"] == 2.0 and summary[2]["note"].startswith("failed")
    report = {
        "meta": {"device": "H200", "seconds": 1.0, "git_commit": "abc"},
        "parts": {
            "tests": {"grid": {"status": "passed", "seconds": 1, "log": "grid.log",
                               "counts": {"passed": 3, "failed_ids": []}}},
            "kernels": {"status": "done", "seconds": 2, "complete": True, "summary": summary},
            "generate": {"status": "timed out", "rc": None, "timed_out": True},
        },
    }  # fmt: skip
    md = gpu_check.to_markdown(report)
    assert "| ours-int4 | 2.00 | 2.00 | 50 |  |" in md and "x sdpa-fp16 @32768" in md
    assert "grid: passed in 1 s (3 passed)" in md and "timed out" in md
    assert not gpu_check.passed(report)


def _configs_report(default_ok: bool) -> dict:
    rows = [
        {"fmt": "fp16", "config": "sdpa", "us": 240.0, "ok": None},
        {"fmt": "int4", "config": "default", "us": 694.0, "sqnr_db": 97.5, "ok": True},
        {"fmt": "int4", "config": "bt32-w4", "us": 614.0, "sqnr_db": -8.6, "ok": False},
        {"fmt": "tcq3", "config": "default", "us": 5522.0, "sqnr_db": 122.0 if default_ok else -2.3,
         "ok": default_ok},
        {"fmt": "tcq3", "config": "1-stage", "us": None, "note": "skipped: out of time"},
    ]  # fmt: skip
    gen = {"rc": 0, "timed_out": False, "status": "done", "rows": [{"cache": "int4", "status": "ok"}],
           "meta": {"prompt": 32768, "new_tokens": 64, "dtype": "bfloat16", "device": "cuda"}}  # fmt: skip
    parts = {"tests": {"status": "skipped"}, "kernels": {"status": "skipped"}, "generate": gen,
             "configs": {"rc": 0, "timed_out": False, "status": "done", "rows": rows}}  # fmt: skip
    meta = {"device": "H200", "seconds": 1.0, "git_commit": "x"}
    return {"meta": meta, "parts": parts}


def test_configs_part_marks_wrong_outputs_and_fails_only_on_the_shipped_config():
    report = _configs_report(default_ok=True)
    md = gpu_check.to_markdown(report)
    assert "| int4 | 694 µs | | 614 µs WRONG (-9 dB) |" in md.replace("|  |", "| |")
    assert "skipped: out of time" in md
    assert gpu_check.passed(report)  # a wrong output in a config that is not shipped is reported only
    assert not gpu_check.passed(_configs_report(default_ok=False))


def test_configs_part_runs_the_sweep_module(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, limit, log, cwd=None):
        seen["cmd"], seen["limit"] = cmd, limit
        return {"rc": 2, "timed_out": False, "seconds": 0.1, "log": log.name}

    monkeypatch.setattr(gpu_check, "run_part", fake_run)
    r = gpu_check.part_configs(tmp_path, 60)
    cmd = seen["cmd"]
    assert cmd[cmd.index("-m") + 1] == "kvquant.tools.sweep_kernels"
    assert cmd[cmd.index("--formats") + 1 : cmd.index("--configs")] == gpu_check.CONFIG_FORMATS
    assert r["status"] == "failed (rc 2)" and r["rows"] == []
