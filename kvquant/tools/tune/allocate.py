"""The tuner's allocation: an exact multiple-choice knapsack over tensors (:func:`allocate`) and the
costs / measured KL of whole allocations (:class:`Plan`).

Example:
    >>> allocate([{"a": (1, 0.5), "b": (2, 0.1)}, {"a": (1, 0.3), "b": (2, 0.2)}], budget_cost=3)
    (['b', 'a'], True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvquant.tools.tune.costs import TENSORS


def allocate(
    items: list[dict[str, tuple[float, float]]],
    *,
    budget_cost: float | None = None,
    budget_kl: float | None = None,
) -> tuple[list[str], bool]:
    """Exact multiple-choice knapsack: one option per item, ``items[j][option] = (cost, kl)``.

    With ``budget_cost``: the least total KL whose total cost is at most it; with ``budget_kl``:
    the least cost whose KL is at most it (else the least KL there is). Returns
    ``(option per item, whether the budget is met)``; exactly one budget must be given.
    """
    if (budget_kl is None) == (budget_cost is None):
        raise ValueError("budget: give exactly one of budget_kl or budget_bits")
    if not items or any(not opts for opts in items):
        raise ValueError("allocate: every item needs at least one option")
    min_rest = np.cumsum([min(c for c, _ in opts.values()) for opts in items][::-1])[::-1].tolist() + [0.0]
    if budget_cost is not None and min_rest[0] > budget_cost + 1e-9:
        return [min(opts, key=lambda o: opts[o][0]) for opts in items], False
    costs, kls = np.zeros(1), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
    for j, opts in enumerate(items):
        names = list(opts)
        oc = np.array([opts[n][0] for n in names], dtype=np.float64)
        ok = np.array([opts[n][1] for n in names], dtype=np.float64)
        c = (costs[:, None] + oc[None]).ravel()
        k = (kls[:, None] + ok[None]).ravel()
        order = np.lexsort((k, c))  # by cost, then KL
        c, k = c[order], k[order]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], k[:-1]]))
        keep = k < best_before  # the Pareto front: strictly less KL than anything as cheap
        if budget_cost is not None:
            keep &= c + min_rest[j + 1] <= budget_cost + 1e-9
        idx = order[keep]
        back.append((idx // len(names), idx % len(names), names))
        costs, kls = c[keep], k[keep]
    if budget_cost is not None:
        pick, met = len(costs) - 1, True  # the front's KL falls as cost rises: the last is the best
    else:
        within = np.nonzero(kls <= budget_kl)[0]
        pick, met = (int(within[0]), True) if len(within) else (len(costs) - 1, False)
    choice: list[str] = []
    for prev, opt, names in reversed(back):
        choice.append(names[int(opt[pick])])
        pick = int(prev[pick])
    return choice[::-1], met


@dataclass
class Plan:
    """Costs and measured KL of allocations: ``layers`` layers of ``ref`` bytes (both tensors on the
    base's formats) plus each tensor's added cost; ``fp16``: one layer's 16-bit bytes."""

    layers: int
    ref: int
    fp16: int
    costs: dict[str, dict[str, int]]
    sens: dict[str, dict[str, list[float]]]
    pins: dict[str, dict[int, str]]
    per: int = 1  # units per layer (KV heads in a per-head run), each 1 / per of a layer's cost

    def kl(self, t: str, f: str, u: int) -> float:
        measured = self.sens[t].get(f)
        return measured[u] if measured is not None else 0.0  # a pin outside the menu: not measured

    def uniform(self, k: str, v: str) -> dict[str, list[str]]:
        """Every unit on ``k`` / ``v``, the pins excepted."""
        return {
            t: [self.pins.get(t, {}).get(u // self.per, f) for u in range(self.layers * self.per)]
            for t, f in (("key", k), ("value", v))
        }

    def bits(self, chosen: dict[str, list[str]]) -> float:
        added = sum(self.costs[t][f] for t in TENSORS for f in chosen[t]) / self.per
        return 16 * (self.layers * self.ref + added) / (self.layers * self.fp16)

    def predicted(self, chosen: dict[str, list[str]]) -> float:
        return sum(self.kl(t, f, i) for t in TENSORS for i, f in enumerate(chosen[t]))
