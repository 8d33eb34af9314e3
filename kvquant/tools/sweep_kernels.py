"""Launch-config sweep of the Triton decode kernel: every (format, config) timed and checked.

    python -m kvquant.tools.sweep_kernels --out runs/sweep-kernels          # one H200: ~2 minutes

For one shape (default: batch 8, 32k tokens, 32 query / 8 KV heads, head_dim 128, fp16 q, per-head
fp16 scales; the stores of :mod:`kvquant.tools.bench_kernels`) it runs the kernel under each launch
config of :data:`CONFIGS` (``quantized_decode_attention``'s ``block_t`` / ``num_warps`` /
``num_stages``), compares the output with the fp32 reference (SQNR; the kernel tests' bound is 80
dB) and times it with ``triton.testing.do_bench_cudagraph``, next to fp16 SDPA. A config that gives a
wrong output is marked, not hidden: the sweep is how the defaults in ``decode_attention`` were picked,
and how a new Triton is checked against them. Writes ``sweep.json`` and ``sweep.md`` after every
format (``--budget-s`` stops it early, with what it measured).

Example::

    python -m kvquant.tools.sweep_kernels --out /tmp/sw --formats int4 nuq4 --contexts 8192
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

MIN_SQNR_DB = 80.0  # the decode-kernel tests' bound
CONFIGS: dict[str, dict] = {  # name -> launch knobs; "default" is what the backend launches
    "default": {},
    "1-stage": {"num_stages": 1},
    "3-stage": {"num_stages": 3},
    "bt32-w4": {"block_t": 32, "num_warps": 4},
    "bt32-w4-1stage": {"block_t": 32, "num_warps": 4, "num_stages": 1},
    "bt16-w4-1stage": {"block_t": 16, "num_warps": 4, "num_stages": 1},
    # fewer warps or longer tiles: fewer warp-instructions per token in the offline sm_90 builds
    # (int4 at head_dim 128: 89.5 default, 70.2 / 63.9 / 61.4 for these; docs/measured.md)
    "bt64-w4": {"block_t": 64, "num_warps": 4},
    "bt128-w4": {"block_t": 128, "num_warps": 4},
    "bt64-w2": {"block_t": 64, "num_warps": 2},
}
FORMATS = ["int4", "int8", "fp8_e4m3", "nuq4", "nuq3", "tcq2", "tcq3", "int2", "int3", "nuq2", "tcq1"]


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``got`` against ``ref`` in dB (inf when equal)."""
    noise = (got.double() - ref.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def sweep_shape(
    b: int,
    t: int,
    hq: int,
    hkv: int,
    d: int,
    formats: list[str],
    configs: dict[str, dict],
    timer: Callable[[Callable], float],
    device: str = "cuda",
    deadline: float = math.inf,
    on_row: Callable[[dict], None] = lambda row: None,
) -> list[dict]:
    """Rows ``{fmt, config, knobs, us, x_sdpa, sqnr_db, ok}`` (``timer(fn)``: ms per call) for one shape;
    formats and configs past ``deadline`` (``time.time()``) are listed as skipped."""
    from kvquant.kernels import quantized_decode_attention_ref
    from kvquant.kernels.triton.decode_attention import quantized_decode_attention
    from kvquant.tools.kernel_stores import nbytes as _nbytes
    from kvquant.tools.kernel_stores import tiled_store as _store

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, d, device=device, dtype=torch.float16, generator=gen)  # [B, Hq, D]
    k = torch.randn(b, hkv, t, d, device=device, dtype=torch.float16, generator=gen)  # [B, Hkv, T, D]
    v = torch.randn(b, hkv, t, d, device=device, dtype=torch.float16, generator=gen)
    start = torch.zeros(b, dtype=torch.long, device=device)
    scaling = d**-0.5
    q4 = q[:, :, None, :]
    sdpa_us = 1e3 * timer(
        lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scaling, enable_gqa=True)
    )
    shape = dict(batch=b, context=t)
    rows = [
        dict(**shape, fmt="fp16", config="sdpa", us=sdpa_us, x_sdpa=1.0, gbs=_nbytes(k, v) / sdpa_us / 1e3)
    ]
    on_row(rows[-1])
    out = torch.empty(b, hq, d, device=device)
    lse = torch.empty(b, hq, device=device)
    for fmt in formats:
        if time.time() > deadline:
            rows.append(dict(**shape, fmt=fmt, note="skipped: out of time"))
            continue
        kst, vst = _store(k, fmt, d, "token"), _store(v, fmt, d, "token")
        kw = dict(k_fmt=fmt, v_fmt=fmt, k_group=None, v_group=None, k_axis="token", start=start, end=t,
                  scaling=scaling)  # fmt: skip
        ref, _ = quantized_decode_attention_ref(q, *kst, *vst, **kw)
        for name, knobs in configs.items():
            row = dict(**shape, fmt=fmt, config=name, knobs=knobs)
            if time.time() > deadline:
                rows.append({**row, "note": "skipped: out of time"})
                continue

            def fn(knobs=knobs, kst=kst, vst=vst, kw=kw):
                return quantized_decode_attention(q, *kst, *vst, **kw, out=out, lse=lse, **knobs)

            try:
                out.fill_(float("nan"))
                fn()
                row["sqnr_db"] = sqnr_db(out, ref)
                row["ok"] = row["sqnr_db"] >= MIN_SQNR_DB
                us = 1e3 * timer(fn)
                row.update(us=us, x_sdpa=sdpa_us / us, gbs=_nbytes(*kst, *vst) / us / 1e3)
            except Exception as e:  # report it, keep going
                row["note"] = f"failed: {type(e).__name__}: {' '.join(str(e).split())}"[:300]
            rows.append(row)
            on_row(row)
        del kst, vst, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Decode kernel configs: {meta['device']}", "",
             f"Hq={meta['hq']}, Hkv={meta['hkv']}, head_dim={meta['d']}, fp16 q, per-head fp16 scales; "
             f"µs per call (CUDA graphs); SQNR against the fp32 reference (>= {MIN_SQNR_DB:.0f} dB: ok).", "",
             "| batch | context | format | config | µs | × sdpa-fp16 | GB/s | SQNR dB | ok | note |",
             "|---:|---:|---|---|---:|---:|---:|---:|---|---|"]  # fmt: skip

    def f(x, spec):
        return "" if x is None else format(x, spec)

    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['fmt']} | {r.get('config', '')} | {f(r.get('us'), '.1f')} | "
            f"{f(r.get('x_sdpa'), '.2f')} | {f(r.get('gbs'), '.0f')} | {f(r.get('sqnr_db'), '.1f')} | "
            f"{'' if 'ok' not in r else ('yes' if r['ok'] else 'WRONG')} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def _write(out: Path, rows: list[dict], meta: dict) -> None:
    clean = [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
        for r in rows
    ]
    (out / "sweep.json").write_text(json.dumps(dict(meta=meta, rows=clean), indent=1))
    (out / "sweep.md").write_text(to_markdown(rows, meta))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (sweep.json, sweep.md)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rep", type=int, default=20, help="ms of graph replays per measurement")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new configs after this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvquant.tools.sweep_kernels: needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    from triton.testing import do_bench_cudagraph

    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), hq=args.q_heads, hkv=args.kv_heads, d=args.head_dim)
    rows: list[dict] = []
    for t in args.contexts:
        rows += sweep_shape(
            args.batch, t, args.q_heads, args.kv_heads, args.head_dim, args.formats,
            {c: CONFIGS[c] for c in args.configs}, lambda fn: do_bench_cudagraph(fn, rep=args.rep),
            deadline=t0 + args.budget_s, on_row=lambda row: print(json.dumps(row), flush=True),
        )  # fmt: skip
        _write(args.out, rows, {**meta, "seconds": time.time() - t0})
    print(to_markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
