"""Speed: prefill time and decode tokens/s against context length (and batch size).

One timed run: a fresh cache, one forward over ``[B, L]`` prompt tokens (prefill), then
``decode_tokens`` greedy steps of one token per row through the cache (decode). ``warmup`` runs are
discarded, the median of ``repeats`` runs is reported. On CUDA the device is synchronized around each
timed region.

:func:`measure_speed` takes several caches and interleaves them run by run (A B A B ...), so a cache
and the DynamicCache it is compared with share the same machine state: on a busy or throttling
machine, drift hits both alike. The runner pairs every config with a DynamicCache this way.
:func:`measure_decode` fills every cache once and interleaves rounds of decode steps (the CPU
benchmark: more decode steps for the same time); with ``paired_with`` the reference runs right
before every other cache, so each ratio is taken between adjacent runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_tokens(stream: torch.Tensor, length: int, batch: int) -> torch.Tensor:
    """``[batch, length]`` tokens: the start of ``stream``, cycled if it is shorter."""
    reps = -(-length // stream.numel())
    row = stream.repeat(reps)[:length]
    return row[None].expand(batch, -1).contiguous()


def _timed_prefill(model: Any, cache: Any, ids: torch.Tensor, device) -> tuple[torch.Tensor, float]:
    """(the greedy next token ``[B, 1]``, seconds) of one forward over ``ids`` into ``cache``."""
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)  # [B, 1]
    _sync(device)
    return nxt, time.perf_counter() - t0


def _timed_decode(
    model: Any, cache: Any, nxt: torch.Tensor, steps: int, device
) -> tuple[torch.Tensor, float]:
    """(the next token, seconds) of ``steps`` greedy one-token steps from ``nxt [B, 1]``."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    _sync(device)
    return nxt, time.perf_counter() - t0


@torch.no_grad()
def time_once(model: Any, cache: Any, ids: torch.Tensor, decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one run."""
    device = next(model.parameters()).device
    nxt, prefill_s = _timed_prefill(model, cache, ids.to(device), device)
    _, decode_s = _timed_decode(model, cache, nxt, decode_tokens, device)
    return prefill_s, decode_s


def measure_speed(
    model: Any,
    builds: dict[str, Callable[[], Any]],
    stream: torch.Tensor,
    *,
    context_lengths: list[int],
    batch_sizes: list[int],
    decode_tokens: int,
    warmup: int,
    repeats: int,
    progress: Callable | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """For each cache in ``builds`` (name -> fresh cache), one row per (context, batch): median prefill
    ms, decode ms per step and decode tokens/s. The caches' runs are interleaved."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    grid = [(L, b) for L in context_lengths for b in batch_sizes]
    for L, b in progress(grid, desc="speed", leave=False) if progress else grid:
        ids = prompt_tokens(stream, L, b)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in builds}
        for i in range(warmup + repeats):
            for name, build in builds.items():
                t = time_once(model, build(), ids, decode_tokens)
                if i >= warmup:
                    times[name].append(t)
        for name, ts in times.items():
            p_med = statistics.median(t[0] for t in ts)
            d_med = statistics.median(t[1] for t in ts)
            rows[name].append(_speed_row(L, b, p_med, d_med, decode_tokens, repeats))
    return rows


def _speed_row(context: int, batch: int, prefill_s: float, decode_s: float, steps: int, repeats: int) -> dict:
    """One row of :func:`measure_speed` / :func:`measure_decode` from seconds (``decode_s``: the
    time of ``steps`` steps)."""
    return {
        "context": context,
        "batch": batch,
        "prefill_ms": 1e3 * prefill_s,
        "decode_ms_per_step": 1e3 * decode_s / steps,
        "decode_tok_s": batch * steps / decode_s,
        "repeats": repeats,
    }


