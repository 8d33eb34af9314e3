"""``kvquant bench cpu | kernels | gpu-check``: speed against DynamicCache, the GPU kernel benchmark,
the one-command GPU check.
"""

from __future__ import annotations

import argparse

from kvquant.tools.arguments import (
    flagged,
    int_at_least,
    ints_at_least,
)


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


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant bench`` to the command's subparsers."""
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
