"""``kvquant bench gpu-check`` (``make gpu-check``): the GPU check in one command.

Four parts, each a subprocess with its own time limit (a part that hangs or crashes costs its limit,
not the run; what it wrote stays and the next part runs):

1. ``tests``: the ``gpu``-marked pytest grid (``pytest tests -m gpu``) and the sm_90 compile test
   (``tests/kernels/test_gpu_compile.py``): JUnit XML and a log each, pass / fail / skip counts;
2. ``kernels``: :mod:`kvquant.tools.bench_kernels` on a short grid (batch 8; contexts 1k / 8k / 32k;
   32 query / 8 KV heads, head_dim 128; CUDA graphs) over every format the Triton backend reads;
3. ``configs``: :mod:`kvquant.tools.sweep_kernels` at batch 8, 32k tokens over a few formats and
   launch configs (:data:`CONFIG_FORMATS` x :data:`CONFIG_NAMES`): µs per call and each output
   against the fp32 reference; a wrong output in the shipped (``default``) config fails the check;
4. ``generate`` (:mod:`kvquant.tools.gpu_generate`): a Llama-shaped random model (8 layers, hidden
   4096, 32 / 8 heads, head_dim 128, bf16), ``model.generate`` of 64 new tokens after a 32k-token
   prompt for DynamicCache and the presets int4, nuq4, fp8, tcq2-recent under the ``kvquant``
   attention (cuDNN's SDPA off): prefill seconds, decode tokens/s, peak CUDA memory, cache bytes.

Budget (``--budget-s``, default 450 s, so the whole run stays under 8 minutes on one H200): compile
test 60 s, test grid 150 s (4 pytest-xdist workers when xdist is installed: the grid's cost is
mostly Triton compiling on the CPU), kernels 100 s, configs 90 s, generate 130 s, each cut to what is
left (the first H200 run took 329 s without the configs part). Over its limit a part is killed and
reported ``timed out`` with what it had written (each part writes after every shape / format /
contender; generate skips, and names, the contenders it has no time left for).

Writes into ``--out``: ``gpu_check.json`` (meta, one record per part), ``gpu_check.md`` (printed at
the end), ``pytest/`` (JUnit + logs), ``kernel_bench/`` (``bench.json``, ``bench.md``),
``configs/`` (``sweep.json``, ``sweep.md``), ``generate.json``. Without CUDA it exits 2 (``no CUDA
device``). ``--device cpu --tiny`` runs the generate part alone on a tiny model on CPU: the plumbing,
for tests.

Example::

    make gpu-check                                   # = kvquant bench gpu-check --out runs/gpu-check
    kvquant bench gpu-check --out /tmp/gc --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvquant.tools.gpu_generate import FULL, run_generate

BUDGET_S = 450
LIMITS = {"compile": 60, "grid": 150, "kernels": 100, "configs": 90, "generate": 130}  # seconds per part
CONFIG_FORMATS = ["int4", "fp8_e4m3", "nuq4", "tcq2", "tcq3"]
CONFIG_NAMES = ["default", "1-stage", "bt32-w4", "bt64-w4", "bt128-w4"]


def _python_m(module: str) -> list[str]:
    """``python -m module`` without the working directory on ``sys.path`` (``-P``, Python >= 3.11):
    a checkout's ``kernels/`` must never import as a top-level module."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", module]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_part(cmd: list[str], limit: float, log: Path, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``) for at most ``limit`` seconds; kill its process group after."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=_env(), start_new_session=True
        )
        try:
            rc, timed_out = proc.wait(timeout=max(limit, 1)), False
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc, timed_out = proc.returncode, True
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.perf_counter() - t0, 1), "log": log.name}


def _tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


# ------------------------------------------------------------------------------------------ part 1: tests


def pytest_counts(log: Path) -> dict[str, Any]:
    """Outcome counts and failed test ids from a ``pytest -v`` log (complete even when killed): lines
    ``<id> PASSED [ 1%]``, or ``[gw0] [ 1%] PASSED <id>`` under xdist; the closing summary's
    ``FAILED <id> - ...`` lines match neither."""
    counts: dict[str, Any] = {}
    failed = []
    outcome = "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
    plain = re.compile(rf"^(\S+::\S+).*? {outcome}\b")
    xdist = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] {outcome} (\S+::\S+)")
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        m = plain.match(line)
        found = (m.group(2), m.group(1)) if m else None
        if found is None and (m := xdist.match(line)):
            found = (m.group(1), m.group(2))
        if found:
            counts[found[0].lower()] = counts.get(found[0].lower(), 0) + 1
            if found[0] in ("FAILED", "ERROR"):
                failed.append(found[1])
    return {**counts, "failed_ids": failed[:30]}


