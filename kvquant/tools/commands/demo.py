"""``kvquant demo``: generate with the embedded model (or any) and a KV cache, print the text."""

from __future__ import annotations

import argparse

from kvquant.tools.arguments import (
    check_cache,
    int_at_least,
)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvquant.tools.demo import run

    check_cache("--cache", args.cache)
    return run(args.model, args.prompt, args.max_new_tokens, args.cache, check=args.check)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant demo`` to the command's subparsers."""
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
