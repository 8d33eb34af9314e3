"""Passkey accuracy of several caches at long contexts, one haystack prefill per prompt.

``kvquant eval --tasks retrieval`` prefills every prompt once per cache; at 4k-8k tokens on a CPU that
prefill is nearly all the time. Each line and the table carry the first-token margin as well (see
:mod:`kvquant.eval.retrieval`). This runs :func:`~kvquant.eval.retrieval.passkey_accuracy_shared`
(the same prompts, the same answers, one prefill per prompt) on a model loaded by name, appending one
JSON line per answer to ``--out`` (with its prompt seed) and printing the table at the end::

    OMP_NUM_THREADS=1 python -m kvquant.eval.passkey_long --lengths 4096,max --trials 3 \\
        --caches dynamic,tcq3v2-recent,tcq2-recent,k3v2,k3v2-recent,nuq2,nuq2-recent,nuq3 \\
        --out runs/passkey-long.jsonl

``--seed 0,2,3`` pools several prompt sets (seed 0: the evaluation's prompts). A handful of prompts
per length is a coarse signal: where ``dynamic`` is among the caches, the table also counts the
prompts each cache lost against it (``dynamic`` answered, the cache did not) and gained, so
"equals full precision" is read off prompt by prompt rather than from two rounded rates.
"""

from __future__ import annotations

import argparse
import json
import time

from kvquant.eval.caches import resolve_spec
from kvquant.eval.config import EvalConfig, RetrievalSection
from kvquant.eval.report import table
from kvquant.eval.retrieval import lost_and_gained, passkey_accuracy_shared
from kvquant.eval.runner import load_eval_model, model_max_context, resolve_lengths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvquant.eval.passkey_long")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--caches", required=True, help="comma-separated cache specs (dynamic, presets, YAML)")
    p.add_argument("--lengths", default="4096,max", help="comma-separated; max: the model's limit")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--digits", type=int, default=5)
    p.add_argument(
        "--seed",
        default="0",
        help="prompt seed(s), comma-separated and pooled (default: 0, the evaluation's prompts)",
    )
    p.add_argument("--out", required=True, help="JSON-lines file, one answer per line (appended)")
    args = p.parse_args(argv)
    lengths = [x if x == "max" else int(x) for x in args.lengths.split(",")]
    try:
        seeds = [int(x) for x in args.seed.split(",")]
    except ValueError:
        p.error(f"--seed: comma-separated integers, got {args.seed!r}")
    cfg = EvalConfig(retrieval=RetrievalSection(lengths=lengths, trials=args.trials, digits=args.digits))
    cfg.model.name = args.model
    cfg.validate()
    specs = [resolve_spec(c) for c in args.caches.split(",")]
    names = [s.name for s in specs]
    # answers are keyed by name: a second cache of one name would replace the first
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(
            f"--caches: more than one cache is named {', '.join(map(repr, twice))}; give each YAML file its own 'name' field"
        )
    model, tok = load_eval_model(cfg)
    lengths = resolve_lengths(cfg, model_max_context(model))
    start = time.perf_counter()

    builds = {s.name: (lambda s=s: s.build(model)) for s in specs}
    answers: dict[str, list[dict]] = {name: [] for name in builds}
    for seed in seeds:

        def log(name: str, answer: dict, seed: int = seed) -> None:
            row = {"cache": name, "seed": seed, **answer, "seconds": round(time.perf_counter() - start, 1)}
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)

        res = passkey_accuracy_shared(
            model,
            tok,
            builds,
            lengths=lengths,
            trials=args.trials,
            digits=args.digits,
            seed=seed,
            on_answer=log,
        )
        for name, r in res.items():
            answers[name] += [{**a, "seed": seed} for a in r["answers"]]
    print(table(*summary_table(answers, lengths), left=1))
    return 0


def summary_table(answers: dict[str, list[dict]], lengths: list[int]) -> tuple[list[str], list[list[str]]]:
    """``(head, rows)``: per cache and length the prompts answered (``k/n``), the mean first-token
    margin, and, where a cache is named ``dynamic``, the prompts lost / gained against it
    (:func:`~kvquant.eval.retrieval.lost_and_gained`)."""
    ref = answers.get("dynamic")
    head = ["cache", *[f"passkey @{n}" for n in lengths], *[f"margin @{n}" for n in lengths]]
    if ref:
        head += [f"vs dynamic @{n} (lost / gained)" for n in lengths]
    rows = []
    for name, got in answers.items():
        at = {n: [a for a in got if a["length"] == n] for n in lengths}
        row = [name, *[f"{sum(a['correct'] for a in at[n])}/{len(at[n])}" for n in lengths]]
        row += [f"{sum(a['margin'] for a in at[n]) / max(len(at[n]), 1):+.2f}" for n in lengths]
        if ref:
            row += ["-{} / +{}".format(*lost_and_gained(at[n], ref)) for n in lengths]
        rows.append(row)
    return head, rows


if __name__ == "__main__":
    raise SystemExit(main())