def pytest_command() -> list[str]:
    """pytest beside this Python (else ``python -P -m pytest``), one line per test: ``-vv`` because
    the project's ``addopts`` holds ``-q``, and a killed run still leaves every finished test's line."""
    pytest = Path(sys.executable).with_name("pytest")
    base = [str(pytest)] if pytest.is_file() else _python_m("pytest")
    return base + ["-p", "no:cacheprovider", "-vv", "-rfE", "--durations=10"]


def _tests_dir() -> Path | None:
    import kvquant

    for root in (Path(kvquant.__file__).resolve().parents[1], Path.cwd()):
        if (root / "tests" / "kernels").is_dir() and (root / "pyproject.toml").is_file():
            return root
    return None


def part_tests(out: Path, left) -> dict[str, Any]:
    """Part 1; ``left(name)``: the seconds a run may take, asked when it starts."""
    root = _tests_dir()
    if root is None:
        return {
            "status": "skipped: no tests/ folder beside the installed kvquant or in the working directory"
        }
    base = pytest_command()
    (out / "pytest").mkdir(exist_ok=True)
    import importlib.util

    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    runs = {
        "compile": ["tests/kernels/test_gpu_compile.py"],
        "grid": ["tests", "-m", "gpu", *workers],
    }
    result: dict[str, Any] = {}
    for name, args in runs.items():
        log = out / "pytest" / f"{name}.log"
        junit = out / "pytest" / f"{name}.xml"
        r = run_part(base + args + [f"--junitxml={junit}"], left(name), log, cwd=root)
        r["counts"] = pytest_counts(log)
        r["status"] = (
            "timed out" if r["timed_out"] else ("passed" if r["rc"] == 0 else f"failed (rc {r['rc']})")
        )
        result[name] = r
    return result


# ------------------------------------------------------------------------------------------ part 2: kernels


def part_kernels(out: Path, limit: float) -> dict[str, Any]:
    folder = out / "kernel_bench"
    folder.mkdir(exist_ok=True)
    cmd = _python_m("kvquant.tools.bench_kernels") + [
        "--out", str(folder), "--batches", "8", "--contexts", "1024", "8192", "32768",
        "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--rep", "25",
    ]  # fmt: skip
    r = run_part(cmd, limit, out / "kernel_bench.log", cwd=out)
    r["status"] = "timed out" if r["timed_out"] else ("done" if r["rc"] == 0 else f"failed (rc {r['rc']})")
    data = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").is_file() else None
    r["complete"] = bool(data and data["meta"].get("complete"))
    r["summary"] = kernel_summary(data["rows"]) if data else []
    return r


def kernel_summary(rows: list[dict]) -> list[dict]:
    """Per impl: speed-up against fp16 SDPA at each context, % of copy bandwidth at the longest timed
    context, and the first note (a failure, a skip, an eager fallback)."""
    by: dict[str, dict] = {}
    for r in rows:
        if r.get("impl", "*") == "*":
            continue
        s = by.setdefault(r["impl"], {"impl": r["impl"], "note": ""})
        s["note"] = s["note"] or r.get("note") or ""
        if r.get("us"):
            s[f"x_sdpa@{r['context']}"] = r.get("speedup_vs_sdpa-fp16")
            s["pct_copy"] = r.get("pct_copy")
    return list(by.values())


# ------------------------------------------------------------------------------------------ part 3: configs


def part_configs(out: Path, limit: float) -> dict[str, Any]:
    folder = out / "configs"
    folder.mkdir(exist_ok=True)
    cmd = _python_m("kvquant.tools.sweep_kernels") + [
        "--out", str(folder), "--formats", *CONFIG_FORMATS, "--configs", *CONFIG_NAMES,
        "--budget-s", str(max(limit - 20, 1)),
    ]  # fmt: skip
    r = run_part(cmd, limit, out / "configs.log", cwd=out)
    r["status"] = "timed out" if r["timed_out"] else ("done" if r["rc"] == 0 else f"failed (rc {r['rc']})")
    data = json.loads((folder / "sweep.json").read_text()) if (folder / "sweep.json").is_file() else None
    keys = ("fmt", "config", "us", "x_sdpa", "sqnr_db", "ok", "note")
    r["rows"] = [{k: row.get(k) for k in keys} for row in (data["rows"] if data else [])]
    return r


