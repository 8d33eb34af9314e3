"""Speed: prefill time and decode tokens/s against context length (and batch size).

One timed run: a fresh cache, one forward over ``[B, L]`` prompt tokens (prefill), then
``decode_tokens`` greedy steps of one token per row through the cache (decode). ``warmup`` runs are
discarded, the median of ``repeats`` runs is reported. On CUDA the device is synchronized around each
timed region.

:func:`measure_speed` takes several caches and interleaves them run by run (A B A B ...), so a cache
and the DynamicCache it is compared with share the same machine state: on a busy or throttling
machine, drift hits both alike. The runner pairs every config with a DynamicCache this way.
:func:`measure_decode` fills every cache once and interleaves rounds of decode steps (the CPU
benchmark: more decode steps for the same time).
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
) -> dict[str, dict[str, Any]]:
    """Decode speed of every cache after ONE prefill of ``ids [B, L]`` each, rounds interleaved.

    Every cache is filled once (its prefill timed), then ``warmup + repeats`` rounds run: in each,
    every cache in turn decodes ``decode_tokens`` greedy tokens, continuing from where its previous
    round stopped (the context grows by ``decode_tokens`` per round). The median round is reported.
    Cheaper than :func:`measure_speed` (one prefill per cache instead of one per run), so more
    rounds fit, and machine drift still hits all caches alike. All caches are held at once.

    Returns ``name -> {context, batch, prefill_ms, decode_ms_per_step, decode_tok_s, repeats,
    context_end}`` (``context_end``: the context after the last round).
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    b, length = ids.shape
    state: dict[str, list] = {}
    for name, build in builds.items():  # one prefill each
        cache = build()
        nxt, prefill_s = _timed_prefill(model, cache, ids, device)
        state[name] = [cache, nxt, prefill_s, []]
    for i in range(warmup + repeats):
        for name in builds:
            cache, nxt, _, rounds = state[name]
            state[name][1], seconds = _timed_decode(model, cache, nxt, decode_tokens, device)
            if i >= warmup:
                rounds.append(seconds)
    rows = {}
    for name, (_, _, prefill_s, rounds) in state.items():
        row = _speed_row(length, b, prefill_s, statistics.median(rounds), decode_tokens, repeats)
        rows[name] = {**row, "context_end": length + (warmup + repeats) * decode_tokens}
    return rows


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
