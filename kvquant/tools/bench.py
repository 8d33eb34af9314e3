"""``kvquant bench``: decode speed benchmarks. They report; they never gate on wall time.

``kvquant bench cpu``: decode tokens/s of a model (default: the embedded SmolLM2) at several
context lengths, in one run (runs interleaved so machine load hits all alike), for DynamicCache,
KVQuantCache with the fused ``kvquant`` attention (the native C kernel when it is built, else the
chunked torch path; the JSON's meta says which),
KVQuantCache through the dequantizing path (plain sdpa), and transformers' QuantizedCache (quanto)
when optimum-quanto is installed. Warm-up runs, then the median of repeated timed runs.

``kvquant bench kernels``: the GPU kernel benchmark (``kvquant.tools.bench_kernels``; needs CUDA).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from kvquant.attention import enable
from kvquant.cache import KVQuantCache


def _caches(model, presets: list[str]) -> dict:
    """Contender label -> fresh-cache factory. The model runs the ``kvquant`` attention throughout:
    caches that hand it plain tensors (DynamicCache, quanto, ``fused=False``) get SDPA from it."""
    builds = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for preset in presets:
        builds[f"kvquant {preset} (fused)"] = lambda p=preset: KVQuantCache(model.config, p, fused=True)
        builds[f"kvquant {preset} (dequant)"] = lambda p=preset: KVQuantCache(model.config, p, fused=False)
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache

        for bits in (4, 2):
            builds[f"QuantizedCache quanto int{bits}"] = lambda b=bits: QuantizedCache(
                backend="quanto", config=model.config, nbits=b
            )
    except ImportError:
        pass
    return builds


def bench_cpu(
    model_name: str | None = None,
    contexts: tuple[int, ...] = (2048, 4096),
    presets: tuple[str, ...] = ("int4", "int8"),
    steps: int = 16,
    repeats: int = 3,
    warmup: int = 1,
    out_dir: str | None = None,
    model=None,
) -> list[dict]:
    """Run the CPU decode benchmark (runs of all contenders interleaved, medians; see
    :func:`kvquant.eval.speed.measure_speed`); print a markdown table; optionally write JSON + markdown."""
    from kvquant.eval.speed import measure_speed
    from kvquant.models import load_model

    if model is None:
        model, _ = load_model(model_name)
    enable(model)
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(100, model.config.vocab_size - 1, (max(contexts),), generator=gen)
    try:
        measured = measure_speed(model, _caches(model, list(presets)), stream, context_lengths=list(contexts),
                                 batch_sizes=[1], decode_tokens=steps, warmup=warmup, repeats=repeats)  # fmt: skip
    finally:
        model.set_attn_implementation("sdpa")
    base = {r["context"]: r["decode_tok_s"] for r in measured["DynamicCache"]}
    quanto = {r["context"]: r["decode_tok_s"] for r in measured.get("QuantizedCache quanto int4", [])}
    rows = [
        {
            "context": r["context"],
            "cache": label,
            "tokens_per_s": r["decode_tok_s"],
            "vs_dynamic": r["decode_tok_s"] / base[r["context"]],
            "vs_quanto_int4": r["decode_tok_s"] / quanto[r["context"]] if quanto else None,
        }  # fmt: skip
        for label, label_rows in measured.items()
        for r in label_rows
    ]
    rows.sort(key=lambda r: r["context"])
    table = ["| context | cache | decode tok/s | vs DynamicCache | vs quanto int4 |", "|---|---|---|---|---|"]
    table += [
        f"| {r['context']} | {r['cache']} | {r['tokens_per_s']:.2f} | {r['vs_dynamic']:.2f}x | "
        + ("n/a" if r["vs_quanto_int4"] is None else f"{r['vs_quanto_int4']:.2f}x")
        + " |"
        for r in rows
    ]
    print("\n".join(table))
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        from kvquant.kernels.cpu import native_available, native_error

        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "native_cpu_kernel": native_available(),
            "native_cpu_kernel_error": native_error(),
            "steps": steps,
            "repeats": repeats,
        }
        (out / "bench_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "bench_cpu.md").write_text("\n".join(table) + "\n")
    return rows
