"""What a sweep writes at the end: points table (CSV + markdown), capacity, Pareto front, recommendation.

A *point* is one (model, cache, context, batch) of the grid: its ``memory`` and ``speed`` pieces plus
the cache's ``quality`` (one per cache and model). A cache's *cost* is the effective bits per element
it holds at the grid's largest context and smallest batch (bytes per token breaks ties): the number
the quality plot and the recommendation (:mod:`kvquant.eval.recommend`) use.

Example:
    >>> report = build_report(cfg, specs, ["llama"], store.records, {"llama": model.config}, info, out)
    >>> print(report["table"])          # also in out / "results.md", the rows in out / "results.csv"
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from kvquant.eval.caches import CacheSpec
from kvquant.eval.plots import NOTES, write_plots
from kvquant.eval.preflight import risk_warning
from kvquant.eval.recommend import recommend
from kvquant.eval.report import cell, scaled, table
from kvquant.eval.sweep_config import SweepError

CSV_FIELDS = tuple(
    """model cache cache_kind key context batch tokens_held bytes_held bytes_per_token effective_bits
    effective_bits_16bit theoretical_bits peak_bytes peak_mib peak_rss_bytes prefill_ms decode_ms_per_step
    decode_tok_s decode_x prefill_x reference_decode_tok_s max_sequences kl_mean kl_p90 kl_p99
    top1_agreement ppl ppl_base delta_ppl delta_ppl_pct error""".split()
)
# the fields each piece of a point gives the CSV, under their own names but for two
FROM_PIECE = {
    "memory": "tokens bytes bytes_per_token effective_bits effective_bits_16bit theoretical_bits peak_bytes "
    "peak_rss_bytes",
    "speed": "prefill_ms decode_ms_per_step decode_tok_s decode_x prefill_x reference_decode_tok_s",
    "quality": "kl_mean kl_p90 kl_p99 top1_agreement ppl ppl_base delta_ppl",
}
RENAMED = {"tokens": "tokens_held", "bytes": "bytes_held"}


def record_id(model: str, spec_key: str, kind: str, context: int, batch: int) -> str:
    """The id of one piece of a sweep in its record store."""
    return f"{model}|{spec_key}|{kind}|{context}|{batch}"


# ------------------------------------------------------------------------------------------ rows


def points(cfg, specs, labels, done, capacity) -> list[dict[str, Any]]:
    """One row per (model, cache, context, batch), every CSV field present (``None`` when unknown)."""

    def piece(label: str, spec: CacheSpec, kind: str, context: int, batch: int) -> dict:
        rec = done.get(record_id(label, spec.key, kind, context, batch))
        return {} if rec is None else rec[kind]

    rows = []
    for label in labels:
        for spec in specs:
            cap = (capacity.get(label) or {}).get("max_sequences", {}).get(spec.name, {})
            for context in sorted(cfg.grid.contexts):
                for batch in sorted(cfg.grid.batches):
                    pieces = {
                        "memory": piece(label, spec, "memory", context, batch),
                        "speed": piece(label, spec, "speed", context, batch),
                        "quality": piece(label, spec, "quality", cfg.quality.prefix_len, 1),
                    }
                    row: dict[str, Any] = dict.fromkeys(CSV_FIELDS)
                    row.update(model=label, cache=spec.name, cache_kind=spec.kind, key=spec.key)
                    row.update(context=context, batch=batch, max_sequences=cap.get(str(context)))
                    for kind, names in FROM_PIECE.items():
                        row.update({RENAMED.get(f, f): pieces[kind].get(f) for f in names.split()})
                    row["peak_mib"] = scaled(row["peak_bytes"], 2**-20)
                    row["delta_ppl_pct"] = scaled(pieces["quality"].get("delta_ppl_rel"), 100.0)
                    errors = [p["error"] for p in (pieces["memory"], pieces["speed"]) if "error" in p]
                    row["error"] = "; ".join(errors) or None
                    rows.append(row)
    return rows


def config_summaries(rows: list[dict[str, Any]], cost_context: int, cost_batch: int) -> list[dict[str, Any]]:
    """One row per (model, cache): its quality and its cost (effective bits, bytes per token and
    max sequences at ``cost_context`` / ``cost_batch``)."""
    keep = ("model", "cache", "cache_kind", "effective_bits", "bytes_per_token", "max_sequences")
    keep += ("kl_mean", "delta_ppl_pct", "top1_agreement")
    return [
        {**{k: r[k] for k in keep}, "context": cost_context, "batch": cost_batch}
        for r in rows
        if r["context"] == cost_context and r["batch"] == cost_batch
    ]


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as CSV (floats written in full, ``None`` as an empty cell)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in CSV_FIELDS})


# ------------------------------------------------------------------------------------------ capacity


def risk_warnings(cfg, specs, labels, done) -> list[str]:
    """:func:`kvquant.eval.preflight.risk_warning` of every (model, cache) whose quality numbers make it
    risky, from the quality pieces the sweep measured (the line ``kvquant check`` prints)."""
    out = []
    for label in labels:
        for spec in specs:
            rec = done.get(record_id(label, spec.key, "quality", cfg.quality.prefix_len, 1))
            warning = None if rec is None else risk_warning(rec["quality"], spec.name, label)
            if warning:
                out.append(warning)
    return out


def capacity(cfg, specs: list[CacheSpec], model_config: Any) -> dict[str, Any]:
    """Max concurrent sequences at ``cfg.capacity.budget`` per cache and context (kvquant plan);
    transformers' caches other than DynamicCache are not modelled by the planner."""
    from kvquant.planning import PlanError, plan

    cap = cfg.capacity
    contexts = sorted(set(cfg.grid.contexts) | set(cap.contexts or []))
    quant = [s for s in specs if s.kind == "kvquant"]
    by_cache: dict[str, dict[str, int]] = {s.name: {} for s in specs if s.kind in ("dynamic", "kvquant")}
    info: dict[str, Any] = {}
    for context in contexts:
        try:
            rows = plan(
                model_config,
                cap.budget,
                context,
                batch=1,
                weights_dtype=cap.weights_dtype,
                kv_dtype=cap.kv_dtype,
                reserve=cap.reserve,
                presets=[s.quant for s in quant],
            )
        except PlanError as exc:
            msg = str(exc).split(":", 1)[-1].strip()
            raise SweepError(f"capacity.budget: {msg}") from None
        by_name = {r["config"]: r for r in rows}
        for s in specs:
            row = by_name.get("reference" if s.kind == "dynamic" else s.name if s.kind == "kvquant" else "")
            if row is not None:
                by_cache[s.name][str(context)] = row["max_batch"]
        r0 = rows[0]
        info = {
            k: r0[k]
            for k in ("memory_bytes", "parameters", "weights_bytes", "reserve_bytes", "available_bytes")
        }
    unmodelled = [s.name for s in specs if s.kind not in ("dynamic", "kvquant")]
    return {
        "budget": cap.budget,
        "weights_dtype": cap.weights_dtype,
        "kv_dtype": cap.kv_dtype,
        "reserve": cap.reserve,
        "contexts": contexts,
        "max_sequences": by_cache,
        "not_modelled": unmodelled,
        **info,
    }


