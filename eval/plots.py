"""The sweep's plots (PNG, Agg, no pyplot state), each written with the data behind it as JSON.

``quality_vs_bits``    mean KL and Δppl against effective bits per element, Pareto front marked
``decode_speed``       decode tokens/s and its ratio to DynamicCache against context, per batch
``memory_vs_context``  bytes per token held and peak memory against context, per batch
``capacity``           max concurrent sequences at the memory budget against context

``plots/<name>.json`` holds exactly the numbers drawn (a test compares them with ``results.csv``).
With several models each file name gets ``-<model>``.

Example:
    >>> from kvquant.eval.plots import write_plots
    >>> paths = write_plots(result.points, summaries, capacities, Path("runs/sweep-default/plots"))
"""

from __future__ import annotations

import json
import math
import re
from functools import partial
from pathlib import Path
from typing import Any

from kvquant.eval.recommend import pareto_front

NOTES = {  # what each plot shows (results.md lists them with these words)
    "quality_vs_bits": "mean KL and Δppl against effective bits per element, Pareto front marked",
    "decode_speed": "decode tokens/s and its ratio to the interleaved DynamicCache, against context",
    "memory_vs_context": "bytes per token held and peak memory, against context",
    "capacity": "max concurrent sequences at the memory budget, against context",
}
MARKERS = "osD^v<>pPXh*"
BIT_TICKS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
FRONT_LABEL = {  # the name of a cache on the Pareto front
    "textcoords": "offset points",
    "va": "top",
    "fontsize": 8,
    "color": "0.2",
    "arrowprops": {"arrowstyle": "-", "color": "0.55", "lw": 0.6, "shrinkB": 6},
}
DYNAMIC_STYLE = {"color": "black", "marker": "o", "linestyle": "-"}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def styles(names: list[str]) -> dict[str, dict[str, Any]]:
    """A color / marker / line style per cache name, the same in every plot."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"] if len(names) <= 11 else colormaps["tab20"]
    out, i = {}, 0
    for name in names:
        if name == "dynamic":
            out[name] = dict(DYNAMIC_STYLE)
            continue
        out[name] = {
            "color": cmap(i % cmap.N),
            "marker": MARKERS[i % len(MARKERS)],
            "linestyle": "-" if i < cmap.N else "--",
        }
        i += 1
    return out


def _k(n: float) -> str:
    return f"{n / 1024:g}k" if n >= 1024 and n % 1024 == 0 else f"{n:g}"


def _context_axis(ax, contexts: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(contexts))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _k(v)))
    ax.set_xlabel("context length [tokens]")
    ax.grid(True, alpha=0.3)


def _plain_log_y(ax) -> None:
    """Log y axis with plain numbers (1,000 rather than 10^3) at 1-2-5 steps."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _legend(fig, axes, extra: list | None = None) -> None:
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    for h, lab in extra or []:
        handles.append(h)
        labels.append(lab)
    fig.legend(handles, labels, loc="outside right center", fontsize=9, title="cache", frameon=False)


