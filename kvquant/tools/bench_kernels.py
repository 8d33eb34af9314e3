"""GPU benchmark of one decode step's attention: the fused quantized kernel against fp16 baselines.

    python -m kvquant.tools.bench_kernels --out results/bench_decode

For every (batch, context) shape (32 query / 8 KV heads, head_dim 128 by default) it times, with
``triton.testing.do_bench_cudagraph`` (CUDA-graph replays, no launch overhead):

- ``sdpa-fp16``: ``torch.nn.functional.scaled_dot_product_attention`` with one query token over the
  full fp16 KV (GQA through ``enable_gqa``, or ``repeat_interleave`` on older torch),
- ``flash-attn-fp16`` / ``flashinfer-fp16`` when those packages import,
- ``ours-none``: our kernel on the pass-through format (a second fp16 baseline, same code path),
- ``ours-<fmt>``: our kernel for every quantized format the Triton backend reads
  (:func:`triton_formats`, asked of ``kernels.ops``; ``--formats`` picks some), fp16 scales over the
  whole head, through ``ops.decode_attention(backend="triton")``, plus ``ours-int4-kivi`` (keys per
  channel in blocks of 128 tokens, values per token).

The stores are quantized from the first 4,096 tokens of random K/V and tiled along the tokens up to
the context (the time of a decode step does not depend on the values; quantizing 32k tokens of every
format, trellis searches included, would cost more than the timing).

Reported per row: µs per step, effective GB/s (bytes that must be read: codes + scales + zero
points, or the fp16 K/V, plus q and out), that bandwidth as % of a device-to-device copy measured
in the same run, and the speed-up against both fp16 baselines. Shapes whose tensors do not fit in
free memory are skipped. Writes ``bench.json`` (with versions and device) and ``bench.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvquant.tools.kernel_stores import nbytes as _nbytes
from kvquant.tools.kernel_stores import tiled_store as _store

# (format, channels per scale) of the presets (configs/presets: int4, int8, fp8), timed besides one
# scale per head vector
PRESET_GROUPS = (("int4", 64), ("int8", 32), ("fp8_e4m3", 64))


def triton_formats(head_dim: int = 128) -> list[str]:
    """Every quantized format whose decode ``kernels.ops`` runs on the Triton backend on CUDA (fp16
    scales): derived from the backend's declared support, never a list kept here.

    Example:
        >>> "int4" in triton_formats(128)
        True
    """
    from kvquant.formats import FORMAT_NAMES
    from kvquant.kernels import ops

    return [
        f
        for f in FORMAT_NAMES
        if f != "none"
        and ops.backend_for("decode_attention", fmt=f, head_dim=head_dim, device="cuda") == "triton"
    ]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    from triton.testing import do_bench_cudagraph

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_cudagraph(lambda: dst.copy_(src), rep=100)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _baselines(q, k, v, scaling):
    """fp16 baselines: name -> zero-arg callable (or a string: why it is skipped)."""
    import torch.nn.functional as F

    b, hq, d = q.shape
    hkv = k.shape[1]
    q4 = q[:, :, None, :]  # [B, Hq, 1, D]
    out = {}
    try:
        F.scaled_dot_product_attention(q4, k[:, :, :1], v[:, :, :1], scale=scaling, enable_gqa=True)
        out["sdpa-fp16"] = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scaling, enable_gqa=True)
    except (TypeError, RuntimeError):  # no enable_gqa: repeat the KV heads (costs memory, not timed)
        kr = k.repeat_interleave(hq // hkv, dim=1)
        vr = v.repeat_interleave(hq // hkv, dim=1)
        out["sdpa-fp16"] = lambda: F.scaled_dot_product_attention(q4, kr, vr, scale=scaling)
    try:
        from flash_attn import flash_attn_with_kvcache

        kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, T, Hkv, D]
        qf = q[:, None]  # [B, 1, Hq, D]
        seqlens = torch.full((b,), k.shape[2], dtype=torch.int32, device=q.device)
        out["flash-attn-fp16"] = lambda: flash_attn_with_kvcache(
            qf, kc, vc, cache_seqlens=seqlens, softmax_scale=scaling
        )
    except Exception as e:  # optional baseline: any failure is reported
        out["flash-attn-fp16"] = f"skipped: {type(e).__name__}: {e}"[:200]
    try:
        import flashinfer

        page = 16
        t = k.shape[2]
        pages = t // page
        kc = k.transpose(1, 2).reshape(b * pages, page, hkv, d).contiguous()  # NHD pages
        vc = v.transpose(1, 2).reshape(b * pages, page, hkv, d).contiguous()
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * pages
        indices = torch.arange(b * pages, dtype=torch.int32, device=q.device)
        last = torch.full((b,), page, dtype=torch.int32, device=q.device)
        args = (indptr, indices, last, hq, hkv, d, page)
        try:
            wrapper.plan(*args, q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=scaling)
        except TypeError:  # older flashinfer: `data_type`
            wrapper.plan(*args, q_data_type=q.dtype, data_type=k.dtype, sm_scale=scaling)
        out["flashinfer-fp16"] = lambda: wrapper.run(q, (kc, vc))
    except Exception as e:  # optional baseline: any failure is reported
        out["flashinfer-fp16"] = f"skipped: {type(e).__name__}: {e}"[:200]
    return out


def bench_shape(
    b: int, t: int, hq: int, hkv: int, d: int, rep: int, copy_gbs: float, formats: list[str] | None = None
) -> list[dict]:
    from triton.testing import do_bench, do_bench_cudagraph

    from kvquant.kernels import ops

    scaling = d**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16, generator=gen)
    start = torch.zeros(b, dtype=torch.long, device="cuda")
    io_bytes = _nbytes(q) + b * hq * d * 4  # q in, fp32 out
    rows: list[dict] = []

    def record(name, fn, nbytes, note=""):
        if isinstance(fn, str):
            rows.append(dict(batch=b, context=t, impl=name, us=None, note=fn))
            return
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # report it, keep going
            rows.append(
                dict(batch=b, context=t, impl=name, us=None, note=f"failed: {type(e).__name__}: {e}"[:200])
            )
            return
        try:
            ms = do_bench_cudagraph(fn, rep=rep)
        except Exception as e:  # not capturable: time eager launches instead, and say so
            torch.cuda.synchronize()
            ms = do_bench(fn, rep=rep)
            note = f"eager do_bench (graph capture failed: {type(e).__name__})"
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(
            dict(
                batch=b,
                context=t,
                impl=name,
                us=ms * 1e3,
                bytes=nbytes,
                gbs=gbs,
                pct_copy=100 * gbs / copy_gbs,
                note=note,
            )
        )

    fp16_bytes = _nbytes(k, v) + io_bytes
    for name, fn in _baselines(q, k, v, scaling).items():
        record(name, fn, fp16_bytes)
        torch.cuda.empty_cache()

    formats = triton_formats(d) if formats is None else formats
    # (label, format, key axis, key group, value group); None: one scale per head vector
    configs = [("none", "none", "token", None, None)] + [(f, f, "token", None, None) for f in formats]
    if "int4" in formats:
        configs.append(("int4-kivi", "int4", "channel", 128, None))
    # the presets' channel groups: scales per 64 (int4, fp8) or 32 (int8) channels of each token
    configs += [
        (f"{f}-g{g}", f, "token", g, g) for f, g in PRESET_GROUPS if f in formats and d % g == 0 and g < d
    ]
    for label, fmt, axis, kg, vg in configs:
        try:
            if fmt == "none":
                kst, vst = (k, None, None), (v, None, None)
            else:
                kst = _store(k, fmt, kg or d, axis)
                vst = _store(v, fmt, vg or d, "token")
        except Exception as e:  # report it, keep going
            note = f"failed to quantize: {type(e).__name__}: {e}"[:200]
            rows.append(dict(batch=b, context=t, impl=f"ours-{label}", us=None, note=note))
            continue
        kw = dict(
            k_fmt=fmt, v_fmt=fmt, k_group=kg, v_group=vg, k_axis=axis, start=start, end=t, scaling=scaling
        )

        def fn(kst=kst, vst=vst, kw=kw):
            return ops.decode_attention(q, *kst, *vst, **kw, backend="triton")

        record(f"ours-{label}", fn, _nbytes(*kst, *vst) + io_bytes)
        del kst, vst
        torch.cuda.empty_cache()

    by = {r["impl"]: r["us"] for r in rows}
    for r in rows:
        for base in ("sdpa-fp16", "ours-none"):
            r[f"speedup_vs_{base}"] = by[base] / r["us"] if r["us"] and by.get(base) else None
    return rows


def _fits(b: int, t: int, hq: int, hkv: int, d: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    fp16_kv = 2 * b * hkv * t * d * 2
    # K/V + one layout copy for flash-attn / flashinfer + the largest store (int8, ~half) + slack
    return 2.8 * fp16_kv + (2 << 30) < free


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Decode attention: {meta['device']}",
        "",
        f"Hq={meta['hq']}, Hkv={meta['hkv']}, head_dim={meta['d']}, fp16 model dtype; one query token per row. "
        f"Device-to-device copy: {meta['copy_gbs']:.0f} GB/s (read + write). Times: "
        "`triton.testing.do_bench_cudagraph`.",
        "",
        "| batch | context | impl | µs/step | GB/s | % copy BW | × vs sdpa-fp16 | × vs ours-none | note |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]

    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['impl']} | {f(r.get('us'), '.1f')} | {f(r.get('gbs'), '.0f')} | "
            f"{f(r.get('pct_copy'), '.0f')} | {f(r.get('speedup_vs_sdpa-fp16'), '.2f')} | "
            f"{f(r.get('speedup_vs_ours-none'), '.2f')} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (bench.json, bench.md)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=50, help="ms of graph replays per measurement")
    ap.add_argument("--formats", nargs="+", default=None, help="default: every format Triton reads")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvquant.tools.bench_kernels: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    import triton

    t0 = time.time()
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    copy_gbs = copy_bandwidth_gbs()
    meta = dict(
        device=torch.cuda.get_device_name(),
        hq=hq,
        hkv=hkv,
        d=d,
        copy_gbs=copy_gbs,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        git_commit=_git_commit(),
        formats=args.formats or triton_formats(d),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for b in args.batches:
        for t in args.contexts:
            if not _fits(b, t, hq, hkv, d):
                rows.append(
                    dict(batch=b, context=t, impl="*", us=None, note="skipped: does not fit in free memory")
                )
                print(f"batch {b} context {t}: skipped (memory)", flush=True)
                continue
            rows += bench_shape(b, t, hq, hkv, d, args.rep, copy_gbs, meta["formats"])
            torch.cuda.empty_cache()
            print(f"batch {b} context {t}: done ({time.time() - t0:.0f}s)", flush=True)
            _write(args.out, rows, {**meta, "seconds": time.time() - t0, "complete": False})
    meta.update(seconds=time.time() - t0, complete=True)
    _write(args.out, rows, meta)
    print(to_markdown(rows, meta))
    return 0


def _write(out: Path, rows: list[dict], meta: dict) -> None:
    """bench.json + bench.md (after every shape: a run stopped early keeps what it measured)."""
    clean = [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
        for r in rows
    ]
    (out / "bench.json").write_text(json.dumps(dict(meta=meta, rows=clean), indent=1))
    (out / "bench.md").write_text(to_markdown(rows, meta))


if __name__ == "__main__":
    sys.exit(main())