# ------------------------------------------------------------------------------------------ markdown


def points_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the points, one row each."""
    head = ["model", "cache", "context", "batch", "bits/elem", "bits @16-bit", "B/token", "peak MiB"]
    head += ["prefill ms", "decode tok/s", "decode × dyn", "KL mean", "Δppl %", "top-1"]
    columns = (
        ("effective_bits", ".2f"),
        ("effective_bits_16bit", ".2f"),
        ("bytes_per_token", ",.0f"),
        ("peak_mib", ".1f"),
        ("prefill_ms", ".0f"),
        ("decode_tok_s", ".2f"),
        ("decode_x", ".2f"),
        ("kl_mean", ".5f"),
        ("delta_ppl_pct", "+.2f"),
        ("top1_agreement", ".3f"),
    )
    lines = []
    for r in rows:
        cells = [r["model"], r["cache"], str(r["context"]), str(r["batch"])]
        cells += [cell(r[k], fmt) if k != "decode_tok_s" or not r["error"] else "OOM" for k, fmt in columns]
        lines.append(cells)
    return table(head, lines, left=4)


def capacity_table(label: str, cap: dict[str, Any]) -> str:
    ctxs = cap["contexts"]
    rows = [
        [label, name, *(cell(by_ctx.get(str(c)), ",d") for c in ctxs)]
        for name, by_ctx in cap["max_sequences"].items()
    ]
    return table(["model", "cache", *(f"{c:,} tokens" for c in ctxs)], rows, left=2)


def build_report(cfg, specs, labels, done, model_configs, corpus_info, out: Path) -> dict[str, Any]:
    """Write ``results.csv``, ``results.md``, ``summary.json`` and ``plots/``; return what they hold."""
    grid_contexts, grid_batches = sorted(cfg.grid.contexts), sorted(cfg.grid.batches)
    cost_context, cost_batch = grid_contexts[-1], grid_batches[0]
    caps = {label: capacity(cfg, specs, model_configs[label]) for label in labels}
    rows = points(cfg, specs, labels, done, caps)
    write_csv(rows, out / "results.csv")
    table = points_table(rows)
    summaries = config_summaries(rows, cost_context, cost_batch)
    r = cfg.recommend
    recs = []
    for label in labels:
        own = [c for c in summaries if c["model"] == label]
        rec = recommend(own, r.max_kl, r.max_dppl_pct, budget_label=cfg.capacity.budget)
        recs.append({"model": label, **rec})
    budget = {"max_kl": r.max_kl, "max_dppl_pct": r.max_dppl_pct}
    plots = write_plots(rows, summaries, caps, out / "plots", multi_model=len(labels) > 1, budget=budget)

    q, s, m = cfg.quality, cfg.speed, cfg.model
    ids = {s_.key for s_ in specs}
    records = [
        rec
        for rec in done.values()
        if rec["model"] in labels
        and rec["key"] in ids
        and (
            (rec["kind"] == "quality" and rec["context"] == q.prefix_len)
            or (rec["context"] in grid_contexts and rec["batch"] in grid_batches)
        )
    ]
    from kvquant.models import weights_label

    md = [
        f"# kvquant sweep: {cfg.name or out.name}",
        "",
        f"Models: {', '.join(weights_label(label) for label in labels)} ({m.dtype}, attention {m.attn_implementation}). "
        f"Corpus: {corpus_info['source']}. Quality: {q.mode} mode, {q.windows} window(s) of "
        f"{q.prefix_len} prefix + {q.score_len} scored tokens, against DynamicCache. "
        f"Each point: a fresh cache prefills [batch, context] tokens and decodes {s.decode_tokens} greedily; "
        f"bytes held after that run (bits/elem = bytes held x 8 / K+V elements; bits @16-bit: the same "
        f"with tensors kept in float32 counted at 2 bytes, as a 16-bit model would hold them); peak memory during it "
        f"(CPU: live tensor bytes; CUDA: max_memory_allocated); decode tok/s is the median of {s.repeats} "
        f"run(s) interleaved with one DynamicCache per point (decode × dyn: ratio to it).",
        "",
        "## Points",
        "",
        table,
        "",
        f"## Capacity: max concurrent sequences in {cfg.capacity.budget}",
        "",
    ]
    for label in labels:
        cap = caps[label]
        md += [
            f"{label}: weights {cap['weights_dtype']} ({cap['weights_bytes'] / 1e9:.2f} GB, "
            f"{cap['parameters']:,} parameters estimated from the config), {cap['reserve']} reserve, "
            f"KV in {cap['kv_dtype']}; from `kvquant plan` (peak KV bytes up to the context). "
            + (
                f"Not modelled by the planner: {', '.join(cap['not_modelled'])}."
                if cap["not_modelled"]
                else ""
            ),
            "",
            capacity_table(label, cap),
            "",
        ]
    md += [
        "## Recommendation",
        "",
        f"Cost = effective bits per element held at {cost_context:,} tokens, batch {cost_batch}.",
        "",
    ]
    for rec in recs:
        md += [(f"{rec['model']}: " if len(labels) > 1 else "") + rec["text"], ""]
    warnings = risk_warnings(cfg, specs, labels, done)
    if warnings:
        md += ["## Risky configs", "", *[f"- {w}" for w in warnings], ""]
    md += ["## Plots", ""]
    for p in plots:
        stem = p.stem.split("-")[0] if len(labels) > 1 else p.stem
        md.append(f"- `plots/{p.name}`: {NOTES.get(stem, '')} (data: `plots/{p.stem}.json`)")
    markdown = "\n".join(md) + "\n"
    (out / "results.md").write_text(markdown)
    summary = {
        "name": cfg.name,
        "corpus": corpus_info,
        "configs": summaries,
        "capacity": caps,
        "recommendations": recs,
        "plots": [p.name for p in plots],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return {
        "records": records,
        "points": rows,
        "table": table,
        "markdown": markdown,
        "recommendations": recs,
        "plots": plots,
        "warnings": warnings,
    }
