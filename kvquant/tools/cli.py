"""The ``kvquant`` command.

Example::

    kvquant demo                      # embedded SmolLM2: generate with a KV cache, print the text
    kvquant demo --prompt "Hi" -n 16
    kvquant eval --cache int4 --corpus wikitext2   # quality/memory/speed

Each subcommand is one module of :mod:`kvquant.tools.commands` (its ``register`` adds the parser);
this module builds the parser and turns bad input into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvquant.tools.arguments import USER_ERRORS, OneLineParser, describe
from kvquant.tools.commands import MODULES


def build_parser() -> argparse.ArgumentParser:
    from kvquant import __version__

    parser = OneLineParser(prog="kvquant", description="KV-cache quantization for HF transformers")
    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of its one line"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in MODULES:
        module.register(sub)
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
