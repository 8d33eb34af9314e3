"""``kvquant eval``: a run on a local tiny model folder, and bad input -> one line, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvquant.tools.cli import main


def _flags(fast: dict) -> list[str]:
    return [
        "--prefix-len", str(fast["quality.prefix_len"]),
        "--score-len", str(fast["quality.score_len"]),
        "--windows", "2",
        "--retrieval-lengths", "360",
        "--retrieval-trials", "1",
        "--speed-contexts", "32",
        "--decode-tokens", "2",
        "--warmup", "0",
        "--repeats", "1",
        "--no-progress",
    ]  # fmt: skip


def test_cli_run(tmp_path, tiny_model_dir, fast, capsys):
    rc = main(
        ["eval", "--model", str(tiny_model_dir), "--cache", "int8,k8v4", "--output-dir", str(tmp_path)]
        + _flags(fast)
        + ["--set", "retrieval.digits=4"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("| cache | ppl |") and "| dynamic |" in out and "| k8v4 |" in out
    (run_dir,) = tmp_path.iterdir()
    data = json.loads((run_dir / "results.json").read_text())
    assert data["config"]["retrieval"]["digits"] == 4 and data["config"]["caches"] == ["int8", "k8v4"]
    assert [r["cache"] for r in data["records"]] == ["dynamic", "int8", "k8v4"]


def test_cli_tasks_subset(tmp_path, tiny_model_dir, fast, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short for any window, but retrieval builds its own prompts.\n")
    args = ["eval", "--model", str(tiny_model_dir), "--corpus", str(short), "--tasks", "retrieval"]
    assert main(args + ["--output-dir", str(tmp_path / "runs"), *_flags(fast)]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = json.loads((run_dir / "results.json").read_text())["records"]
    tasks = {
        r["cache"]: sorted(k for k in r if k in ("quality", "memory", "speed", "retrieval")) for r in records
    }
    assert tasks == {"dynamic": ["retrieval"], "int8": ["retrieval"], "int4": ["retrieval"]}
    assert "| dynamic |" in capsys.readouterr().out


BAD = {
    "unknown preset": (["--cache", "int3"], "unknown cache or preset 'int3'"),
    "missing corpus": (["--corpus", "no/such/file.txt"], "no such file"),
    "missing config": (["--config", "no-such-config.yaml"], "no such file"),
    "unknown model path": (["--model", "./no/such/model"], "no such file or folder"),
    "corpus too short": (["--corpus", "{short}"], "shorter than 2 window(s)"),
    "context beyond limit": (["--prefix-len", "600"], "beyond the model's limit of 512"),
    "retrieval beyond limit": (["--retrieval-lengths", "1000"], "beyond the model's limit of 512"),
    "bad mode value": (["--set", "quality.mode=fast"], "quality.mode: invalid value 'fast'"),
    "unknown config key": (["--set", "quality.foo=1"], "unknown key 'quality.foo'"),
    "unknown task": (["--tasks", "quality,foo"], "unknown task 'foo'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, tiny_model_dir, fast, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.\n")
    extra, message = BAD[case]
    extra = [a.replace("{short}", str(short)) for a in extra]
    args = ["eval", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "runs"), *_flags(fast)]
    rc = main(args + extra)  # later flags win
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    errors = [line for line in err if "error" in line.lower() or "Traceback" in line]
    assert errors == [err[-1]] and err[-1].startswith("kvquant eval: error: "), err
    assert message in err[-1]
    assert err == [err[-1]]  # with --no-progress, nothing else
    assert not (tmp_path / "runs").exists()  # nothing written for bad input


def test_console_script_exit_status(tmp_path):
    # the installed `kvquant` entry point, in a fresh process: no traceback, status 2
    exe = [sys.executable, "-c", "import sys; from kvquant.tools.cli import main; sys.exit(main())"]
    proc = subprocess.run(
        [*exe, "eval", "--cache", "nope", "--no-progress", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "Traceback" not in proc.stderr and "unknown cache or preset 'nope'" in proc.stderr
