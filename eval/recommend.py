"""Which cache to use: the Pareto front of cost against quality loss, and the cheapest config within a
quality budget, with a sentence saying why.

A config's *cost* is the effective bits per element it holds (bytes per token breaks ties); its loss
is its mean KL and Δppl against DynamicCache on the same tokens.

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

import math
from typing import Any


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