@torch.no_grad()
def measure_decode(
    model: Any,
    builds: dict[str, Callable[[], Any]],
    ids: torch.Tensor,
    *,
    decode_tokens: int,
    warmup: int,
    repeats: int,
    paired_with: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Decode speed of every cache after ONE prefill of ``ids [B, L]`` each, rounds interleaved.

    Every cache is filled once (its prefill timed), then ``warmup + repeats`` rounds run: in each,
    every cache in turn decodes ``decode_tokens`` greedy tokens, continuing from where its previous
    round stopped (the context grows by ``decode_tokens`` per round). The median round is reported.
    Cheaper than :func:`measure_speed` (one prefill per cache instead of one per run), so more
    rounds fit. All caches are held at once.

    ``paired_with`` (a name in ``builds``, e.g. a ``DynamicCache``): that cache runs right before
    every other one, cropped back (``crop(-n)``) to the same context first, and each row gets
    ``paired_x``, the median over rounds of the reference's time over its own in the paired runs:
    above 1, faster than the reference. On a machine whose speed drifts over seconds (a shared VM),
    a ratio of runs seconds apart moves by tens of percent; adjacent runs share the machine's state.
    The reference's own row is the median of its paired runs. A reference with sliding-window layers
    cannot be cropped back past its window: it then runs once per round like the others, and
    ``paired_x`` is the ratio of the median rounds.

    Returns ``name -> {context, batch, prefill_ms, decode_ms_per_step, decode_tok_s, repeats,
    context_end}`` (``context_end``: the context after the last round), plus ``paired_x`` and
    ``paired_rounds`` (the per-round ratios; empty for the reference or unpaired).
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    b, length = ids.shape
    if paired_with is not None and paired_with not in builds:
        raise ValueError(f"paired_with: {paired_with!r} is not one of the caches: {', '.join(builds)}")
    state: dict[str, list] = {}
    for name, build in builds.items():  # one prefill each
        cache = build()
        nxt, prefill_s = _timed_prefill(model, cache, ids, device)
        state[name] = [cache, nxt, prefill_s, []]
    ref_name = paired_with if paired_with and len(builds) > 1 and _croppable(state[paired_with][0]) else None
    ratios: dict[str, list[float]] = {name: [] for name in builds if name != ref_name}
    for i in range(warmup + repeats):
        start = length + i * decode_tokens  # every cache's context at the start of this round
        for name in builds:
            if name == ref_name:
                continue
            ref_s = None
            if ref_name is not None:
                ref = state[ref_name]
                ref[0].crop(start - ref[0].get_seq_length())  # back to this round's context
                ref[1], ref_s = _timed_decode(model, ref[0], ref[1], decode_tokens, device)
            cache, nxt, _, rounds = state[name]
            state[name][1], seconds = _timed_decode(model, cache, nxt, decode_tokens, device)
            if i >= warmup:
                rounds.append(seconds)
                if ref_s is not None:
                    state[ref_name][3].append(ref_s)
                    ratios[name].append(ref_s / seconds)
    rows = {}
    for name, (_, _, prefill_s, rounds) in state.items():
        row = _speed_row(length, b, prefill_s, statistics.median(rounds), decode_tokens, repeats)
        rows[name] = {**row, "context_end": length + (warmup + repeats) * decode_tokens}
    if paired_with is not None:
        ref_tok_s = rows[paired_with]["decode_tok_s"]
        for name, row in rows.items():
            paired = ratios.get(name) if ref_name is not None else None
            # unpaired (alone, or a reference that cannot crop): the ratio of the median rounds
            row["paired_x"] = statistics.median(paired) if paired else row["decode_tok_s"] / ref_tok_s
            row["paired_rounds"] = list(paired or ())
    return rows


def _croppable(cache: Any) -> bool:
    """Whether ``cache`` takes ``crop(-n)`` at any length: it has no sliding-window layer (one past
    its window has dropped the positions a crop would have to bring back, and refuses)."""
    layers = getattr(cache, "layers", None)
    return callable(getattr(cache, "crop", None)) and not any(
        getattr(layer, "is_sliding", False) for layer in layers or ()
    )


def with_ratios(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with ``prefill_x`` (reference time / time) and ``decode_x`` (tok/s / reference tok/s):
    above 1 means faster than the reference."""
    ref = {(r["context"], r["batch"]): r for r in reference}
    out = []
    for r in rows:
        q = ref.get((r["context"], r["batch"]))
        extra = {}
        if q is not None:
            extra = {
                "prefill_x": q["prefill_ms"] / r["prefill_ms"],
                "decode_x": r["decode_tok_s"] / q["decode_tok_s"],
            }
        out.append({**r, **extra})
    return out
