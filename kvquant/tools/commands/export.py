"""``kvquant export``: hand a cache config to vLLM / SGLang (scales file, engine flags, a measured check)."""

from __future__ import annotations

import argparse

from kvquant.tools.arguments import (
    flagged,
    float_above,
    int_at_least,
)


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


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant export`` to the command's subparsers."""
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
