"""``kvquant bench``: decode speed benchmarks. They report; they never gate on wall time.

``kvquant bench cpu``: decode tokens/s of a model (default: the embedded SmolLM2) at several
context lengths, in one run, for DynamicCache, KVQuantCache with the fused ``kvquant`` attention,
KVQuantCache through the dequantizing path (plain sdpa), and transformers' QuantizedCache (quanto)
when optimum-quanto is installed. Warm-up steps, then the median of repeated timed runs.

``kvquant bench kernels``: the GPU kernel benchmark (``kvquant.kernels.bench``; needs CUDA).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvquant.attention import enable
from kvquant.cache import KVQuantCache


def _caches(model, presets: list[str]):
    """(label, cache factory, attention implementation) for every contender."""
    yield "DynamicCache", lambda: DynamicCache(config=model.config), "sdpa"
    for preset in presets:
        yield f"kvquant {preset} (fused)", lambda p=preset: KVQuantCache(model.config, p), "kvquant"
        yield (
            f"kvquant {preset} (dequant)",
            lambda p=preset: KVQuantCache(model.config, p, fused=False),
            "sdpa",
        )
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache

        for bits in (4, 2):
            yield (
                f"QuantizedCache quanto int{bits}",
                lambda b=bits: QuantizedCache(backend="quanto", config=model.config, nbits=b),
                "sdpa",
            )
    except ImportError:
        pass


@torch.inference_mode()
def decode_tokens_per_s(model, cache_factory, attn: str, context: int, steps: int, repeats: int, warmup: int):
    """Median decode tokens/s after prefilling ``context`` tokens (batch 1)."""
    if attn == "kvquant":
        enable(model)
    else:
        model.set_attn_implementation(attn)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 1, (1, context), generator=gen)
    token = ids[:, -1:]
    rates = []
    for _ in range(repeats):
        cache = cache_factory()
        model(input_ids=ids, cache=cache)
        for _ in range(warmup):
            model(input_ids=token, cache=cache)
        start = time.perf_counter()
        for _ in range(steps):
            model(input_ids=token, cache=cache)
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_cpu(
    model_name: str | None = None,
    contexts: tuple[int, ...] = (2048, 4096),
    presets: tuple[str, ...] = ("int4", "int8"),
    steps: int = 16,
    repeats: int = 3,
    warmup: int = 3,
    out_dir: str | None = None,
) -> list[dict]:
    """Run the CPU decode benchmark; print a markdown table; optionally write JSON + markdown."""
    from kvquant.models import load_model

    model, _ = load_model(model_name)
    rows = []
    contenders = list(_caches(model, list(presets)))
    for context in contexts:
        base = None
        for label, factory, attn in contenders:
            tps = decode_tokens_per_s(model, factory, attn, context, steps, repeats, warmup)
            base = tps if label == "DynamicCache" else base
            rows.append({"context": context, "cache": label, "tokens_per_s": tps, "vs_dynamic": tps / base})
            print(f"  context {context:>6}  {label:<34} {tps:7.2f} tok/s  {tps / base:5.2f}x", flush=True)
    model.set_attn_implementation("sdpa")
    table = ["| context | cache | decode tok/s | vs DynamicCache |", "|---|---|---|---|"]
    table += [
        f"| {r['context']} | {r['cache']} | {r['tokens_per_s']:.2f} | {r['vs_dynamic']:.2f}x |" for r in rows
    ]
    print("\n".join(table))
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "steps": steps,
            "repeats": repeats,
        }
        (out / "bench_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "bench_cpu.md").write_text("\n".join(table) + "\n")
    return rows
