"""``kvquant bench cpu``: decode and prefill speed of every preset against DynamicCache, in one run.

It reports; it never gates on wall time. Contenders (the model runs the ``kvquant`` attention
throughout; caches that hand it plain tensors get SDPA from it):

- ``DynamicCache`` (the baseline every ratio is taken against);
- per preset (default: every shipped preset, ``none`` included: the pass-through row times the
  plumbing alone, no quantization) ``kvquant <preset> (fused)``, the cache read in place by
  ``kernels.ops.decode_attention``, and ``kvquant <preset> (dequant)``, the same cache dequantized
  for SDPA every step (``no_dequant`` leaves those out: they double the run time);
- transformers' ``QuantizedCache`` (quanto int4 / int2) when optimum-quanto is installed.

Decode: per context ``L``, every contender's cache is filled once with an ``L``-token prompt, then
``warmup + repeats`` rounds of ``steps`` greedy steps run, the contenders interleaved round by round
(:func:`kvquant.eval.speed.measure_decode`; the context grows by ``steps`` per round); tokens/s of
the median round. DynamicCache runs right before every other contender in each round (cropped back
to the same context): a ratio is the median over rounds of the two adjacent runs' ratio, and the
ratio to quanto int4 is the ratio of the two contenders' ratios to DynamicCache. On a shared machine
whose speed drifts by tens of percent over seconds, this is what keeps a ratio from moving with the
run order. Prefill: the time of one forward over a ``prefill``-token prompt into a fresh cache,
as a ratio to DynamicCache's time (above 1: slower), median of runs interleaved run by run
(:func:`kvquant.eval.speed.measure_speed`); ``prefill=0`` skips the column. Machine load hits all
contenders alike.

Each preset's row names the backend of :mod:`kvquant.kernels.ops` its decode and quantize calls take
on the model's device (``ops.backend_for``, per segment: main store, then the recent window), e.g.
``cpu`` (the C kernels) or ``chunked`` (torch); the JSON's meta holds them per segment.

``kvquant bench kernels`` (:mod:`kvquant.tools.bench_kernels`) and ``kvquant bench gpu-check``
(:mod:`kvquant.tools.gpu_check`) are the GPU benchmarks.

Example::

    kvquant bench cpu --out runs/bench-cpu                      # every preset, 2k and 4k, prefill 1024
    kvquant bench cpu --presets int4,nuq4 --no-dequant --steps 8
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvquant.attention import enable
from kvquant.cache import KVQuantCache
from kvquant.config import KVQuantConfig, preset_names
from kvquant.formats import format_spec
from kvquant.kernels import ops


def resolve_presets(presets: tuple[str, ...] | list[str] | None) -> list[str]:
    """Preset names (``all`` or None: every shipped preset) or YAML paths, checked; ``ValueError``
    naming the flag otherwise."""
    names: list[str] = []
    for p in presets or ["all"]:
        names += preset_names() if p == "all" else [p]
    if not names:
        raise ValueError("--presets: empty")
    from kvquant.eval.caches import check_calibration_files

    for name in names:
        try:
            check_calibration_files(KVQuantConfig.resolve(name))
        except ValueError as exc:
            if name.endswith((".yaml", ".yml")) or "/" in name:  # a file: say what is wrong with it
                raise ValueError(f"--presets: {' '.join(str(exc).split())}") from None
            allowed = f"all, {', '.join(preset_names())}, or a YAML path"
            raise ValueError(f"--presets: unknown preset {name!r}; allowed: {allowed}") from None
    return list(dict.fromkeys(names))


def check_settings(contexts, steps: int, repeats: int, warmup: int, prefill: int) -> None:
    """``ValueError`` (naming the flag) for settings no benchmark can run with."""
    if not contexts or any(not isinstance(c, int) or c < 1 for c in contexts):
        raise ValueError(f"--contexts: positive token counts, got {list(contexts)}")
    for flag, value, low in (("--steps", steps, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0),
                             ("--prefill", prefill, 0)):  # fmt: skip
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{flag}: an integer >= {low}, got {value!r}")


# ------------------------------------------------------------------------------------------ backends


def _joined(names) -> str:
    return "+".join(dict.fromkeys(names))


def preset_backends(config: KVQuantConfig, num_layers: int, head_dim: int, device: str = "cpu") -> dict:
    """Which ``kernels.ops`` backend a cache of ``config`` runs its calls on, per segment.

    Returns ``{"decode": "cpu", "quantize": "cpu+reference", "segments": [{"segment": "main",
    "decode": ..., "quantize_k": ..., "quantize_v": ...}, ...]}`` (several names joined by ``+`` when
    layers or segments differ). The main store's read also takes the full-precision tokens.

    Example:
        >>> preset_backends(KVQuantConfig.resolve("tcq2-recent"), 2, 64)["segments"][1]["segment"]
        'recent'
    """
    segments: dict[tuple, dict] = {}
    layer_cfgs = [config.for_layer(layer, num_layers) for layer in range(num_layers)]
    for cfg in [c.for_head(h) for c in layer_cfgs for h in (-1, *c.heads)]:  # (-1: the layer's own)
        kg, vg = cfg.group_sizes(head_dim)
        sdt = cfg.torch_scale_dtype
        static = cfg.static_scales is not None
        parts = [("main", cfg.key_format, cfg.value_format, cfg.key_axis, True)]
        if cfg.recent_length:
            parts.append(("recent", cfg.recent_key_format, cfg.recent_value_format, "token", False))
        for name, kf, vf, axis, fp in parts:
            ks = sdt if format_spec(kf).has_scale else None
            vs = sdt if format_spec(vf).has_scale else None
            seg = {
                "segment": name,
                "decode": ops.backend_for(
                    "decode_attention",
                    k_fmt=kf,
                    v_fmt=vf,
                    head_dim=head_dim,
                    device=device,
                    k_axis=axis,
                    k_group=kg,
                    v_group=vg,
                    k_scale_dtype=ks,
                    v_scale_dtype=vs,
                    fp_tokens=fp,
                ),  # fmt: skip
                "quantize_k": ops.backend_for(
                    "quantize_append",
                    fmt=kf,
                    head_dim=head_dim,
                    device=device,
                    group_size=kg,
                    axis=axis,
                    scale_dtype=ks,
                    static_scale=static and ks is not None,
                ),  # fmt: skip
                "quantize_v": ops.backend_for(
                    "quantize_append",
                    fmt=vf,
                    head_dim=head_dim,
                    device=device,
                    group_size=vg,
                    scale_dtype=vs,
                    static_scale=static and vs is not None,
                ),  # fmt: skip
            }
            segments.setdefault(tuple(seg.values()), seg)
    segs = list(segments.values())
    return {
        "decode": _joined(s["decode"] for s in segs),
        "quantize": _joined(b for s in segs for b in (s["quantize_k"], s["quantize_v"])),
        "segments": segs,
    }


# ------------------------------------------------------------------------------------------ contenders


def _caches(model, presets: list[str], dequant: bool = True) -> dict:
    """Contender label -> fresh-cache factory."""
    builds = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for preset in presets:
        builds[f"kvquant {preset} (fused)"] = lambda p=preset: KVQuantCache(model, p, fused=True)
        if dequant:
            builds[f"kvquant {preset} (dequant)"] = lambda p=preset: KVQuantCache(model, p, fused=False)
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


def _backend_labels(model, presets: list[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """(contender label -> "decode / quantize" backends, preset -> per-segment detail for the meta)."""
    from kvquant.eval.caches import kv_geometry

    layers, _, head_dim = kv_geometry(model)
    device = next(model.parameters()).device.type
    labels, detail = {}, {}
    for preset in presets:
        b = preset_backends(KVQuantConfig.resolve(preset), layers, head_dim, device)
        detail[preset] = b
        labels[f"kvquant {preset} (fused)"] = f"{b['decode']} / {b['quantize']}"
        labels[f"kvquant {preset} (dequant)"] = f"sdpa (dequantized) / {b['quantize']}"
    return labels, detail


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def to_markdown(rows: list[dict], contexts: list[int], prefill: int) -> str:
    """One line per contender: decode tok/s and ratios per context, then the prefill time ratio."""
    head = ["cache", "decode / quantize backend"]
    for c in contexts:
        head += [f"tok/s @{c}", f"vs DynamicCache @{c}", f"vs quanto int4 @{c}"]
    if prefill:
        head.append(f"prefill {prefill} time vs DynamicCache")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_label: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_label.setdefault(r["cache"], {})[r["context"]] = r
    for label, per in by_label.items():
        first = next(iter(per.values()))
        cells = [label, first["backend"] or "-"]
        for c in contexts:
            r = per[c]
            cells += [f"{r['tokens_per_s']:.2f}", _fmt(r["vs_dynamic"], ".2f", "x"),
                      _fmt(r["vs_quanto_int4"], ".2f", "x")]  # fmt: skip
        if prefill:
            cells.append(_fmt(first["prefill_vs_dynamic"], ".2f", "x"))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "tok/s: decode, batch 1, median of interleaved runs; `vs`: tok/s ratio (above 1: faster), "
        "median over rounds of the ratio to the DynamicCache run just before (quanto: the ratio of "
        "the two ratios). "
        "Prefill: time ratio (above 1: slower). `none` is the pass-through preset (no quantization).",
    ]
    return "\n".join(lines + notes) + "\n"


def bench_cpu(
    model_name: str | None = None,
    contexts: tuple[int, ...] = (2048, 4096),
    presets: tuple[str, ...] | None = None,
    steps: int = 16,
    repeats: int = 5,
    warmup: int = 1,
    out_dir: str | None = None,
    model=None,
    *,
    prefill: int = 1024,
    dequant: bool = True,
) -> list[dict]:
    """Run the benchmark (see the module docstring); print the markdown table; with ``out_dir`` write
    ``bench_cpu.json`` (meta + rows) and ``bench_cpu.md``.

    Returns one row per (context, contender), by context: ``context, cache, backend, tokens_per_s,
    vs_dynamic, vs_dynamic_rounds`` (each round's ratio), ``vs_quanto_int4, context_prefill_ms``
    (the decode run's own prefill of ``context`` tokens), ``prefill_tokens, prefill_ms,
    prefill_vs_dynamic`` (the prefill column; None when skipped).
    Bad settings or an unknown preset raise ``ValueError`` before the model loads.
    """
    from kvquant.eval.speed import measure_decode, measure_speed, prompt_tokens, with_ratios
    from kvquant.models import load_model

    contexts = list(contexts)
    check_settings(contexts, steps, repeats, warmup, prefill)
    presets = resolve_presets(presets)
    if out_dir:  # an unwritable folder fails now, not after the measurements
        from kvquant.eval.config import check_output_dir

        check_output_dir("--out", out_dir)
    from kvquant.models import weights_label

    if model is None:
        model, _ = load_model(model_name)
        model_label = weights_label(model_name)
    else:  # a model object handed in: named by where its config says it came from
        model_label = weights_label(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    enable(model)
    builds = _caches(model, presets, dequant)
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(100, model.config.vocab_size - 1, (max(contexts + [prefill]),), generator=gen)
    timing = dict(warmup=warmup, repeats=repeats)
    try:
        measured: dict[str, list[dict]] = {label: [] for label in builds}
        for length in contexts:
            ids = prompt_tokens(stream, length, 1)
            decode = measure_decode(
                model, builds, ids, decode_tokens=steps, paired_with="DynamicCache", **timing
            )
            for label, row in decode.items():
                measured[label].append(row)
        pre = None
        if prefill:
            pre = measure_speed(
                model, builds, stream, context_lengths=[prefill], decode_tokens=1, batch_sizes=[1], **timing
            )
    finally:
        model.set_attn_implementation("sdpa")
    backend, detail = _backend_labels(model, presets)
    quanto = {r["context"]: r for r in measured.get("QuantizedCache quanto int4", [])}
    rows = []
    for label, label_rows in measured.items():
        p = None if pre is None else with_ratios(pre[label], pre["DynamicCache"])[0]
        for r in label_rows:
            q = quanto.get(r["context"])
            rows.append(
                {
                    "context": r["context"],
                    "cache": label,
                    "backend": backend.get(label, ""),
                    "tokens_per_s": r["decode_tok_s"],
                    "vs_dynamic": r["paired_x"],
                    "vs_dynamic_rounds": r["paired_rounds"],  # the spread behind the median
                    "vs_quanto_int4": r["paired_x"] / q["paired_x"] if q else None,
                    "context_end": r["context_end"],
                    "context_prefill_ms": r["prefill_ms"],
                    "prefill_tokens": prefill or None,
                    "prefill_ms": p["prefill_ms"] if p else None,
                    "prefill_vs_dynamic": 1 / p["prefill_x"] if p else None,
                }
            )
    rows.sort(key=lambda r: r["context"])
    table = f"Model: {model_label}.\n\n" + to_markdown(rows, contexts, prefill)
    print(table, end="")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        from kvquant.kernels.cpu import native_available, native_error

        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "native_cpu_kernel": native_available(),
            "native_cpu_kernel_error": native_error(),
            "contexts": contexts,
            "presets": presets,
            "steps": steps,
            "repeats": repeats,
            "warmup": warmup,
            "prefill_tokens": prefill or None,
            "dequant": dequant,
            "backends": detail,
        }
        (out / "bench_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "bench_cpu.md").write_text(table)
    return rows
