"""``kvquant tune``: spread a bit budget over layers, keys / values and heads, from measured
sensitivities.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from kvquant.tools.arguments import (
    check_cache,
    check_output_file,
    flagged,
    flagged_fields,
    float_above,
    int_at_least,
)

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


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant tune`` to the command's subparsers."""
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
