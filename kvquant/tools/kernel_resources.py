"""``python -m kvquant.tools.kernel_resources``: what the Triton decode kernel costs, from its offline
build, no GPU needed.

For each format it prepares the launch the decode op makes (``decode_launch.split_launch``: the
same constexprs, tile size, warps and pipeline stages), compiles it for an NVIDIA architecture with
the ``ptxas`` Triton ships, and reads the cubin with ``cuobjdump``: registers per thread, stack bytes
(where spilled registers go), shared memory (Triton's dynamic allocation plus the static part), and
in the SASS the global loads, spill stores, integer-to-float conversions (``I2F``) and instructions.
The build specializes its arguments as Triton's JIT does at launch (strides of 1 as constants,
multiples of 16 marked so), or its loads would not vectorize as the launched kernel's do. These are static counts of one build,
not timings: they show a change's effect on register pressure and loads when no GPU is at hand;
time it with ``make gpu-check`` when one is.

Example::

    python -m kvquant.tools.kernel_resources --formats int4 nuq4 tcq3 --head-dim 128
    python -m kvquant.tools.kernel_resources --json runs/resources.json    # every format the kernel reads
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_PTR = {
    "uint8": "*u8",
    "float8_e4m3fn": "*u8",
    "float8_e5m2": "*u8",
    "int8": "*i8",
    "float16": "*fp16",
    "bfloat16": "*bf16",
    "float32": "*fp32",
    "int64": "*i64",
}


def _tool(name: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"this Triton build ships no {name} ({path})")
    return path


def _launch(fmt: str, d: int, gq: int, num_warps: int, block_t: int | None = None, group: int | None = None):
    """The decode op's launch (constexprs and arguments) for ``fmt`` keys and values, head_dim ``d``,
    one scale per token and ``group`` channels (None: per head)."""
    import torch

    from kvquant.kernels.triton.decode_launch import split_launch
    from kvquant.tools.kernel_stores import tiled_store

    t = 4096  # a realistic store: strides specialize as a long one's do (multiples of 16); `end` does not
    x = torch.randn(1, 2, t, d, generator=torch.Generator().manual_seed(0)).half()  # [B, Hkv, T, D]
    group = group or d
    codes, scale, zero = tiled_store(x, fmt, group, "token")
    q = torch.randn(1, 2 * gq, d).half()  # [B, Hq, D]
    start = torch.zeros(1, dtype=torch.long)
    launch = split_launch(q, (codes, scale, zero, codes, scale, zero), k_fmt=fmt, v_fmt=fmt, k_group=group, v_group=group,
                          k_axis="token", start=start, end=t - 5, num_warps=num_warps, block_t=block_t)  # fmt: skip
    o_part = torch.empty(1, 2 * gq, 1, d)  # [B, Hq, splits, D]
    l_part = torch.empty(1, 2 * gq, 1)
    values = launch.runtime_args(q, o_part, l_part, 1.0, None)
    return launch.consts, values


def build(
    fmt: str,
    d: int = 128,
    gq: int = 4,
    num_warps: int = 8,
    arch: int = 90,
    block_t: int | None = None,
    group: int | None = None,
):
    """The compiled split-decode kernel (a Triton ``CompiledKernel``) for ``fmt`` on ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvquant.kernels.triton.decode_kernels import decode_attention_split_kernel as fn

    consts, values = _launch(fmt, d, gq, num_warps, block_t, group)
    options = {"num_warps": consts.pop("num_warps")}
    if "num_stages" in consts:
        options["num_stages"] = consts.pop("num_stages")
    consts["SOFTCAP"] = False
    runtime = [n for n in fn.arg_names if n not in consts]
    if len(runtime) != len(values):
        raise RuntimeError(f"decode kernel: {len(runtime)} runtime arguments, the launch gives {len(values)}")
    sig, constexprs, attrs = _specialize(fn, dict(zip(runtime, values, strict=True)))
    sig.update({n: "constexpr" for n in consts})
    constexprs.update({(fn.arg_names.index(k),): v for k, v in consts.items()})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options), consts


def _specialize(fn, runtime: dict[str, Any]) -> tuple[dict[str, str], dict, dict]:
    """Signature, constexprs and attributes of ``fn``'s runtime arguments as Triton's JIT makes them at
    launch: integers of value 1 become constexprs, integers below 2**31 are i32, and integers and
    pointers that are multiples of 16 carry ``tt.divisibility`` (which lets loads vectorize); floats are
    fp32. A build without this (every stride i64, none known to be 1) differs from the launched one."""
    import torch
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    sig: dict[str, str] = {}
    constexprs: dict = {}
    attrs: dict = {}
    for name, v in runtime.items():
        i = fn.arg_names.index(name)
        param = fn.params[i] if hasattr(fn, "params") else None  # none under TRITON_INTERPRET
        if isinstance(v, float):
            sig[name] = "fp32"
            continue
        specialize = param is None or not param.do_not_specialize
        align = param is None or not param.do_not_specialize_on_alignment
        kind, spec = native_specialize_impl(CUDABackend, v, False, specialize, align)
        if kind == "constexpr":
            sig[name], constexprs[(i,)] = "constexpr", v
            continue
        sig[name] = _PTR[str(v.dtype).removeprefix("torch.")] if isinstance(v, torch.Tensor) else kind
        if spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    return sig, constexprs, attrs


