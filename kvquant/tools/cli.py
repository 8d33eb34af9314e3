"""The ``kvquant`` command.

Example::

    kvquant demo                      # embedded SmolLM2: generate with a KV cache, print the text
    kvquant demo --prompt "Hi" -n 16
    kvquant eval --cache int4 --corpus wikitext2   # quality/memory/speed

Subcommands are added with one ``_add_<name>`` function each, registered in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvquant.tools.arguments import (
    USER_ERRORS,
    OneLineParser,
    check_cache,
    check_output_file,
    describe,
    flagged,
    flagged_fields,
    float_above,
    float_in,
    int_at_least,
    ints_at_least,
)

# ------------------------------------------------------------------------------------------ demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvquant.tools.demo import run

    check_cache("--cache", args.cache)
    return run(args.model, args.prompt, args.max_new_tokens, args.cache, check=args.check)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate with the embedded model and a KV cache, print the text")
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--prompt", default=None, help="user message (default: a fixed paragraph request)")
    p.add_argument("-n", "--max-new-tokens", type=int_at_least(1), default=128, help="(default: 128)")
    # nuq4, not int4: per-token int4 without a rotation collapses on models with outlier key
    # channels (issue 16: +20-43% perplexity on a Gemma-shaped model, nuq4 +1-3%)
    p.add_argument("--cache", default="nuq4", help="preset name or YAML path (default: nuq4)")
    p.add_argument(
        "--check",
        action="store_true",
        help="also run kvquant check's corpus preflight (about 20-25 s); the demo warns from its own "
        "quality numbers either way",
    )
    p.set_defaults(func=_cmd_demo)


# ------------------------------------------------------------------------------------------ check


def _cmd_check(args: argparse.Namespace) -> int:
    from kvquant.tools.check import run

    check_cache("--cache", args.cache)
    return run(
        args.model,
        args.cache,
        strict=args.strict,
        prefix_len=args.prefix_len,
        score_len=args.tokens,
        windows=args.windows,
    )


def _add_check(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.preflight import MAX_KL, MIN_TOP1, PREFIX_LEN, SCORE_LEN, WINDOWS

    p = sub.add_parser(
        "check",
        help="~30 s preflight: teacher-forced KL / ppl / top-1 and bits of one cache config, risk warning",
        description="Teacher-forced decode-mode comparison of one cache config against DynamicCache on "
        f"short windows of the embedded corpus. Warns when mean KL > {MAX_KL:g} or top-1 < "
        f"{100 * MIN_TOP1:g}%%. Exit status: 0 (also when risky, unless --strict: then 1); bad input 2.",
    )
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--cache", required=True, help="preset name or YAML path")
    p.add_argument("--strict", action="store_true", help="exit status 1 when the config is risky")
    p.add_argument(
        "--prefix-len",
        type=int_at_least(1),
        default=PREFIX_LEN,
        help=f"tokens prefilled per window (default {PREFIX_LEN})",
    )
    p.add_argument(
        "--tokens",
        type=int_at_least(2),
        default=SCORE_LEN,
        help=f"tokens teacher-forced and scored per window (default {SCORE_LEN})",
    )
    p.add_argument(
        "--windows", type=int_at_least(1), default=WINDOWS, help=f"corpus windows (default {WINDOWS})"
    )
    p.set_defaults(func=_cmd_check)


# ------------------------------------------------------------------------------------------ eval, sweep
# Their flags are derived from the config dataclasses (kvquant.eval.flags): a new field is a new flag.


def _overrides(args: argparse.Namespace, cls: type) -> dict:
    """``--set``, then ``--tasks``, then the flags derived from ``cls``: later wins. A quality-budget
    flag replaces the YAML's whole budget (``--budget-dppl 1`` drops its ``max_kl``)."""
    from kvquant.eval.config import parse_set
    from kvquant.eval.flags import config_overrides, tasks_overrides

    overrides = parse_set(args.set or [])
    if getattr(args, "tasks", None) is not None:
        overrides |= tasks_overrides(args.tasks)
    flags = config_overrides(args, cls)
    if any(key.startswith("recommend.") for key in flags):
        overrides |= {"recommend.max_kl": None, "recommend.max_dppl_pct": None}
    return overrides | flags