def _save(fig, data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    fig.savefig(path, format="png")
    return path


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# ------------------------------------------------------------------------------------------ plots


def plot_quality_vs_bits(
    summaries: list[dict[str, Any]], path: Path, style: dict, budget: dict | None = None, title: str = ""
) -> Path:
    """Two panels, mean KL and Δppl % against effective bits per element; the Pareto front of each
    panel (fewer bits, lower loss) is joined by a dashed line and ringed."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    budget = budget or {}
    panels = {
        "kl_mean": ("mean KL(DynamicCache ‖ cache) [nats / token]", budget.get("max_kl")),
        "delta_ppl_pct": ("Δ perplexity vs DynamicCache [%]", budget.get("max_dppl_pct")),
    }
    ctx = summaries[0]["context"] if summaries else None
    data: dict[str, Any] = {
        "context": ctx,
        "batch": summaries[0]["batch"] if summaries else None,
        "panels": {},
    }
    fig = _figure(13, 5.2)
    axes = fig.subplots(1, 2)
    for ax, (metric, (ylabel, limit)) in zip(axes, panels.items(), strict=True):
        pts = [c for c in summaries if _finite(c["effective_bits"]) and _finite(c[metric])]
        front = pareto_front([(c["effective_bits"], c[metric]) for c in pts])
        data["panels"][metric] = [
            {"cache": c["cache"], "effective_bits": c["effective_bits"], "value": c[metric], "pareto": f}
            for c, f in zip(pts, front, strict=True)
        ]
        for c in pts:
            st = style[c["cache"]]
            ax.scatter(c["effective_bits"], c[metric], s=55, color=st["color"], marker=st["marker"],
                       label=c["cache"], zorder=3)  # fmt: skip
        on = sorted(
            (c["effective_bits"], c[metric], c["cache"]) for c, f in zip(pts, front, strict=True) if f
        )
        if on:
            xs, ys = [p[0] for p in on], [p[1] for p in on]
            ax.plot(xs, ys, "--", color="0.35", lw=1.2, zorder=2)
            ax.scatter(xs, ys, s=190, facecolors="none", edgecolors="0.2", linewidths=1.3, zorder=4)
            names: dict[tuple[float, float], list[str]] = {}
            for x, y, name in on:  # one label per spot: caches with equal numbers share it
                names.setdefault((x, y), []).append(name)
            # Below-left of a front point nothing is drawn (a point there would dominate it, and
            # the front runs up-left and down-right): labels go there, the leftmost one below-right.
            for i, ((x, y), group) in enumerate(names.items()):
                where = {"xytext": (-9, -13), "ha": "right"} if i > 0 else {"xytext": (9, -13), "ha": "left"}
                ax.annotate(", ".join(group), (x, y), **where, **FRONT_LABEL)
        values = [c[metric] for c in pts]
        positive = [abs(v) for v in values if v != 0]
        lin = 10 ** math.floor(math.log10(min(positive))) if positive else 1e-4
        if metric == "delta_ppl_pct":
            lin = max(lin, 0.1)
        ax.set_yscale("symlog", linthresh=lin)
        ax.margins(y=0.12)  # room for the labels below the lowest points
        ax.axhline(0, color="0.6", lw=0.8)
        if limit is not None:
            ax.axhline(limit, color="tab:red", lw=1, ls=":", zorder=1)
            ax.annotate(f"budget {limit:g}", (0.01, limit), xycoords=("axes fraction", "data"), xytext=(0, 3),
                        textcoords="offset points", fontsize=8, color="tab:red")  # fmt: skip
        bits = [c["effective_bits"] for c in pts] or [4, 16]
        ax.set_xscale("log", base=2)
        ticks = [t for t in BIT_TICKS if min(bits) / 1.2 <= t <= max(bits) * 1.2]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlim(min(bits) / 1.15, max(bits) * 1.15)
        ax.set_xlabel(f"effective bits per element held at {ctx:,} tokens (codes + scales + fp tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, which="major")
    fig.suptitle(title or "Quality against memory (lower left is better)")
    front = Line2D([], [], ls="--", color="0.35", marker="o", markerfacecolor="none", markeredgecolor="0.2",
                   markersize=11)  # fmt: skip
    _legend(fig, axes, [(front, "Pareto front")])
    return _save(fig, data, path)


def _series(rows: list[dict[str, Any]], batch: int, fields: tuple[str, ...]) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for r in rows:
        if r["batch"] != batch or not all(_finite(r[f]) for f in fields):
            continue
        s = out.setdefault(r["cache"], {"context": [], **{f: [] for f in fields}})
        s["context"].append(r["context"])
        for f in fields:
            s[f].append(r[f])
    return out


def _lines(ax, series: dict, field: str, style: dict) -> list[str]:
    """One line per cache; a line equal to one drawn before it is dashed with hollow markers (so
    both stay visible). Returns ``"b = a"`` for each such pair, for the legend."""
    seen: dict[tuple, str] = {}
    same = []
    for name, s in series.items():
        st = style[name]
        pts = [
            (c, v) for c, v in zip(s["context"], s[field], strict=True) if v > 0 or ax.get_yscale() != "log"
        ]
        key = tuple(pts)
        kw = {"color": st["color"], "marker": st["marker"], "ls": st["linestyle"], "ms": 5}
        if key in seen:
            same.append(f"{name} = {seen[key]}")
            kw.update(ls=(0, (4, 3)), markerfacecolor="none", ms=9)
        seen.setdefault(key, name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **kw)
    return same


def _same_entries(pairs: list[str]) -> list:
    """Legend rows (no symbol) naming caches whose lines coincide in some panel."""
    from matplotlib.lines import Line2D

    rows = list(dict.fromkeys(pairs))
    blank = Line2D([], [], ls="none")
    return [(blank, "same values:")] + [(blank, p) for p in rows] if rows else []


def _two_panels_per_batch(
    rows: list[dict[str, Any]],
    path: Path,
    style: dict,
    title: str,
    top: tuple[str, str],
    bottom: tuple[str, str],
    *,
    log_top: bool = False,
    bottom_ref: float | None = None,
) -> Path:
    """One column per batch: metric ``top[0]`` above ``bottom[0]`` against context (``[1]``: y label)."""
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    data: dict[str, Any] = {"batches": {}}
    same: list[str] = []
    fig = _figure(5.2 * len(batches) + 3.4, 7.5)
    axes = fig.subplots(2, len(batches), squeeze=False, sharex=True)
    for j, b in enumerate(batches):
        up = _series(rows, b, (top[0],))
        down = _series(rows, b, (bottom[0],))
        data["batches"][str(b)] = {top[0]: up, bottom[0]: down}
        ax_top, ax_bottom = axes[0][j], axes[1][j]
        if log_top:
            _plain_log_y(ax_top)
        same += _lines(ax_top, up, top[0], style)
        same += _lines(ax_bottom, down, bottom[0], style)
        if bottom_ref is not None:
            ax_bottom.axhline(bottom_ref, color="0.5", lw=0.9, ls=":")
        ax_top.set_title(f"batch {b}")
        ax_top.set_ylabel(top[1])
        ax_bottom.set_ylabel(bottom[1])
        for ax in (ax_top, ax_bottom):
            _context_axis(ax, contexts)
        ax_top.set_xlabel("")
    fig.suptitle(title)
    _legend(fig, axes.flat, _same_entries(same))
    return _save(fig, data, path)


def plot_decode_speed(rows: list[dict[str, Any]], path: Path, style: dict, title: str = "") -> Path:
    """Per batch: decode tokens/s (top) and its ratio to the interleaved DynamicCache (bottom)."""
    return _two_panels_per_batch(
        rows,
        path,
        style,
        title or "Decode speed against context",
        ("decode_tok_s", "decode throughput [tokens / s]"),
        ("decode_x", "decode speed ÷ DynamicCache (same run)"),
        bottom_ref=1.0,
    )


def plot_memory(rows: list[dict[str, Any]], path: Path, style: dict, title: str = "") -> Path:
    """Per batch: bytes per token the cache holds (top) and peak memory of the run (bottom)."""
    return _two_panels_per_batch(
        rows,
        path,
        style,
        title or "Memory against context",
        ("bytes_per_token", "KV bytes held per token [B] (all layers, K+V)"),
        ("peak_mib", "peak memory of the run [MiB]"),
        log_top=True,
    )


def plot_capacity(cap: dict[str, Any], path: Path, style: dict, title: str = "") -> Path:
    """Max concurrent sequences at the memory budget (kvquant plan) against context."""
    contexts = cap["contexts"]
    series = {
        name: {"context": [c for c in contexts if str(c) in by], "max_sequences": [by[str(c)] for c in contexts if str(c) in by]}
        for name, by in cap["max_sequences"].items()
    }  # fmt: skip
    data = {k: cap[k] for k in ("budget", "weights_dtype", "kv_dtype", "reserve", "contexts")}
    data["series"] = series
    fig = _figure(10, 5.5)
    ax = fig.subplots()
    _plain_log_y(ax)  # before the lines: sequences that do not fit (0) are left out
    same = _lines(ax, series, "max_sequences", style)
    _context_axis(ax, contexts)
    ax.set_ylabel(f"max concurrent sequences in {cap['budget']}")
    note = f"weights {cap['weights_dtype']}, KV {cap['kv_dtype']}, {cap['reserve']} reserve"
    if cap.get("not_modelled"):
        note += f"; not modelled: {', '.join(cap['not_modelled'])}"
    ax.set_title(note, fontsize=9)
    fig.suptitle(title or f"Capacity at {cap['budget']} (kvquant plan)")
    _legend(fig, [ax], _same_entries(same))
    return _save(fig, data, path)


def write_plots(
    rows: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    capacities: dict[str, dict[str, Any]],
    plots_dir: Path,
    *,
    multi_model: bool = False,
    budget: dict | None = None,
) -> list[Path]:
    """All four plots per model into ``plots_dir``; returns the PNG paths."""
    paths = []
    for label, cap in capacities.items():
        own = [r for r in rows if r["model"] == label]
        style = styles(list(dict.fromkeys(r["cache"] for r in own)))
        path = partial(
            _plot_path, plots_dir, "-" + re.sub(r"[^A-Za-z0-9._]+", "_", label) if multi_model else ""
        )
        summ = [c for c in summaries if c["model"] == label]
        title = f"{label}: quality against memory (lower left is better)"
        paths.append(plot_quality_vs_bits(summ, path("quality_vs_bits"), style, budget, title))
        paths.append(
            plot_decode_speed(own, path("decode_speed"), style, f"{label}: decode speed against context")
        )
        paths.append(plot_memory(own, path("memory_vs_context"), style, f"{label}: memory against context"))
        title = f"{label}: max concurrent sequences at {cap['budget']} (kvquant plan)"
        paths.append(plot_capacity(cap, path("capacity"), style, title))
    return paths


def _plot_path(plots_dir: Path, suffix: str, name: str) -> Path:
    return plots_dir / f"{name}{suffix}.png"
