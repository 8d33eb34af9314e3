"""``kvquant calibrate``: static scales, key maps and retrieval layers / counts measured on a corpus."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from kvquant.tools.arguments import (
    check_cache,
    check_output_file,
    flagged,
    float_above,
    float_in,
    int_at_least,
)


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


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``kvquant calibrate`` to the command's subparsers."""
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