@contextlib.contextmanager
def _messages(command: str, level: int):
    """The harness's log messages on stderr, as ``kvquant <command>: ...``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"kvquant {command}: %(message)s"))
    log = logging.getLogger("kvquant.eval")
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _set_flag(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override any key, e.g. {example}")


def _cmd_eval(args: argparse.Namespace) -> int:
    from kvquant.eval import EvalConfig, load_config, run_eval

    with _messages("eval", logging.INFO):
        result = run_eval(load_config(args.config, _overrides(args, EvalConfig)))
    print(result.table)
    print(f"\nresults: {result.run_dir}")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.config import TASKS, EvalConfig
    from kvquant.eval.flags import add_config_flags

    p = sub.add_parser(
        "eval",
        help="quality, retrieval, memory and speed of cache configs against DynamicCache",
        description="Settings: dataclass defaults -> --config YAML -> --set KEY=VALUE -> --tasks -> "
        "the flags below. See eval/README.md.",
    )
    p.add_argument(
        "--config", default=None, help="YAML file, or a name shipped in configs/eval/ (e.g. default)"
    )
    _set_flag(p, "speed.repeats=5")
    p.add_argument("--tasks", help=f"comma-separated subset of {','.join(TASKS)} (default: all)")
    add_config_flags(p, EvalConfig)
    p.set_defaults(func=_cmd_eval)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from kvquant.eval.sweep import run_sweep
    from kvquant.eval.sweep_config import SweepConfig

    overrides = _overrides(args, SweepConfig)
    with _messages("sweep", logging.INFO if overrides.get("progress", True) else logging.WARNING):
        result = run_sweep(args.config, overrides=overrides)
    print(result.table)
    print()
    for rec in result.recommendations:
        print(("" if len(result.recommendations) == 1 else f"{rec['model']}: ") + rec["text"])
    if result.warnings:
        print()
        print("\n".join(result.warnings))
    print(f"\nresults: {result.out_dir} (results.md, results.csv, results.jsonl, plots/)")
    return 0


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.flags import add_config_flags
    from kvquant.eval.sweep_config import SweepConfig

    p = sub.add_parser(
        "sweep",
        help="cache configs x context lengths x batch sizes: table, plots and a recommendation",
        description="Settings: dataclass defaults (shown below) -> the sweep YAML -> --set KEY=VALUE -> "
        "the flags below; a --budget-* flag replaces the YAML's whole budget. "
        "See configs/sweep_default.yaml (every key, commented) and README.md.",
    )
    p.add_argument("config", help="sweep YAML, or a shipped name (default = configs/sweep_default.yaml)")
    _set_flag(p, "grid.contexts=[256]")
    add_config_flags(p, SweepConfig)
    p.set_defaults(func=_cmd_sweep)


# ------------------------------------------------------------------------------------------ bench, calibrate


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "kernels":
        import torch

        from kvquant.tools.bench_kernels import main as kernels_main

        if not torch.cuda.is_available():
            raise ValueError(
                "kernels: needs a CUDA GPU, and torch sees none here; allowed on this machine: cpu"
            )

        return kernels_main(["--out", args.out or "runs/bench-kernels"])
    if args.target == "gpu-check":
        from kvquant.tools.gpu_check import main as gpu_check_main

        argv = ["--out", args.out or "runs/gpu-check", "--device", args.device]
        return gpu_check_main(argv + (["--tiny"] if args.tiny else []))
    from kvquant.tools.bench import bench_cpu, check_settings, resolve_presets

    # bad flags fail here, before the model loads
    check_settings(args.contexts, args.steps, args.repeats, args.warmup, args.prefill)
    presets = resolve_presets(args.presets)
    if args.out:
        from kvquant.eval.config import check_output_dir

        check_output_dir("--out", args.out)
    from kvquant.models import load_model

    model, _ = flagged("--model", load_model, args.model)
    bench_cpu(
        args.model,
        tuple(args.contexts),
        tuple(presets),
        args.steps,
        args.repeats,
        args.warmup,
        out_dir=args.out,
        prefill=args.prefill,
        dequant=not args.no_dequant,
        model=model,
    )
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval.flags import flag_type

    p = sub.add_parser(
        "bench",
        help="speed: 'cpu' (every preset vs DynamicCache), 'kernels' (GPU kernels), 'gpu-check' (GPU)",
        description="cpu: decode tok/s and prefill time of every preset against DynamicCache "
        "(kvquant.tools.bench). kernels: the GPU kernel benchmark. gpu-check: GPU test grid + short kernel "
        "benchmark + long-context generate, JSON + markdown in --out (kvquant.tools.gpu_check).",
    )
    p.add_argument("target", choices=["cpu", "kernels", "gpu-check"])
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--contexts", type=ints_at_least(1), default=[2048, 4096], help="(default: 2048,4096)")
    p.add_argument(
        "--presets", type=flag_type(list[str]), default=["all"], help="comma-separated, or all (default)"
    )
    p.add_argument("--steps", type=int_at_least(1), default=16, help="decode steps per timed round")
    p.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=5,
        help="timed rounds (median; cpu: each against a DynamicCache run just before it)",
    )
    p.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed runs first")
    p.add_argument(
        "--prefill",
        type=int_at_least(0),
        default=1024,
        help="prompt tokens of the prefill column (0: no column)",
    )
    p.add_argument(
        "--no-dequant", action="store_true", help="leave out the dequantizing contenders (half the time)"
    )
    p.add_argument("--out", default=None, help="folder for JSON + markdown results")
    p.add_argument("--device", default="cuda", help="gpu-check: cuda, or cpu with --tiny (plumbing test)")
    p.add_argument("--tiny", action="store_true", help="gpu-check: tiny shapes (plumbing test)")
    p.set_defaults(func=_cmd_bench)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from kvquant.config import KVQuantConfig
    from kvquant.eval.config import CorpusSection
    from kvquant.eval.corpus import load_corpus, tokenize
    from kvquant.models import load_model
    from kvquant.tools.calibrate import calibrate_key_map, calibrate_static_scales

    if args.retrieval and args.retrieval_count:
        raise ValueError("--retrieval-count: give either --retrieval or --retrieval-count, not both")
    if args.retrieval_count:
        return _calibrate_retrieval_count(args)
    if args.retrieval:
        return _calibrate_retrieval(args)
    if args.key_map:  # the config the map is for (smoothing: query becomes mean)
        cfg = check_cache("--cache", args.cache).with_key_map(args.out)
    else:
        cfg = KVQuantConfig(key_format=args.format, value_format=args.format, rotation=args.rotation)
    check_output_file("--out", args.out)
    corpus = flagged("--corpus", load_corpus, CorpusSection(name=args.corpus))
    model, tok = flagged("--model", load_model, args.model)
    ids = tokenize(tok, corpus.text)[None, : args.tokens]  # [1, N]
    if args.key_map:
        meta = {"model": args.model or "smollm2", "corpus": args.corpus, "cache": cfg.name}
        maps = flagged(
            "--tokens", calibrate_key_map, model, ids, cfg, args.out, exponent=args.exponent, meta=meta
        )
        print(
            f"wrote {args.out}: key maps of {len(maps)} layers, {tuple(next(iter(maps.values())).shape)} each, "
            f"from {ids.shape[1]} tokens of {args.corpus}; use it as `key_map: {args.out}`"
        )
        return 0
    scales = calibrate_static_scales(model, ids, cfg, args.out, margin=args.margin)
    print(
        f"wrote {args.out}: keys {tuple(scales['keys'].shape)}, values {tuple(scales['values'].shape)} "
        f"from {ids.shape[1]} tokens; use it as `static_scales: {args.out}` with key/value_format {args.format}"
    )
    return 0


def _retrieval_inputs(args: argparse.Namespace):
    """``--cache``'s config, the model and its tokenizer for ``calibrate --retrieval[-count]``, each
    flag checked (``--out`` writable, ``--length`` within the model's context) before the long part."""
    from kvquant.models import load_model

    cfg = check_cache("--cache", args.cache)
    check_output_file("--out", args.out)
    model, tok = flagged("--model", load_model, args.model)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and args.length > limit:
        raise ValueError(f"--length: {args.length} is above the model's context ({limit})")
    return cfg, model, tok


def _calibrate_retrieval(args: argparse.Namespace) -> int:
    """``kvquant calibrate --retrieval``: the cache's config with its retrieval layers' keys protected."""
    from kvquant.eval.retrieval_layers import SEARCH_MAX_LAYERS, SEARCH_TRIALS, find_retrieval_layers
    from kvquant.formats import FORMAT_NAMES

    if args.protect_format not in FORMAT_NAMES:
        raise ValueError(
            f"--protect-format: invalid value {args.protect_format!r}; allowed: {', '.join(FORMAT_NAMES)}"
        )
    cfg, model, tok = _retrieval_inputs(args)
    start = time.perf_counter()
    max_layers = SEARCH_MAX_LAYERS if args.max_layers is None else args.max_layers
    trials = SEARCH_TRIALS if args.trials is None else args.trials
    found = find_retrieval_layers(
        model,
        tok,
        cfg,
        length=args.length,
        trials=trials,
        protect_format=args.protect_format,
        max_layers=max_layers,
        tolerance=args.tolerance,
        progress=print,
    )
    minutes = (time.perf_counter() - start) / 60
    out = dataclasses.replace(found.config, name=Path(args.out).stem)
    head = [
        f"# kvquant calibrate --retrieval --cache {args.cache} --length {args.length} --trials {trials} "
        f"--protect-format {args.protect_format} --max-layers {max_layers} --tolerance {args.tolerance}",
        f"# model: {args.model or 'smollm2 (embedded)'}; retrieval layers (keys in {args.protect_format}): "
        f"{found.layers or 'none'}; for this model only; {minutes:.1f} min",
        f"# passkey first-token margin, mean of {trials} prompts (seed 1): full precision "
        f"{found.reference:+.3f}; {cfg.name} {found.margins[0]:+.3f}"
        + "".join(f", +L{found.layers[i]} {m:+.3f}" for i, m in enumerate(found.margins[1:])),
    ]
    Path(args.out).write_text("\n".join(head) + "\n" + out.to_yaml())
    print(f"wrote {args.out}: layers {found.layers or 'none'}; use it as --cache {args.out}")
    return 0


def _calibrate_retrieval_count(args: argparse.Namespace) -> int:
    """``kvquant calibrate --retrieval-count``: the cache's config with the probed retrieval layers it
    needs (``retrieval_layers: N``), N chosen on passkey prompts."""
    from kvquant.eval.retrieval_layers import COUNT_MAX, COUNT_TRIALS, find_retrieval_count

    cfg, model, tok = _retrieval_inputs(args)
    start = time.perf_counter()
    max_count = COUNT_MAX if args.max_layers is None else args.max_layers
    trials = COUNT_TRIALS if args.trials is None else args.trials
    (found,) = find_retrieval_count(
        model,
        tok,
        [cfg],
        lengths=(args.length,),
        trials=trials,
        max_count=max_count,
        tolerance=args.tolerance,
        progress=print,
    )
    minutes = (time.perf_counter() - start) / 60
    out = dataclasses.replace(found.config, name=Path(args.out).stem)
    ref = sum(found.reference) / len(found.reference)
    head = [
        f"# kvquant calibrate --retrieval-count --cache {args.cache} --length {args.length} --trials {trials} "
        f"--max-layers {max_count} --tolerance {args.tolerance}",
        f"# model: {args.model or 'smollm2 (embedded)'}; retrieval_layers {found.count}; for this model only; "
        f"{minutes:.1f} min",
        f"# passkey prompts (seed 1) whose first token leads / mean capped first-token margin: full precision "
        f"{sum(m > 0 for m in found.reference)}/{len(found.reference)} {ref:+.3f}; "
        + ", ".join(f"{n}: {found.answered(n)} {found.capped(n):+.3f}" for n in found.margins),
    ]
    Path(args.out).write_text("\n".join(head) + "\n" + out.to_yaml())
    print(f"wrote {args.out}: retrieval_layers {found.count}; use it as --cache {args.out}")
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    from kvquant.eval import retrieval_layers as rl

    p = sub.add_parser(
        "calibrate",
        help="static per-(layer, head) int8 / fp8 scales or key maps from calibration text, or the layers "
        "passkey retrieval needs (--retrieval)",
    )
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument(
        "--key-map",
        action="store_true",
        help="write a key map (use it as `key_map: FILE` in a cache config) instead of static scales",
    )
    p.add_argument(
        "--cache",
        default="nuq4",
        help="key map: the preset / YAML whose smoothing, sinks and residual it is for (default: nuq4)",
    )
    p.add_argument(
        "--exponent",
        type=float_in(0.0, 1.0),
        default=0.75,
        help="key map: 1 = the least expected score error, 0 = no map (default: 0.75)",
    )
    p.add_argument("--corpus", default="embedded", help="'embedded', 'wikitext2' or a local .txt/.jsonl file")
    p.add_argument("--tokens", type=int_at_least(1), default=4096, help="calibration tokens (default: 4096)")
    p.add_argument(
        "--format", default="int8", choices=["int8", "fp8_e4m3", "fp8_e5m2"], help="static scales: the format"
    )
    p.add_argument(
        "--rotation", default="none", choices=["none", "hadamard"], help="static scales: the rotation"
    )
    p.add_argument(
        "--margin", type=float_above(0), default=1.0, help="multiplies the observed maximum (default: 1.0)"
    )
    p.add_argument(
        "--retrieval",
        action="store_true",
        help="write --cache's config with the keys of the layers passkey retrieval needs kept in "
        "--protect-format (a YAML cache config; kvquant.eval.retrieval_layers)",
    )
    p.add_argument(
        "--length", type=int_at_least(256), default=4096, help="retrieval: prompt tokens (default: 4096)"
    )
    p.add_argument(
        "--trials",
        type=int_at_least(1),
        default=None,
        help=f"retrieval: prompts (default: {rl.SEARCH_TRIALS}; {rl.COUNT_TRIALS} with --retrieval-count)",
    )
    p.add_argument(
        "--protect-format", default="nuq4", help="retrieval: a chosen layer's key format (default: nuq4)"
    )
    p.add_argument(
        "--retrieval-count",
        action="store_true",
        help="write --cache's config with the number of probed retrieval layers (retrieval_layers) that "
        "passkey prompts need (kvquant.eval.retrieval_layers.find_retrieval_count)",
    )
    p.add_argument(
        "--max-layers",
        type=int_at_least(0),
        default=None,
        help=f"retrieval: at most this many layers (default: {rl.SEARCH_MAX_LAYERS}; {rl.COUNT_MAX} with "
        "--retrieval-count)",
    )
    p.add_argument(
        "--tolerance",
        type=float_above(0),
        default=0.1,
        help="retrieval: stop within this many logits of the full-precision margin (default: 0.1)",
    )
    p.add_argument("--out", required=True, help="output file (.pt; .yaml with --retrieval)")
    p.set_defaults(func=_cmd_calibrate)


# ------------------------------------------------------------------------------------------ export


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from kvquant.config import KVQuantConfig
    from kvquant.eval.config import CorpusSection, check_output_dir
    from kvquant.eval.corpus import load_corpus, make_windows, tokenize
    from kvquant.models import load_model
    from kvquant.tools.calibrate import calibrate_static_scales
    from kvquant.tools.export import (
        PER_HEAD_NOTE,
        check_export,
        format_measurement,
        measure_engine,
        write_export,
    )

    check_export(args.engine, args.strategy, args.out, args.tp)
    check_output_dir("--out", args.out)
    corpus = flagged("--corpus", load_corpus, CorpusSection(name=args.corpus))
    model, tok = flagged("--model", load_model, args.model)
    ids = tokenize(tok, corpus.text)  # [N]
    calib = ids[None, : args.tokens]  # [1, N]
    cfg = KVQuantConfig(key_format="fp8_e4m3", value_format="fp8_e4m3")
    scales = calibrate_static_scales(model, calib, cfg, margin=args.margin)
    written = write_export(
        model, tok, scales, args.engine, args.strategy, args.out, scales_only=args.scales_only, tp=args.tp
    )
    what = "scales" if args.scales_only else "checkpoint"
    print(
        f"wrote {what} {args.out}: {', '.join(written)} ({args.engine}, fp8 e4m3, strategy {args.strategy}, "
        f"{calib.shape[1]} calibration tokens from {args.corpus!r}, margin {args.margin})"
    )
    if args.strategy == "attn_head":
        print(PER_HEAD_NOTE)
    if args.measure_windows:
        need = (args.measure_prefix + args.measure_tokens) * args.measure_windows
        rest = ids[calib.shape[1] :]
        held_out = rest.numel() >= need
        source = rest if held_out else ids
        windows = make_windows(
            source, args.measure_prefix, args.measure_tokens, args.measure_windows, args.corpus
        )
        with torch.no_grad():
            m = measure_engine(model, windows, args.out, args.measure_prefix)
        where = "after the calibration tokens" if held_out else "overlapping the calibration tokens"
        print(
            format_measurement(m, f"what {args.engine} stores (engine-fp8:{args.out})")
            + f"; {args.measure_windows} window(s) of {args.measure_prefix} + {args.measure_tokens} tokens "
            f"{where}"
        )
        print(f"measure it on more text: kvquant eval --caches engine-fp8:{args.out},fp8,int8")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="calibrated static fp8 KV-cache scales as a vLLM / SGLang checkpoint (compressed-tensors)",
        description="Calibrate fp8 e4m3 KV scales (per tensor or per KV head) and write a checkpoint "
        "folder (weights as loaded + config.json with a compressed-tensors kv_cache_scheme + the "
        "k_scale / v_scale tensors) or, with --scales-only, the scales and the config fragment; then "
        "print the KL / ppl change / top-1 of what the engine will store.",
    )
    p.add_argument("engine", choices=["vllm", "sglang"])
    p.add_argument("--out", required=True, help="new or empty output folder")
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--corpus", default="embedded", help="'embedded', 'wikitext2' or a local .txt/.jsonl file")
    p.add_argument("--tokens", type=int_at_least(1), default=4096, help="calibration tokens (default: 4096)")
    p.add_argument(
        "--strategy",
        default="tensor",
        choices=["tensor", "attn_head"],
        help="one scale per layer (tensor, default) or per KV head (attn_head; vLLM only)",
    )
    p.add_argument(
        "--margin", type=float_above(0), default=1.0, help="multiplies the observed maximum (default: 1.0)"
    )
    p.add_argument(
        "--scales-only",
        action="store_true",
        help="write only kv_scales.safetensors + quantization_config.json, to merge into a checkpoint",
    )
    p.add_argument(
        "--tp", type=int_at_least(1), default=1, help="sglang: TP ranks in kv_cache_scales.json (default 1)"
    )
    p.add_argument(
        "--measure-windows",
        type=int_at_least(0),
        default=2,
        help="corpus windows for the printed KL (0: skip; default 2)",
    )
    p.add_argument("--measure-prefix", type=int_at_least(1), default=256, help="prefix tokens per window")
    p.add_argument(
        "--measure-tokens", type=int_at_least(2), default=32, help="teacher-forced tokens per window"
    )
    p.set_defaults(func=_cmd_export)


