"""What a run writes beside its numbers (versions, git commit) and the markdown table it prints."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from kvquant.eval.retrieval import lost_and_gained

PACKAGES = tuple(
    "kvquant torch transformers datasets accelerate optimum-quanto hqq triton numpy tqdm psutil evaluate".split()
)


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> dict[str, Any]:
    """Commit of the kvquant checkout (``None`` when not a git checkout or no commit yet) and dirtiness."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "versions": package_versions(),
        "git": git_commit(),
        "platform": platform.platform(),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


# ------------------------------------------------------------------------------------------ tables


def cell(value: Any, fmt: str = "") -> str:
    """One table cell: ``value`` formatted with ``fmt``, ``–`` for ``None``, ``str()`` if it will not format."""
    if value is None:
        return "–"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def scaled(value: Any, factor: float) -> Any:
    return None if value is None else value * factor


def table(head: list[str], rows: list[list[str]], left: int | None = None) -> str:
    """The markdown table every report prints. ``left``: the number of left-aligned (label) columns,
    the others right-aligned (``---:``); ``None``: every column with the plain ``---`` rule."""
    rule = "---|" * len(head) if left is None else "---|" * left + "---:|" * (len(head) - left)
    lines = ["| " + " | ".join(line) + " |" for line in [head, *rows]]
    return "\n".join([lines[0], "|" + rule, *lines[1:]])


def markdown_table(records: list[dict[str, Any]]) -> str:
    """``kvquant eval``'s table: one row per cache: quality, memory, speed (largest context, batch 1),
    passkey accuracy and mean first-token margin (:mod:`kvquant.eval.retrieval`) and the free run (full-precision ppl of the cache's own greedy continuation, its
    ratio to DynamicCache's continuation's, mean first divergent position, share of identical tokens)."""
    speed_ctx = None
    for r in records:
        rows = [s for s in (r.get("speed") or {}).get("rows", []) if s["batch"] == 1]
        if rows:
            speed_ctx = max(s["context"] for s in rows)
            break
    lengths = list(
        dict.fromkeys(n for r in records for n in (r.get("retrieval") or {}).get("accuracy") or {})
    )
    head = ["cache", "ppl", "Δppl", "Δppl %", "KL mean", "KL p90", "KL p99", "top-1"]
    head += ["B/token", "× fp16", "bits held", "bits @16-bit", "bits theory", "peak MB"]
    if speed_ctx is not None:
        head += [f"prefill ms @{speed_ctx}", f"tok/s @{speed_ctx}", "decode × dyn"]
    ref = next(((r.get("retrieval") or {}).get("answers") for r in records if r["cache"] == "dynamic"), None)
    if lengths:
        head += ["passkey " + "/".join(lengths), "margin " + "/".join(lengths)]
        if ref:
            head += ["passkey lost / gained vs dynamic"]
    free = next((r["free_run"] for r in records if r.get("free_run")), None)
    if free is not None:
        head += [f"free-run ppl ({free['tokens']} tok)", "× dyn", "diverges @", "same tokens"]
    lines = []
    for r in records:
        q, m = r.get("quality") or {}, r.get("memory") or {}
        cells = [r["cache"]] + [
            cell(value, fmt)
            for value, fmt in (
                (q.get("ppl"), ".4f"),
                (q.get("delta_ppl"), "+.4f"),
                (scaled(q.get("delta_ppl_rel"), 100), "+.2f"),
                (q.get("kl_mean"), ".5f"),
                (q.get("kl_p90"), ".5f"),
                (q.get("kl_p99"), ".5f"),
                (q.get("top1_agreement"), ".4f"),
                (m.get("bytes_per_token"), ".0f"),
                (m.get("compression_vs_fp16"), ".2f"),
                (m.get("effective_bits"), ".2f"),
                (m.get("effective_bits_16bit"), ".2f"),
                (m.get("theoretical_bits"), ".2f"),
                (scaled(m.get("peak_bytes"), 2**-20), ".1f"),
            )
        ]
        if speed_ctx is not None:
            speed = (r.get("speed") or {}).get("rows", [])
            s = next((s for s in speed if s["batch"] == 1 and s["context"] == speed_ctx), {})
            cells += [cell(s.get("prefill_ms"), ".0f"), cell(s.get("decode_tok_s"), ".2f")]
            cells += [cell(s.get("decode_x"), ".2f")]
        if lengths:
            acc = (r.get("retrieval") or {}).get("accuracy") or {}
            margin = (r.get("retrieval") or {}).get("margin") or {}
            cells.append("/".join(cell(acc.get(n), ".2f") for n in lengths))
            cells.append("/".join(cell(margin.get(n), "+.2f") for n in lengths))
            if ref:
                got = (r.get("retrieval") or {}).get("answers")
                cells.append("-{} / +{}".format(*lost_and_gained(got, ref)) if got else "–")
        if free is not None:
            f = r.get("free_run") or {}
            cells += [cell(f.get("ppl"), ".3f"), cell(f.get("ppl_ratio"), ".3f")]
            cells += [
                cell(f.get("first_divergence"), ".1f"),
                cell(scaled(f.get("identical_fraction"), 100), ".1f"),
            ]
        lines.append(cells)
    return table(head, lines)
