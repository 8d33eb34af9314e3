"""Memory: bytes per token a cache actually holds, next to the format's theory, and peak memory.

:func:`measure_memory` prefills the first window's ``P`` tokens and teacher-forces its ``D`` tokens
through a fresh cache while :class:`PeakMemory` watches, then counts the bytes the cache holds
(:func:`kvquant.eval.caches.cache_nbytes`) for the ``P + D - 1`` positions it has seen.

Peak memory is the increase over the level at the start of the run (``peak_bytes``):

- CUDA: ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` at entry (allocator view:
  cache, activations, logits, temporaries);
- CPU: the most bytes of tensor storage allocated during the run and alive at the same time, counted
  by :class:`TensorBytes` (a ``TorchDispatchMode``, tracemalloc-like: every ATen op's fresh outputs
  are counted until the last tensor viewing their storage is freed). Scratch memory inside a kernel
  (e.g. sdpa's) is not seen. ``peak_rss_bytes`` adds the process's resident set size sampled every
  5 ms (``psutil``), peak minus entry: coarse, it reads 0 when the run fits in memory the process
  already holds.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvquant.eval.caches import (
    CacheSpec,
    cache_nbytes,
    cache_nbytes_16bit,
    fp16_bytes_per_token,
    theoretical_bits,
)
from kvquant.eval.decode import teacher_forced_logprobs


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # psutil comes with accelerate; /proc is the fallback on Linux
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as tb: ...`` then ``tb.peak`` / ``tb.current``: bytes of tensor storage
    allocated inside the block (outputs of ATen ops that alias no input), live at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, live tensors using it]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [r.alias_info is None for r in func._schema.returns]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, o in enumerate(outs):
            is_fresh = fresh[i] if i < len(fresh) else fresh[-1] if fresh else False
            for t in tree_leaves(o):
                if isinstance(t, torch.Tensor):
                    self._track(t, is_fresh)
        return out

    def _track(self, t: torch.Tensor, fresh: bool) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return  # tensor subclasses (quanto): their inner tensors are what holds memory
        try:
            storage = t.untyped_storage()
            key, nbytes = (str(storage.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return
        entry = self.live.get(key)
        if entry is None:
            if not fresh or nbytes == 0:
                return  # a view of memory allocated before the block
            entry = self.live[key] = [nbytes, 0]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: tuple[str, int]) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.current -= entry[0]


class PeakMemory:
    """``with PeakMemory(device) as pm: ...`` then ``pm.peak_bytes`` (increase over entry), ``pm.method``
    and, on CPU, ``pm.peak_rss_bytes``."""

    def __init__(self, device: torch.device | str, interval: float = 0.005):
        self.device = torch.device(device)
        self.interval = interval
        self.peak_bytes = 0
        self.peak_rss_bytes: int | None = None
        cuda = self.device.type == "cuda"
        self.method = "cuda max_memory_allocated" if cuda else "live tensor bytes (TorchDispatchMode)"

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = self._peak = _rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
            self._tensors = TensorBytes().__enter__()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss())
            time.sleep(self.interval)

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._tensors.__exit__(*exc)
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, _rss())
            self.peak_bytes = self._tensors.peak
            self.peak_rss_bytes = self._peak - self._base


def memory_numbers(
    model: Any, spec: CacheSpec, cache: Any, pm: PeakMemory, sequences: int = 1
) -> dict[str, Any]:
    """What ``cache`` holds after a run of ``sequences`` rows watched by ``pm``: bytes per token held
    next to fp16 and to the format's theory, and the run's peak."""
    tokens = cache.get_seq_length()
    held = cache_nbytes(cache)
    fp16 = fp16_bytes_per_token(model)  # K + V of one position in fp16: 2 bytes per element
    bits = theoretical_bits(spec, model)
    per_token = held / (tokens * sequences)
    out: dict[str, Any] = {
        "tokens": tokens,
        "bytes": held,
        "bytes_per_token": per_token,
        "fp16_bytes_per_token": fp16,
        "compression_vs_fp16": fp16 / per_token if per_token else float("nan"),
        "effective_bits": 16.0 * per_token / fp16,
        "effective_bits_16bit": 16.0 * cache_nbytes_16bit(cache) / (tokens * sequences) / fp16,
        "theoretical_bits": bits,
        "theoretical_bytes_per_token": None if bits is None else fp16 * bits / 16.0,
        "peak_bytes": pm.peak_bytes,
        "peak_method": pm.method,
        "peak_rss_bytes": pm.peak_rss_bytes,
    }
    if hasattr(cache, "reserved_bytes"):
        out["reserved_bytes"] = int(cache.reserved_bytes())
    if hasattr(cache, "memory_report"):
        rows = cache.memory_report()
        for part in ("store", "tail", "sink"):
            out[f"{part}_bytes"] = sum(r[f"{part}_bytes"] for r in rows)
    return out


def measure_memory(model: Any, spec: CacheSpec, window: torch.Tensor, prefix_len: int) -> dict[str, Any]:
    """Memory of ``spec`` after prefilling ``window[:P]`` and decoding the rest of ``window [P + D]``."""
    cache = spec.build(model)
    with PeakMemory(next(model.parameters()).device) as pm:
        teacher_forced_logprobs(model, window[None], prefix_len, cache)
    return memory_numbers(model, spec, cache, pm)
