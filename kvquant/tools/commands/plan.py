"""``kvquant plan``: the cache config, batch and context that fit a memory budget."""

from __future__ import annotations

import argparse
import sys

from kvquant.tools.arguments import (
    int_at_least,
)


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from kvquant.tools.plan import (
        PlanError,
        dtype_bytes,
        format_table,
        load_config,
        parse_reserve,
        parse_size,
        plan,
    )

    try:
        memory = parse_size(args.memory, "--memory")
        # the flags first, then the model (whose first use may convert the embedded GGUF)
        parse_reserve(args.reserve, memory, "--reserve")
        dtype_bytes(args.weights_dtype, "--weights-dtype")
        dtype_bytes(args.kv_dtype, "--kv-dtype")
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


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant plan`` to the command's subparsers."""
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
