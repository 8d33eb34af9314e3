"""What a sweep writes at the end: points table (CSV + markdown), capacity, Pareto front, recommendation.

A *point* is one (model, cache, context, batch) of the grid: its ``memory`` and ``speed`` pieces plus
the cache's ``quality`` (one per cache and model). A cache's *cost* is the effective bits per element
it holds at the grid's largest context and smallest batch (bytes per token breaks ties): the number
the quality plot and the recommendation use.

Example:
    >>> pareto_front([(4.5, 0.02), (8.5, 0.0002), (5.0, 0.03), (3.0, 0.3)])
    [True, True, False, True]
    >>> rec = recommend(
    ...     [{"cache": "dynamic", "cache_kind": "dynamic", "effective_bits": 16, "kl_mean": 0.0, "delta_ppl_pct": 0.0},
    ...      {"cache": "int8", "effective_bits": 8.5, "kl_mean": 0.0002, "delta_ppl_pct": 0.1},
    ...      {"cache": "int4", "effective_bits": 4.6, "kl_mean": 0.024, "delta_ppl_pct": 3.4}],
    ...     max_kl=0.01)
    >>> rec["pick"]
    'int8'
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from kvquant.eval.caches import CacheSpec
from kvquant.eval.report import cell, table

CSV_FIELDS = (
    "model",
    "cache",
    "cache_kind",
    "key",
    "context",
    "batch",
    "tokens_held",
    "bytes_held",
    "bytes_per_token",
    "effective_bits",
    "effective_bits_16bit",
    "theoretical_bits",
    "peak_bytes",
    "peak_mib",
    "peak_rss_bytes",
    "prefill_ms",
    "decode_ms_per_step",
    "decode_tok_s",
    "decode_x",
    "prefill_x",
    "reference_decode_tok_s",
    "max_sequences",
    "kl_mean",
    "kl_p90",
    "kl_p99",
    "top1_agreement",
    "ppl",
    "ppl_base",
    "delta_ppl",
    "delta_ppl_pct",
    "error",
)


# ------------------------------------------------------------------------------------------ rows


def _piece(done: dict, label: str, spec: CacheSpec, kind: str, context: int, batch: int) -> dict | None:
    from kvquant.eval.sweep import record_id

    rec = done.get(record_id(label, spec.key, kind, context, batch))
    return None if rec is None else rec[kind]


def points(cfg, specs, labels, done, capacity) -> list[dict[str, Any]]:
    """One row per (model, cache, context, batch), every CSV field present (``None`` when unknown)."""
    rows = []
    for label in labels:
        for spec in specs:
            q = _piece(done, label, spec, "quality", cfg.quality.prefix_len, 1) or {}
            for context in sorted(cfg.grid.contexts):
                for batch in sorted(cfg.grid.batches):
                    m = _piece(done, label, spec, "memory", context, batch) or {}
                    s = _piece(done, label, spec, "speed", context, batch) or {}
                    errors = [x["error"] for x in (m, s) if "error" in x]
                    cap = (capacity.get(label) or {}).get("max_sequences", {}).get(spec.name, {})
                    dppl = q.get("delta_ppl_rel")
                    row = {
                        "model": label,
                        "cache": spec.name,
                        "cache_kind": spec.kind,
                        "key": spec.key,
                        "context": context,
                        "batch": batch,
                        "tokens_held": m.get("tokens"),
                        "bytes_held": m.get("bytes"),
                        "bytes_per_token": m.get("bytes_per_token"),
                        "effective_bits": m.get("effective_bits"),
                        "effective_bits_16bit": m.get("effective_bits_16bit"),
                        "theoretical_bits": m.get("theoretical_bits"),
                        "peak_bytes": m.get("peak_bytes"),
                        "peak_mib": None if m.get("peak_bytes") is None else m["peak_bytes"] / 2**20,
                        "peak_rss_bytes": m.get("peak_rss_bytes"),
                        "prefill_ms": s.get("prefill_ms"),
                        "decode_ms_per_step": s.get("decode_ms_per_step"),
                        "decode_tok_s": s.get("decode_tok_s"),
                        "decode_x": s.get("decode_x"),
                        "prefill_x": s.get("prefill_x"),
                        "reference_decode_tok_s": s.get("reference_decode_tok_s"),
                        "max_sequences": cap.get(str(context)),
                        "kl_mean": q.get("kl_mean"),
                        "kl_p90": q.get("kl_p90"),
                        "kl_p99": q.get("kl_p99"),
                        "top1_agreement": q.get("top1_agreement"),
                        "ppl": q.get("ppl"),
                        "ppl_base": q.get("ppl_base"),
                        "delta_ppl": q.get("delta_ppl"),
                        "delta_ppl_pct": None if dppl is None else 100.0 * dppl,
                        "error": "; ".join(errors) or None,
                    }
                    rows.append(row)
    return rows


def config_summaries(rows: list[dict[str, Any]], cost_context: int, cost_batch: int) -> list[dict[str, Any]]:
    """One row per (model, cache): its quality and its cost (effective bits, bytes per token and
    max sequences at ``cost_context`` / ``cost_batch``)."""
    out = []
    for r in rows:
        if r["context"] == cost_context and r["batch"] == cost_batch:
            keep = ("model", "cache", "cache_kind", "effective_bits", "bytes_per_token", "max_sequences")
            keep += ("kl_mean", "delta_ppl_pct", "top1_agreement")
            out.append({**{k: r[k] for k in keep}, "context": cost_context, "batch": cost_batch})
    return out


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as CSV (floats written in full, ``None`` as an empty cell)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in CSV_FIELDS})


# ------------------------------------------------------------------------------------------ Pareto


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """For points ``(cost, loss)`` (both lower is better): True where no other point is at least as
    good in both and strictly better in one. Points with a non-finite coordinate are never on it.

    Example:
        >>> pareto_front([(1, 5), (2, 3), (3, 4), (2, 3)])
        [True, True, False, True]
    """
    ok = [all(isinstance(v, (int, float)) and math.isfinite(v) for v in p) for p in points]
    front = []
    for i, (x, y) in enumerate(points):
        if not ok[i]:
            front.append(False)
            continue
        dominated = any(
            ok[j] and px <= x and py <= y and (px < x or py < y)
            for j, (px, py) in enumerate(points)
            if j != i
        )
        front.append(not dominated)
    return front


# ------------------------------------------------------------------------------------------ recommend


def budget_text(max_kl: float | None, max_dppl_pct: float | None) -> str:
    parts = []
    if max_kl is not None:
        parts.append(f"mean KL <= {max_kl:g}")
    if max_dppl_pct is not None:
        parts.append(f"Δppl <= {max_dppl_pct:+g}%")
    return " and ".join(parts)


def _misses(c: dict[str, Any], max_kl: float | None, max_dppl_pct: float | None) -> list[str]:
    out = []
    if max_kl is not None and not c["kl_mean"] <= max_kl:
        out.append(f"KL {c['kl_mean']:.4g} > {max_kl:g}")
    if max_dppl_pct is not None and not c["delta_ppl_pct"] <= max_dppl_pct:
        out.append(f"Δppl {c['delta_ppl_pct']:+.2f}% > {max_dppl_pct:+g}%")
    return out


def _cost(c: dict[str, Any]) -> tuple:
    bpt = c.get("bytes_per_token")
    return (c["effective_bits"], math.inf if bpt is None else bpt, c["cache"])


def recommend(
    configs: list[dict[str, Any]],
    max_kl: float | None = None,
    max_dppl_pct: float | None = None,
    budget_label: str | None = None,
) -> dict[str, Any]:
    """The cheapest config (fewest effective bits, then fewest bytes per token) whose mean KL is at
    most ``max_kl`` and whose Δppl (percent) is at most ``max_dppl_pct`` (a budget left ``None`` is
    not checked), and a one- or two-sentence reason.

    ``configs``: rows with ``cache``, ``effective_bits``, ``kl_mean``, ``delta_ppl_pct`` and
    optionally ``bytes_per_token``, ``max_sequences``, ``context``, ``cache_kind``. The DynamicCache
    row (``cache_kind == "dynamic"`` or ``cache == "dynamic"``) is the reference, never a candidate.
    ``budget_label``: the memory budget the ``max_sequences`` figures are for (e.g. ``"24GiB"``).
    Returns ``{"pick": name or None, "text": ..., "budget": {...}, "next_cheaper": name or None}``.
    """
    budget = {"max_kl": max_kl, "max_dppl_pct": max_dppl_pct}
    if max_kl is None and max_dppl_pct is None:
        text = (
            "No quality budget given (recommend.max_kl / recommend.max_dppl_pct in the YAML, or "
            "--budget-kl / --budget-dppl), so no recommendation."
        )
        return {"pick": None, "text": text, "budget": budget, "next_cheaper": None}

    def is_ref(c):
        return c.get("cache_kind") == "dynamic" or c["cache"] == "dynamic"

    ref = next((c for c in configs if is_ref(c)), None)
    cands = [
        c
        for c in configs
        if not is_ref(c)
        and all(isinstance(c.get(k), (int, float)) for k in ("effective_bits", "kl_mean", "delta_ppl_pct"))
    ]
    cands.sort(key=_cost)
    meets = [c for c in cands if not _misses(c, max_kl, max_dppl_pct)]
    label = budget_text(max_kl, max_dppl_pct)
    if not meets:
        if not cands:
            text = f"Budget {label}: no quantized config was measured, so no recommendation."
            return {"pick": None, "text": text, "budget": budget, "next_cheaper": None}

        def excess(c):
            e = []
            if max_kl is not None:
                e.append((c["kl_mean"] - max_kl) / max(max_kl, 1e-12))
            if max_dppl_pct is not None:
                e.append((c["delta_ppl_pct"] - max_dppl_pct) / max(abs(max_dppl_pct), 1e-12))
            return max(e)

        close = min(cands, key=excess)
        text = (
            f"Budget {label}: no quantized config meets it; keep DynamicCache or relax the budget. "
            f"The closest, {close['cache']} ({close['effective_bits']:.2f} bits per element), missed it with "
            f"{' and '.join(_misses(close, max_kl, max_dppl_pct))}."
        )
        return {"pick": None, "text": text, "budget": budget, "next_cheaper": None, "closest": close["cache"]}

    pick = meets[0]
    saving = ""
    ctx = pick.get("context")
    at = f" at {ctx:,} tokens" if ctx else ""
    if ref is not None and pick.get("bytes_per_token") and ref.get("bytes_per_token"):
        saving = (
            f", {pick['bytes_per_token']:,.0f} B/token{at} against DynamicCache's "
            f"{ref['bytes_per_token']:,.0f} ({ref['bytes_per_token'] / pick['bytes_per_token']:.1f}x less"
        )
        if pick.get("max_sequences") and ref.get("max_sequences"):
            where = f" in {budget_label}" if budget_label else ""
            saving += f"; {pick['max_sequences']:,} instead of {ref['max_sequences']:,} sequences{where}"
        saving += ")"
    text = (
        f"Budget {label}: use {pick['cache']}, the cheapest config that meets it: "
        f"{pick['effective_bits']:.2f} effective bits per element{saving}, "
        f"for mean KL {pick['kl_mean']:.4g} and Δppl {pick['delta_ppl_pct']:+.2f}%."
    )
    cheaper = [c for c in cands if _cost(c) < _cost(pick)]
    nxt = cheaper[-1] if cheaper else None
    if nxt is not None:
        text += (
            f" The next cheaper config, {nxt['cache']} ({nxt['effective_bits']:.2f} bits), missed it with "
            f"{' and '.join(_misses(nxt, max_kl, max_dppl_pct))}."
        )
    else:
        text += " No measured config is cheaper."
    return {"pick": pick["cache"], "text": text, "budget": budget, "next_cheaper": nxt and nxt["cache"]}


# ------------------------------------------------------------------------------------------ capacity


def capacity(cfg, specs: list[CacheSpec], model_config: Any) -> dict[str, Any]:
    """Max concurrent sequences at ``cfg.capacity.budget`` per cache and context (kvquant plan);
    transformers' caches other than DynamicCache are not modelled by the planner."""
    from kvquant.eval.sweep import SweepError
    from kvquant.plan import PlanError, plan

    cap = cfg.capacity
    contexts = sorted(set(cfg.grid.contexts) | set(cap.contexts or []))
    quant = [s for s in specs if s.kind == "kvquant"]
    table: dict[str, dict[str, int]] = {s.name: {} for s in specs if s.kind in ("dynamic", "kvquant")}
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
                table[s.name][str(context)] = row["max_batch"]
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
        "max_sequences": table,
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


PLOT_NOTES = {
    "quality_vs_bits": "mean KL and Δppl against effective bits per element, Pareto front marked",
    "decode_speed": "decode tokens/s and its ratio to the interleaved DynamicCache, against context",
    "memory_vs_context": "bytes per token held and peak memory, against context",
    "capacity": "max concurrent sequences at the memory budget, against context",
}


def build_report(cfg, specs, labels, done, model_configs, corpus_info, out: Path) -> dict[str, Any]:
    """Write ``results.csv``, ``results.md``, ``summary.json`` and ``plots/``; return what they hold."""
    from kvquant.eval.plots import write_plots

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
    md = [
        f"# kvquant sweep: {cfg.name or out.name}",
        "",
        f"Models: {', '.join(labels)} ({m.dtype}, attention {m.attn_implementation}). "
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
    md += ["## Plots", ""]
    for p in plots:
        stem = p.stem.split("-")[0] if len(labels) > 1 else p.stem
        md.append(f"- `plots/{p.name}`: {PLOT_NOTES.get(stem, '')} (data: `plots/{p.stem}.json`)")
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
    }