def configs_markdown(part: dict) -> list[str]:
    """Rows format x config: µs per call, and ``WRONG`` where the output missed the reference."""
    rows = [r for r in part.get("rows", []) if r["fmt"] != "fp16"]
    names = [c for c in CONFIG_NAMES if any(r["config"] == c for r in rows)]
    lines = [f"| format | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    for fmt in dict.fromkeys(r["fmt"] for r in rows):
        cells = []
        for c in names:
            r = next((r for r in rows if r["fmt"] == fmt and r["config"] == c), None)
            if r is None or r.get("us") is None:
                cells.append("" if r is None else (r.get("note") or "")[:40])
            else:
                cells.append(f"{r['us']:.0f} µs" + ("" if r.get("ok") else f" WRONG ({r['sqnr_db']:.0f} dB)"))
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------ report


def _f(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def to_markdown(report: dict) -> str:
    meta, parts = report["meta"], report["parts"]
    lines = [
        f"# GPU check: {meta['device']}",
        "",
        f"{meta['seconds']:.0f} s in all; commit {meta['git_commit']}.",
        "",
    ]
    tests = parts.get("tests", {})
    lines += ["## Tests", ""]
    if "status" in tests:
        lines.append(tests["status"])
    for name, r in tests.items():
        if isinstance(r, dict):
            c = r["counts"]
            counts = ", ".join(f"{v} {k}" for k, v in c.items() if k != "failed_ids") or "no results"
            lines.append(f"- {name}: {r['status']} in {r['seconds']} s ({counts}); log pytest/{r['log']}")
            lines += [f"  - {t}" for t in c["failed_ids"]]
    k = parts.get("kernels", {})
    lines += ["", "## Kernels (batch 8, 32 / 8 heads, head_dim 128, CUDA graphs)", ""]
    if "summary" in k:
        done = "" if k["complete"] else " (incomplete)"
        lines.append(f"{k['status']} in {k['seconds']} s{done}; every row: kernel_bench/bench.md")
        ctxs = sorted(
            {int(key.split("@")[1]) for s in k["summary"] for key in s if key.startswith("x_sdpa@")}
        )
        if ctxs:
            head = " | ".join(f"x sdpa-fp16 @{c}" for c in ctxs)
            lines += ["", f"| impl | {head} | % copy BW (longest) | note |"]
            lines.append("|---|" + "---:|" * (len(ctxs) + 1) + "---|")
            for s in k["summary"]:
                cells = [_f(s.get(f"x_sdpa@{c}"), ".2f") for c in ctxs]
                cells += [_f(s.get("pct_copy"), ".0f"), s["note"]]
                lines.append(f"| {s['impl']} | " + " | ".join(cells) + " |")
    else:
        lines.append(k.get("status", "not run"))
    c = parts.get("configs", {})
    lines += ["", "## Launch configs (batch 8, 32k tokens; configs/sweep.md)", "", c.get("status", "not run")]
    if c.get("rows"):
        lines += [""] + configs_markdown(c)
    g = parts.get("generate", {})
    lines += ["", "## generate (Llama-shaped random model)", "", g.get("status", "not run")]
    if g.get("rows"):
        m = g["meta"]
        lines += ["", f"prompt {m['prompt']} tokens, {m['new_tokens']} new, {m['dtype']}, {m['device']}; "
                  "decode tok/s between the first and the last new token; peak: all CUDA memory allocated "
                  "(weights included)", ""]  # fmt: skip
        lines += [
            "| cache | status | prefill s | decode tok/s | vs DynamicCache | peak GiB | cache MiB |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in g["rows"]:
            nums = [("prefill_s", ".2f"), ("decode_tok_s", ".1f"), ("vs_dynamic", ".2f"),
                    ("peak_mem_gib", ".2f"), ("cache_mib", ".4g")]  # fmt: skip
            cells = [r["cache"], r["status"]] + [_f(r.get(key), spec) for key, spec in nums]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _git_commit() -> str | None:
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
        return r.stdout.strip() or None
    except OSError:
        return None


def check(out: Path, device: str = "cuda", tiny: bool = False, budget: float = BUDGET_S, gen_args=()) -> dict:
    """Run the parts (see the module docstring); write and return the report."""
    out = out.resolve()  # the parts run in other working directories
    out.mkdir(parents=True, exist_ok=True)
    stale_files = ("generate.json", "kernel_bench/bench.json", "kernel_bench/bench.md", "configs/sweep.json",
                   "configs/sweep.md", "gpu_check.json")  # fmt: skip
    for stale in stale_files:
        (out / stale).unlink(missing_ok=True)  # an earlier run's results must not pass for this one's
    t0 = time.perf_counter()

    def left(part: str) -> float:
        return min(LIMITS[part], budget - (time.perf_counter() - t0))

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (tiny)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "git_commit": _git_commit(), "budget_s": budget, "limits_s": LIMITS,
    }  # fmt: skip
    parts: dict[str, Any] = {}
    if device == "cuda":
        parts["tests"] = part_tests(out, left)
        parts["kernels"] = part_kernels(out, left("kernels"))
        parts["configs"] = part_configs(out, left("configs"))
    else:
        parts["tests"] = {"status": "skipped: needs CUDA"}
        parts["kernels"] = {"status": "skipped: needs CUDA"}
        parts["configs"] = {"status": "skipped: needs CUDA"}
    cmd = _python_m("kvquant.tools.gpu_check") + ["--part", "generate", "--out", str(out), "--device", device]
    limit = left("generate")
    cmd += ["--budget-s", str(max(limit - 15, 1)), *gen_args] + (["--tiny"] if tiny else [])
    g = run_part(cmd, limit, out / "generate.log", cwd=out)
    g["status"] = "timed out" if g["timed_out"] else ("done" if g["rc"] == 0 else f"failed (rc {g['rc']})")
    if g["rc"] not in (0, None) and not g["timed_out"]:
        g["status"] += ": " + " ".join(_tail(out / "generate.log", 3).split())[-300:]
    if (out / "generate.json").is_file():
        g |= json.loads((out / "generate.json").read_text())
    parts["generate"] = g
    meta["seconds"] = time.perf_counter() - t0
    report = {"meta": meta, "parts": parts}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(to_markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvquant bench gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny model and prompt (with --device cpu: tests)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all parts together")
    ap.add_argument("--prompt", type=int, default=None, help=f"generate: prompt tokens ({FULL['prompt']})")
    ap.add_argument(
        "--new-tokens", type=int, default=None, help=f"generate: new tokens ({FULL['new_tokens']})"
    )
    ap.add_argument("--part", choices=["generate"], help=argparse.SUPPRESS)  # the subprocess of part 4
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kvquant bench gpu-check: error: no CUDA device", file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.tiny:
        print("kvquant bench gpu-check: error: --device cpu runs only with --tiny", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "generate":
        return run_generate(args.out, args.device, args.tiny, args.budget_s, args.prompt, args.new_tokens)
    gen_args = ["--prompt", str(args.prompt)] if args.prompt else []
    gen_args += ["--new-tokens", str(args.new_tokens)] if args.new_tokens else []
    report = check(args.out, args.device, args.tiny, args.budget_s, gen_args)
    print((args.out / "gpu_check.md").read_text())
    print(f"results: {args.out} (gpu_check.json, gpu_check.md)")
    return 0 if passed(report) else 1


def passed(report: dict) -> bool:
    """Every part that ran finished in time and without a failure (skipped parts do not count)."""
    parts = report["parts"]
    runs = [r for r in parts["tests"].values() if isinstance(r, dict)]
    runs += [parts[p] for p in ("kernels", "configs", "generate") if "rc" in parts.get(p, {})]
    rows_ok = all(r["status"] == "ok" for r in parts["generate"].get("rows", []))
    rows_ok &= all(
        r.get("ok") is not False for r in parts.get("configs", {}).get("rows", []) if r["config"] == "default"
    )
    return (
        rows_ok
        and bool(parts["generate"].get("rows"))
        and all(r["rc"] == 0 and not r["timed_out"] for r in runs)
    )


if __name__ == "__main__":
    sys.exit(main())