# ------------------------------------------------------------------------------------------ plan


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from kvquant.tools.plan import PlanError, format_table, load_config, parse_size, plan

    try:
        memory = parse_size(args.memory, "--memory")
        presets = None
        if args.presets is not None:
            presets = [x.strip() for x in args.presets.split(",") if x.strip()]
        config = load_config(args.model)
        rows = plan(
            config,
            memory,
            args.context,
            batch=args.batch,
            weights_dtype=args.weights_dtype,
            kv_dtype=args.kv_dtype,
            reserve=args.reserve,
            presets=presets,
            tp=args.tp,
        )
    except PlanError as exc:
        flag = str(exc).split(":", 1)[0].strip().lstrip("-").replace("_", "-")
        msg = str(exc).split(":", 1)[1].strip() if ":" in str(exc) else str(exc)
        print(f"kvquant plan: error: --{flag}: {' '.join(msg.split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows}, indent=2))
    else:
        print(format_table(rows, args.model))
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planner: KV bytes, max batch and max context per preset, from the model config alone",
    )
    p.add_argument("--model", default="default", help="HF id, local folder, config.json, or default")
    p.add_argument("--memory", required=True, help="accelerator memory, e.g. 80GiB, 80GB, 512MiB, bytes")
    p.add_argument("--context", type=int_at_least(1), required=True, help="tokens per sequence")
    p.add_argument(
        "--batch", type=int_at_least(1), default=1, help="batch for the max-context column (default 1)"
    )
    p.add_argument("--weights-dtype", default="bf16", help="bf16 (default), fp16, fp32, fp8, int8, int4")
    p.add_argument("--kv-dtype", default="bf16", help="model dtype of the full-precision KV (default bf16)")
    p.add_argument(
        "--reserve", default="10%", help="activation reserve: a percentage or a size (default 10%%)"
    )
    p.add_argument("--presets", default=None, help="comma-separated presets (default: all)")
    p.add_argument(
        "--tp",
        type=int_at_least(1),
        default=1,
        help="tensor-parallel devices: --memory is per device, KV heads split (or replicated) as vLLM does",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.set_defaults(func=_cmd_plan)


# ------------------------------------------------------------------------------------------ tune


_TUNE_MENU = "tcq2,tcq3,nuq4,int8"  # kvquant.tools.tune.MENU (a test checks)


def _cmd_tune(args: argparse.Namespace) -> int:
    import torch

    from kvquant.eval.config import CorpusSection
    from kvquant.eval.corpus import load_corpus, make_windows, tokenize
    from kvquant.models import load_model
    from kvquant.tools.tune import (
        Calibration,
        check_base,
        check_formats,
        check_pins,
        load_sensitivity,
        pins_from_config,
        prefill,
        save_sensitivity,
        tune,
    )

    base = args.base
    if base is not None:
        base = check_cache("--base", base)
    if args.key_map is not None:  # the base's keys mapped (kvquant calibrate --key-map) before rotation
        from kvquant.key_map import load_key_map
        from kvquant.tools.tune import DEFAULT_BASE

        base = flagged("--key-map", (base or DEFAULT_BASE).with_key_map, args.key_map)
        flagged("--key-map", load_key_map, args.key_map)  # (the base's other files: checked above)
    flagged("--base", check_base, base)
    check_output_file("--out", args.out)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    flagged("--formats", check_formats, formats)
    pins = None
    if args.pin is not None:
        pins = flagged("--pin", pins_from_config, check_cache("--pin", args.pin))
    corpus = flagged("--corpus", load_corpus, CorpusSection(name=args.corpus))
    model, tok = flagged("--model", load_model, args.model)
    if pins is not None:  # the layer range, before the prefill (tune checks it again)
        flagged("--pin", check_pins, pins, model.config.get_text_config(decoder=True).num_hidden_layers)
    ids = make_windows(tokenize(tok, corpus.text), args.prefix_len, args.score_len, args.windows, args.corpus)
    started = time.perf_counter()
    sens = None
    if args.sensitivity and Path(args.sensitivity).is_file():
        text = model.config.get_text_config(decoder=True)
        units = text.num_hidden_layers
        if args.per_head:
            units *= getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        sens = flagged("--sensitivity", load_sensitivity, args.sensitivity, formats, units)
    if sens is not None and args.no_verify:  # nothing to run: the windows only give the token count
        calib = Calibration(ids, args.prefix_len, None, torch.empty(0))
    else:
        calib = prefill(model, ids, args.prefix_len)
    result = flagged_fields(
        {"formats": "--formats", "base": "--base", "pinned": "--pin", "model": "--model"},
        tune,
        model,
        calib,
        budget_kl=args.budget_kl,
        budget_bits=args.budget_bits,
        base=base,
        formats=formats,
        verify=not args.no_verify,
        sensitivity=sens,
        measure=args.measure,
        pinned=pins,
        progress=not args.no_progress,
        per_head=args.per_head,
    )
    if args.sensitivity and sens is None:
        save_sensitivity(args.sensitivity, result.sensitivity)
    minutes = (time.perf_counter() - started) / 60
    budget = f"--budget-bits {args.budget_bits}" if args.budget_bits else f"--budget-kl {args.budget_kl}"
    header = (
        f"kvquant tune {budget} --corpus {args.corpus} --windows {args.windows} --prefix-len "
        f"{args.prefix_len} --score-len {args.score_len} --formats {','.join(formats)}"
        + (f" --base {args.base}" if args.base else "")
        + (f" --key-map {args.key_map}" if args.key_map else "")
        + (f" --pin {args.pin}" if args.pin else "")
        + (" --per-head" if args.per_head else "")
        + (f" (sensitivities reused from {args.sensitivity})" if sens is not None else "")
        + f"\nmodel: {args.model or 'smollm2 (embedded)'}; per-{'head' if args.per_head else 'layer'} formats "
        "for this model only; "
        f"tuned in {minutes:.1f} min"
    )
    if args.name:
        result.config = dataclasses.replace(result.config, name=args.name)
    result.write_yaml(args.out, header)
    print(result.table())
    print(result.summary())
    print(f"tuning took {minutes:.1f} min; wrote {args.out}; measure it: kvquant eval --caches {args.out}")
    return 0 if result.met else 1


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="per-layer key / value formats meeting a bits or KL budget, measured in decode mode (writes a YAML)",
    )
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument(
        "--corpus", default="embedded", help="calibration text: 'embedded', 'wikitext2' or a local file"
    )
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--budget-kl", type=float_above(0), help="largest predicted mean KL vs full precision (> 0)"
    )
    budget.add_argument(
        "--budget-bits",
        type=float_above(0),
        help="largest bits @16-bit per element, as kvquant eval counts them (scales, sinks, windows)",
    )
    p.add_argument(
        "--base", default=None, help="preset / YAML with the shared settings (default: the *-recent recipe)"
    )
    p.add_argument(
        "--key-map",
        default=None,
        help="a key map for the base (a shipped name, e.g. smollm2, or a file from kvquant calibrate --key-map)",
    )
    p.add_argument(
        "--formats", default=_TUNE_MENU, help=f"comma-separated format menu (default {_TUNE_MENU})"
    )
    p.add_argument("--windows", type=int_at_least(1), default=4, help="calibration windows (default 4)")
    p.add_argument("--prefix-len", type=int_at_least(1), default=1024, help="prefilled tokens per window")
    p.add_argument(
        "--score-len", type=int_at_least(2), default=64, help="teacher-forced, scored tokens per window"
    )
    p.add_argument(
        "--measure",
        choices=("scaled", "all"),
        default="all",
        help="all (default): every (layer, tensor, format) measured in decode mode (SmolLM2, 4 formats: "
        "~20 min on 2 cores); scaled: only the coarsest format measured, the others scaled by their "
        "stored error (menu-size times faster, approximate)",
    )
    p.add_argument(
        "--sensitivity",
        default=None,
        help="JSON of measurements: reused when the file exists, else written (one run, several budgets)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip measuring the result against the best uniform configs",
    )
    p.add_argument(
        "--pin",
        default=None,
        help="a config whose layer_overrides' key / value formats are kept (e.g. from kvquant calibrate "
        "--retrieval); their bits count against the budget",
    )
    p.add_argument(
        "--per-head",
        action="store_true",
        help="allocate over (layer, KV head) pairs, not layers (KV-heads times the probes; the config "
        "then holds head overrides)",
    )
    p.add_argument("--out", required=True, help="output config (.yaml)")
    p.add_argument("--name", default=None, help="the config's name (default: tuned)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_tune)


def build_parser() -> argparse.ArgumentParser:
    from kvquant import __version__

    parser = OneLineParser(prog="kvquant", description="KV-cache quantization for HF transformers")
    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of its one line"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_check(sub)
    _add_eval(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_sweep(sub)
    _add_calibrate(sub)
    _add_export(sub)
    _add_tune(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status. Bad input (:data:`USER_ERRORS`, and argument errors):
    one line on stderr, status 2; Ctrl-C: one line, status 130; ``--debug`` re-raises both with their
    traceback. Anything else is a bug and propagates with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, prog = "--debug" in argv, "kvquant"
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # argparse: an argument error (2), --help or --version (0)
            return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
        debug, prog = args.debug, f"kvquant {args.command}"
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if debug:
            raise
        print(f"{prog}: error: {describe(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
