"""``kvquant tune``: a per-layer bit allocation that meets a KL or bits budget with the fewest bytes.

1. **Sensitivity.** For every layer and every rung of a ladder of K/V format pairs (``k2v2`` …
   ``k8v8``), run the calibration windows once in simulated mode (keys and values quantized and
   dequantized inside one forward, see :func:`kvquant.eval.decode.simulated_logprobs`) with *only
   that layer* quantized, and record the mean KL divergence of the next-token distributions from
   the full-precision model's over the scored positions.
2. **Allocation.** Treat the KL of layers as additive. Start every layer on the cheapest rung and
   repeatedly take the upgrade (layer, rung) that removes the most KL per added bit, until the
   predicted KL meets ``budget_kl`` (or until no upgrade fits in ``budget_bits``).
3. **Output.** A :class:`~kvquant.KVQuantConfig` whose base formats are the most used rung and whose
   ``layer_overrides`` hold the others, written as YAML any cache or ``kvquant eval`` accepts.

The predicted KL is a screening number (simulated mode, additivity); measure the result with
``kvquant eval`` (decode mode) before trusting it.

Example:
    >>> result = tune(model, calib_ids, budget_kl=0.02)
    >>> result.config.to_yaml("tuned.yaml")
    >>> cache = KVQuantCache(model.config, "tuned.yaml")
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvquant.config import KVQuantConfig
from kvquant.formats import format_spec
from kvquant.memory import format_bits

# rung name -> (key_format, value_format); sorted by bits below
LADDER: dict[str, tuple[str, str]] = {
    "k2v2": ("nuq2", "nuq2"),
    "k3v2": ("nuq3", "nuq2"),
    "k3v3": ("nuq3", "nuq3"),
    "k4v3": ("nuq4", "nuq3"),
    "k4v4": ("nuq4", "nuq4"),
    "k8v8": ("int8", "int8"),
}
# the settings every rung shares unless the caller passes its own base
DEFAULT_BASE = KVQuantConfig(
    key_format="nuq4",
    value_format="nuq4",
    rotation="hadamard",
    smoothing="mean",
    sink_tokens=4,
    residual_length=16,
    name="tuned",
)


def rung_bits(base: KVQuantConfig, formats: tuple[str, str], head_dim: int) -> float:
    """Bits per K/V element of a rung's formats with ``base``'s groups and scale dtype (codes and
    scales / zero points; the full-precision sink and residual tokens are the same on every rung)."""
    cfg = dataclasses.replace(base, key_format=formats[0], value_format=formats[1], layer_overrides={})
    if not all(format_spec(f).has_scale for f in formats):
        raise ValueError(f"candidates: a rung may not use the pass-through format, got {formats}")
    return (format_bits(cfg, "key", head_dim) + format_bits(cfg, "value", head_dim)) / 2


@dataclass
class TuneResult:
    """What :func:`tune` found.

    ``rungs[i]`` is layer ``i``'s rung; ``sensitivity[rung][i]`` the KL measured with only layer ``i``
    on that rung; ``format_bits`` the mean bits per element of the codes and scales over layers.
    """

    config: KVQuantConfig
    rungs: list[str]
    predicted_kl: float
    format_bits: float
    sensitivity: dict[str, list[float]]
    met: bool
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        counts = Counter(self.rungs)
        mix = ", ".join(f"{r} x{counts[r]}" for r in LADDER if counts.get(r))
        state = "meets" if self.met else "does NOT meet"
        return (
            f"{len(self.rungs)} layers: {mix}; format bits {self.format_bits:.3f}; predicted KL "
            f"{self.predicted_kl:.4g} (simulated, additive) — {state} the budget"
        )


def _kl(base: torch.Tensor, test: torch.Tensor) -> float:
    """Mean KL(base || test) over positions: log-probs ``[B, N, V]``."""
    from kvquant.eval.quality import kl_per_prediction

    return kl_per_prediction(base, test).mean().item()


@torch.no_grad()
def _logprobs(model: Any, ids: torch.Tensor, score_from: int, quant: KVQuantConfig | None) -> torch.Tensor:
    from kvquant.cache import KVQuantCache
    from kvquant.eval.decode import simulated_logprobs, single_pass_logprobs

    outs = []
    for row in ids:  # one window at a time: [1, N]
        if quant is None:
            outs.append(single_pass_logprobs(model, row[None], score_from))
        else:
            outs.append(simulated_logprobs(model, row[None], score_from, KVQuantCache(model.config, quant)))
    return torch.cat(outs)


def layer_sensitivity(
    model: Any,
    input_ids: torch.Tensor,
    base: KVQuantConfig,
    rungs: dict[str, tuple[str, str]],
    *,
    score_from: int,
    progress: bool = False,
) -> dict[str, list[float]]:
    """``{rung: [KL with only layer i on that rung, for every layer i]}`` on ``input_ids[W, N]``."""
    from tqdm.auto import tqdm

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    reference = _logprobs(model, input_ids, score_from, None)
    off = {i: {"key_format": "none", "value_format": "none"} for i in range(layers)}
    out: dict[str, list[float]] = {r: [0.0] * layers for r in rungs}
    jobs = [(r, i) for r in rungs for i in range(layers)]
    for rung, i in tqdm(jobs, desc="layer sensitivity", disable=not progress):
        k_fmt, v_fmt = rungs[rung]
        over = dict(off)
        over[i] = {"key_format": k_fmt, "value_format": v_fmt}
        quant = dataclasses.replace(base, layer_overrides=over)
        out[rung][i] = _kl(reference, _logprobs(model, input_ids, score_from, quant))
    return out


def allocate(
    sensitivity: dict[str, list[float]],
    bits: dict[str, float],
    *,
    budget_kl: float | None = None,
    budget_bits: float | None = None,
) -> tuple[list[str], bool]:
    """Greedy allocation (see the module docstring): ``(rung per layer, whether the budget is met)``.

    ``bits[rung]`` is the rung's bits per element; exactly one of the budgets must be given.
    """
    if (budget_kl is None) == (budget_bits is None):
        raise ValueError("budget: give exactly one of budget_kl or budget_bits")
    order = sorted(bits, key=lambda r: bits[r])
    n = len(next(iter(sensitivity.values())))
    level = [0] * n  # index into `order` per layer

    def total_kl() -> float:
        return sum(sensitivity[order[level[i]]][i] for i in range(n))

    def mean_bits() -> float:
        return sum(bits[order[level[i]]] for i in range(n)) / n

    if budget_bits is not None and mean_bits() > budget_bits + 1e-9:
        return [order[0]] * n, False
    while True:
        if budget_kl is not None and total_kl() <= budget_kl:
            return [order[j] for j in level], True
        best, best_gain = None, 0.0
        for i in range(n):
            here = sensitivity[order[level[i]]][i]
            for j in range(level[i] + 1, len(order)):
                added = (bits[order[j]] - bits[order[level[i]]]) / n
                if budget_bits is not None and mean_bits() + added > budget_bits + 1e-9:
                    continue
                gain = (here - sensitivity[order[j]][i]) / max(added, 1e-12)
                if gain > best_gain:
                    best, best_gain = (i, j), gain
        if best is None:  # nothing left that helps (or fits)
            met = budget_bits is not None or total_kl() <= budget_kl
            return [order[j] for j in level], met
        level[best[0]] = best[1]


def build_config(base: KVQuantConfig, rungs: list[str], ladder: dict[str, tuple[str, str]]) -> KVQuantConfig:
    """``base`` with the most common rung as its formats and the other layers as overrides."""
    common = Counter(rungs).most_common(1)[0][0]
    k_fmt, v_fmt = ladder[common]
    overrides = {
        i: {"key_format": ladder[r][0], "value_format": ladder[r][1]}
        for i, r in enumerate(rungs)
        if r != common
    }
    return dataclasses.replace(base, key_format=k_fmt, value_format=v_fmt, layer_overrides=overrides)


def tune(
    model: Any,
    input_ids: torch.Tensor,
    *,
    budget_kl: float | None = None,
    budget_bits: float | None = None,
    base: KVQuantConfig | str | None = None,
    ladder: dict[str, tuple[str, str]] | None = None,
    score_from: int | None = None,
    progress: bool = False,
) -> TuneResult:
    """Measure per-layer sensitivity on ``input_ids[W, N]`` and allocate rungs to meet the budget.

    Args:
        budget_kl: largest predicted mean KL; the cheapest allocation meeting it is returned.
        budget_bits: largest mean format bits per element; the lowest-KL allocation within it.
        base: shared settings (rotation, smoothing, sinks, residual, groups); default
            :data:`DEFAULT_BASE`. Its ``layer_overrides`` are ignored.
        ladder: ``{rung: (key_format, value_format)}``; default :data:`LADDER`.
        score_from: first scored position of each window (default: half the window).
    """
    base_cfg = DEFAULT_BASE if base is None else KVQuantConfig.resolve(base)
    base_cfg = dataclasses.replace(base_cfg, layer_overrides={}, name="tuned")
    ladder = dict(LADDER if ladder is None else ladder)
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids: expected [windows, tokens >= 2], got {tuple(input_ids.shape)}")
    score_from = input_ids.shape[1] // 2 if score_from is None else score_from
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    bits = {r: rung_bits(base_cfg, f, head_dim) for r, f in ladder.items()}
    sens = layer_sensitivity(model, input_ids, base_cfg, ladder, score_from=score_from, progress=progress)
    rungs, met = allocate(sens, bits, budget_kl=budget_kl, budget_bits=budget_bits)
    predicted = sum(sens[r][i] for i, r in enumerate(rungs))
    fmt_bits = sum(bits[r] for r in rungs) / len(rungs)
    notes = [] if met else ["even the most precise rung on every layer misses the KL budget"]
    return TuneResult(build_config(base_cfg, rungs, ladder), rungs, predicted, fmt_bits, sens, met, notes)
