"""What a run writes beside its numbers (versions, git commit) and the markdown table it prints."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

PACKAGES = (
    "kvquant",
    "torch",
    "transformers",
    "datasets",
    "accelerate",
    "optimum-quanto",
    "hqq",
    "triton",
    "numpy",
    "tqdm",
    "psutil",
    "evaluate",
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


# ------------------------------------------------------------------------------------------ table


def _f(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def markdown_table(records: list[dict[str, Any]]) -> str:
    """One row per cache: quality, memory, speed (largest context, batch 1) and passkey accuracy."""
    speed_ctx = None
    for r in records:
        rows = [s for s in (r.get("speed") or {}).get("rows", []) if s["batch"] == 1]
        if rows:
            speed_ctx = max(s["context"] for s in rows)
            break
    retrieval_lengths: list[str] = []
    for r in records:
        for length in (r.get("retrieval") or {}).get("accuracy") or {}:
            if length not in retrieval_lengths:
                retrieval_lengths.append(length)
    head = ["cache", "ppl", "Δppl", "Δppl %", "KL mean", "KL p90", "KL p99", "top-1"]
    head += ["B/token", "× fp16", "bits held", "bits @16-bit", "bits theory", "peak MB"]
    if speed_ctx is not None:
        head += [f"prefill ms @{speed_ctx}", f"tok/s @{speed_ctx}", "decode × dyn"]
    if retrieval_lengths:
        head += ["passkey " + "/".join(retrieval_lengths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        q, m = r.get("quality") or {}, r.get("memory") or {}
        cells = [
            r["cache"],
            _f(q.get("ppl"), ".4f"),
            _f(q.get("delta_ppl"), "+.4f"),
            _f(None if q.get("delta_ppl_rel") is None else 100 * q["delta_ppl_rel"], "+.2f"),
            _f(q.get("kl_mean"), ".5f"),
            _f(q.get("kl_p90"), ".5f"),
            _f(q.get("kl_p99"), ".5f"),
            _f(q.get("top1_agreement"), ".4f"),
            _f(m.get("bytes_per_token"), ".0f"),
            _f(m.get("compression_vs_fp16"), ".2f"),
            _f(m.get("effective_bits"), ".2f"),
            _f(m.get("effective_bits_16bit"), ".2f"),
            _f(m.get("theoretical_bits"), ".2f"),
            _f(None if m.get("peak_bytes") is None else m["peak_bytes"] / 2**20, ".1f"),
        ]
        if speed_ctx is not None:
            rows = [
                s
                for s in (r.get("speed") or {}).get("rows", [])
                if s["batch"] == 1 and s["context"] == speed_ctx
            ]
            s = rows[0] if rows else {}
            cells += [
                _f(s.get("prefill_ms"), ".0f"),
                _f(s.get("decode_tok_s"), ".2f"),
                _f(s.get("decode_x"), ".2f"),
            ]
        if retrieval_lengths:
            acc = (r.get("retrieval") or {}).get("accuracy") or {}
            cells.append("/".join(_f(acc.get(length), ".2f") for length in retrieval_lengths))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
