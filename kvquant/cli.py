"""The ``kvquant`` command.

Example::

    kvquant demo                      # embedded SmolLM2: generate with a KV cache, print the text
    kvquant demo --prompt "Hi" -n 16

Subcommands are added with one ``_add_<name>`` function each, registered in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

DEMO_PROMPT = "The capital of France is"


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import DynamicCache

    from kvquant.models import load_model

    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    print(f"loaded {args.model or 'embedded SmolLM2-135M-Instruct'} in {time.perf_counter() - start:.1f} s")

    inputs = tokenizer(args.prompt, return_tensors="pt").to(model.device)  # input_ids: [1, T]
    cache = DynamicCache(config=model.config)
    # TODO(lead): int4 cache + memory/quality report — run the same prompt with
    #   KVQuantCache(model.config, "int4") beside this DynamicCache and print bytes/token of each cache,
    #   teacher-forced KL / top-1 agreement against the full-precision run, and both generated texts.
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    print(f"[DynamicCache] {new_tokens} tokens in {elapsed:.2f} s ({new_tokens / elapsed:.1f} tok/s)")
    print(text)
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate with the embedded model and a KV cache, print the text")
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2)")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("-n", "--max-new-tokens", type=int, default=32)
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    from kvquant import __version__

    parser = argparse.ArgumentParser(prog="kvquant", description="KV-cache quantization for HF transformers")
    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