def resources(fmt: str, d: int = 128, **options: Any) -> dict[str, Any]:
    """One row: the build's registers, stack / shared bytes and SASS counts for ``fmt`` at head_dim
    ``d``; ``options``: :func:`build`'s (``block_t``: tokens per tile, None: the launcher's choice;
    ``group``: channels per scale, None: the head)."""
    kernel, consts = build(fmt, d, **options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout

    def field(key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", usage)
        return int(m.group(1)) if m else 0

    def count(op: str) -> int:  # an opcode with or without modifiers (``STL``, ``STL.64``), once each
        return len(re.findall(rf"\b{op}\b", sass))

    loop = main_loop(sass)
    warps = kernel.metadata.num_warps  # (the build's own, default included)
    return {
        "format": fmt,
        "head_dim": d,
        "group": options.get("group") or d,
        "mode": consts["K_MODE"],
        "block_t": consts["BT"],
        "registers": field("REG"),
        "stack_bytes": field("STACK") + field("LOCAL"),  # spilled registers live here
        "shared_bytes": int(kernel.metadata.shared) + field("SHARED"),  # dynamic (Triton's) + static
        "global_loads": count("LDG"),
        "spill_stores": count("STL"),
        "int_to_float": count("I2F"),  # quarter-rate conversions (the prologue's integer division has one)
        "instructions": len(re.findall(r"(?m)^\s+/\*[0-9a-f]{4,}\*/", sass)),
        "num_warps": warps,
        "loop_instructions": loop,  # one tile's pass of the token loop, per thread
        # what the SMs issue per token of the store: every warp runs the loop once per tile
        "warp_instructions_per_token": round(loop * warps / consts["BT"], 1),
    }


def main_loop(sass: str) -> int:
    """Instructions of the longest loop in a SASS listing (the span from a backward branch's target
    to the branch): the decode kernel's token loop, one tile per pass. 0 when there is no loop."""
    addrs, targets = [], []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if not m:
            continue
        addrs.append(int(m.group(1), 16))
        b = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", m.group(2))
        targets.append(int(b.group(1), 16) if b else None)
    index = {a: i for i, a in enumerate(addrs)}
    spans = [i - index[t] + 1 for i, t in enumerate(targets) if t is not None and t < addrs[i] and t in index]
    return max(spans, default=0)


def markdown(rows: list[dict[str, Any]]) -> str:
    from kvquant.eval.report import table

    head = [
        "format",
        "head_dim",
        "group",
        "mode",
        "tile",
        "registers",
        "stack bytes",
        "shared bytes",
        "LDG",
        "STL (spills)",
        "I2F",
        "SASS",
        "warps",
        "loop",
        "warp instr / token",
    ]
    keys = ["format", "head_dim", "group", "mode", "block_t", "registers", "stack_bytes", "shared_bytes", "global_loads",
            "spill_stores", "int_to_float", "instructions", "num_warps", "loop_instructions",
            "warp_instructions_per_token"]  # fmt: skip
    return table(head, [[str(r[k]) for k in keys] for r in rows], left=1)


def quantized_formats() -> list[str]:
    """Every format with scales that the Triton decode kernel reads."""
    from kvquant.formats import FORMAT_NAMES, format_spec

    return [f for f in FORMAT_NAMES if format_spec(f).has_scale and format_spec(f).triton_read() is not None]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    allowed = quantized_formats()
    p = argparse.ArgumentParser(
        prog="python -m kvquant.tools.kernel_resources", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=allowed,
        help="formats read as keys and values, by spaces or commas (default: all)",
    )
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--gq", type=int, default=4, help="query heads per KV head")
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--block-t", type=int, help="tokens per tile (default: the launcher's choice)")
    p.add_argument("--group", type=int, help="channels per scale (default: the head, one scale per token)")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper), 80 (Ampere)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    args.formats = [f for item in args.formats for f in item.split(",") if f]
    bad = [f for f in args.formats if f not in allowed]
    if bad:
        p.error(f"--formats: not read by the Triton kernel: {', '.join(bad)}; allowed: {', '.join(allowed)}")
    if args.head_dim < 16 or args.head_dim & (args.head_dim - 1):
        p.error(f"--head-dim: a power of two >= 16 (the Triton kernel's), got {args.head_dim}")
    if args.group is not None and (args.group < 1 or args.head_dim % args.group):
        p.error(f"--group: a divisor of --head-dim ({args.head_dim}), got {args.group}")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the kernels must be decorated for a real build
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run(
            [sys.executable, "-m", "kvquant.tools.kernel_resources", *argv], env=env
        ).returncode
    try:
        _tool("cuobjdump")
    except FileNotFoundError as e:
        print(f"kvquant.tools.kernel_resources: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.block_t is not None and (args.block_t < 16 or args.block_t & (args.block_t - 1)):
        p.error(f"--block-t: a power of two >= 16, got {args.block_t}")
    rows = [
        resources(
            f,
            args.head_dim,
            gq=args.gq,
            num_warps=args.num_warps,
            arch=args.arch,
            block_t=args.block_t,
            group=args.group,
        )
        for f in args.formats
    ]
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
