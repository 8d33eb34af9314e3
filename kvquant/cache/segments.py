"""The tiers of one cache layer, oldest to newest: sinks, the main store, the recent window, the tail.

A layer holds positions ``[0, seq_len)``; the tiers split them by age::

    [ main store (K/V formats) | recent window (finer formats) | tail (full precision) ]
    sinks: each row's first ``sink_tokens`` real tokens, full precision, beside the rest

New tokens enter the tail; :meth:`push` on a tier appends the newest tokens and returns the oldest it
no longer keeps (``None`` when it keeps them all), which the layer hands to the next older tier. A
quantized tier stores tokens in the key transform's space (see :mod:`kvquant.transforms`), so what
leaves the tail is transformed once, and what leaves the recent window is dequantized in that space
and quantized again in the main formats.

Every tier offers: ``push`` (append, return what ages out), ``read`` (a position range), ``evict_before``,
``crop``, ``map_batch`` (reorder / select / repeat rows), ``nbytes`` / ``reserved_bytes`` and, for the
quantized tiers, :meth:`QuantizedSegment.operands` (what the decode kernel reads, in place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvquant.cache.store import Operand, TokenStore

KV = tuple[torch.Tensor, torch.Tensor]


# the most tokens a window (tail, recent) is allocated for up front; a larger one grows as it fills
UPFRONT_TOKENS = 1024


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(frozen=True)
class Leaving:
    """Tokens aging out of a quantized tier, still in its buffers: indices ``[i0, i1)`` of its K
    and V operands (the buffers as they were: a tier that moves afterwards gets new ones), read in
    ``dtype``. The next quantized tier takes them in one op (:meth:`TokenStore.write_from`)."""

    k: Operand
    v: Operand
    i0: int
    i1: int
    dtype: torch.dtype

    def tensors(self) -> KV:
        """Dequantized ``[B, H, i1 - i0, D]`` each."""
        return self.k.read(self.i0, self.i1, self.dtype), self.v.read(self.i0, self.i1, self.dtype)


class TailSegment:
    """The newest positions ``[begin, end)`` in full precision; keeps ``residual`` of them (and up to
    ``block - 1`` more: tokens leave in whole blocks, ``key_group_size`` on the channel axis, else
    ``quantize_block``).

    The buffer holds them at rows ``[off, off + len)``: a decode step writes its token past the end
    and the oldest leave by advancing ``off`` (handed on as views, consumed within the append); the
    rows move back to 0 only when the buffer is full, once every ``capacity - residual - block`` steps.
    """

    def __init__(self, residual: int, block: int):
        self.residual, self.block = residual, block
        self.begin = self.end = 0
        self.off = 0  # buffer row of position `begin`
        self.k = self.v = None  # [B, H, cap, D]

    def allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        cap = 2 * (min(self.residual, UPFRONT_TOKENS) + self.block) + 8
        self.k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])  # [B, H, cap, D]
        self.v = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
        self.off = 0

    def __len__(self) -> int:
        return self.end - self.begin

    def _reserve(self, n: int, held: int) -> None:
        """Room for ``n`` positions from row ``off`` keeping the ``held`` rows there: they move to row
        0 (into a buffer of ``2 n + 8`` rows when the buffer is not that big: moves stay rare)."""
        cap = self.k.shape[2]
        if self.off + n <= cap:
            return
        o, size = self.off, max(cap, 2 * n + 8)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], size, old.shape[3]) if size > cap else old
            new[:, :, :held] = old[:, :, o : o + held].clone() if new is old else old[:, :, o : o + held]
            setattr(self, name, new)
        self.off = 0

    def make_room(self, n: int) -> None:
        """Room for ``n`` more rows past the end (a move, if one is needed, happens now): the next
        push of up to ``n`` tokens of a decode step then writes past the end and moves nothing."""
        if self.k is not None:
            self._reserve(len(self) + n, len(self))

    def push(self, k: torch.Tensor, v: torch.Tensor) -> KV | None:
        """Append ``k, v [B, H, n, D]``; return the oldest whole blocks beyond ``residual`` (views
        of the buffer or of the input: use them before the next push)."""
        held, n = len(self), k.shape[2]
        total = held + n
        n_out = max(total - self.residual, 0) // self.block * self.block
        o = self.off
        if n_out <= held:  # a decode step: the new tokens go past the end, the oldest leave
            self._reserve(total, held)  # (may move the held rows to row 0)
            o = self.off
            self.k[:, :, o + held : o + total] = k
            self.v[:, :, o + held : o + total] = v
            self.off += n_out
            out = None if n_out == 0 else (self.k[:, :, o : o + n_out], self.v[:, :, o : o + n_out])
        else:  # a prompt: every held token leaves, and the first `lead` new ones pass by
            lead = n_out - held
            out_k = k[:, :, :lead] if not held else torch.cat([self.k[:, :, o : o + held], k[:, :, :lead]], 2)
            out_v = v[:, :, :lead] if not held else torch.cat([self.v[:, :, o : o + held], v[:, :, :lead]], 2)
            out = (out_k, out_v)
            self.off = 0
            self._reserve(n - lead, 0)
            self.k[:, :, : n - lead] = k[:, :, lead:]
            self.v[:, :, : n - lead] = v[:, :, lead:]
        self.end += n
        self.begin += n_out
        return out

    def read(self, p0: int) -> KV:
        """Views of positions ``[max(p0, begin), end)`` (they change with the next push: copy to keep)."""
        i0, i1 = self.off + max(p0 - self.begin, 0), self.off + len(self)
        return self.k[:, :, i0:i1], self.v[:, :, i0:i1]

    def reset(self, begin: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold exactly positions ``[begin, begin + n)`` = ``k, v [B, H, n, D]`` (after a crop)."""
        n = k.shape[2]
        self.off = 0
        self._reserve(n, 0)
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        self.begin, self.end = begin, begin + n

    def crop(self, p: int) -> None:
        self.end = max(min(self.end, p), self.begin)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k, self.v = fn(self.k), fn(self.v)

    def nbytes(self) -> int:
        per_token = self.k[:, :, :1].numel() * self.k.element_size()
        return len(self) * per_token * 2

    def reserved_bytes(self) -> int:
        return _nbytes(self.k) + _nbytes(self.v)


class QuantizedSegment:
    """Positions ``[begin, end)`` quantized into a K and a V :class:`TokenStore`; position ``p`` at
    buffer index ``p - origin``. ``limit``: the most positions kept (the recent window; what
    ``push`` would exceed it by ages out), ``None`` for the main store, which keeps everything."""

    def __init__(self, k_store: TokenStore, v_store: TokenStore, limit: int | None = None):
        self.k_store, self.v_store = k_store, v_store
        self.limit = limit
        self.origin = self.begin = self.end = 0
        self.low = 0  # the recent window's first position (what ages out leaves from here)

    @property
    def stores(self) -> tuple[TokenStore, TokenStore]:
        return self.k_store, self.v_store

    @property
    def block(self) -> int:
        return self.k_store.block

    def allocate(
        self, b: int, h: int, d: int, capacity: int, dtype: torch.dtype, device, d_v: int | None = None
    ) -> None:
        """Empty buffers for ``capacity`` tokens; keys of ``d`` channels, values of ``d_v`` (default
        ``d``: they differ in a latent cache, e.g. DeepSeek's compressed KV and its RoPE part)."""
        for store, dim in zip(self.stores, (d, d if d_v is None else d_v), strict=True):
            store.allocate(b, h, dim, capacity, dtype, device)

    def __len__(self) -> int:
        return self.end - self.begin

    # ------------------------------------------------------------------------------------ append

    def _write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_store.write(index, k)
        self.v_store.write(index, v)

    def _reserve(self, end: int) -> None:
        """Room up to position ``end``: drop evicted positions first (when that frees at least half
        the buffer), else grow."""
        needed, cap = end - self.origin, self.k_store.capacity
        if needed <= cap:
            return
        shift = (self.begin - self.origin) // self.block * self.block
        used = self.end - self.origin
        if shift and needed - shift <= cap and shift >= cap // 2:
            for store in self.stores:
                store.move(shift, used)
            self.origin += shift
            return
        if needed > 2 * cap:  # a long prompt: keep the old capacity as headroom, so that the
            needed += cap  # decode steps right after it do not copy the whole store again
        for store in self.stores:
            store.grow(needed, used)

    def push(self, kv: KV | Leaving) -> KV | Leaving | None:
        """Quantize ``kv = (k, v) [B, H, n, D]`` (stored space; or tokens :class:`Leaving` an
        newer tier) as the newest positions; return the oldest positions beyond ``limit``
        (None for the main store): :class:`Leaving` in a decode step, else dequantized in the
        input's dtype.

        The recent window appends past its end like the main store and only advances ``low`` (its
        first position) as tokens age out: the buffers are rebuilt (the window moved to index 0)
        once they are full, every ``capacity - limit`` tokens, not at every step."""
        if isinstance(kv, Leaving):
            if self.limit is None:  # into the main store: one transcode per K / V, no tensors between
                n = kv.i1 - kv.i0
                self._reserve(self.end + n)
                index = self.end - self.origin
                self.k_store.write_from(index, kv.k, kv.i0, kv.i1, kv.dtype)
                self.v_store.write_from(index, kv.v, kv.i0, kv.i1, kv.dtype)
                self.end += n
                return None
            kv = kv.tensors()
        k, v = kv
        n = k.shape[2]
        if self.limit is None:
            self._reserve(self.end + n)
            self._write(self.end - self.origin, k, v)
            self.end += n
            return None
        held = self.end - self.low
        over = max(held + n - self.limit, 0)
        leave, direct = min(over, held), max(n - self.limit, 0)  # old tokens out; new ones passing by
        out = None
        if leave + direct:
            i0 = self.low - self.origin
            if not direct:  # a decode step: only old tokens leave, read by the next tier in place
                out = Leaving(self.k_store.operand(), self.v_store.operand(), i0, i0 + leave, k.dtype)
            else:
                old = [s.read(i0, i0 + leave, k.dtype) for s in self.stores] if leave else None
                out_k = k[:, :, :direct] if not leave else torch.cat([old[0], k[:, :, :direct]], 2)
                out_v = v[:, :, :direct] if not leave else torch.cat([old[1], v[:, :, :direct]], 2)
                out = (out_k, out_v)
        self.low += leave
        fresh = n - direct
        if direct:  # the whole window aged out: start over at index 0, in new buffers if any were read
            if held:
                for store in self.stores:
                    store.move(0, 0)
            self.origin = self.low = self.end + direct
        elif self.end + n - self.origin > self.k_store.capacity:  # full: the window to index 0
            cap = max(self.k_store.capacity, 2 * min(self.limit, self.end + n - self.low), fresh)
            for store in self.stores:  # new buffers: an operand handed out earlier keeps the old ones
                store.move(self.low - self.origin, self.end - self.origin, cap)
            self.origin = self.low
        if fresh:
            self._write(self.end + direct - self.origin, k[:, :, direct:], v[:, :, direct:])
        self.end += n
        self.begin = max(self.begin, self.low)
        return out

    # ------------------------------------------------------------------------------------ reads

    def read(self, p0: int, p1: int, k_dtype: torch.dtype, v_dtype: torch.dtype) -> KV:
        """Dequantized positions ``[p0, p1)`` in the stored space: ``[B, H, p1 - p0, D]``."""
        i0, i1 = p0 - self.origin, p1 - self.origin
        return self.k_store.read(i0, i1, k_dtype), self.v_store.read(i0, i1, v_dtype)

    def operands(self) -> tuple[Operand, Operand]:
        return self.k_store.operand(), self.v_store.operand()

    # ------------------------------------------------------------------------------------ dropping

    def evict_before(self, p: int) -> None:
        self.begin = max(self.begin, min(p, self.end))

    def crop(self, p: int) -> None:
        """Drop positions ``>= p``."""
        if self.limit is not None and p <= self.low:
            self.origin = self.low = self.begin = self.end = p  # the recent window empties
            return
        self.end = min(self.end, p)
        self.begin = min(self.begin, p)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in self.stores:
            store.map_batch(fn)

    # ------------------------------------------------------------------------------------ bytes

    def nbytes(self) -> int:
        i0, i1 = self.begin - self.origin, self.end - self.origin
        return sum(store.nbytes(i0, i1) for store in self.stores)

    def reserved_bytes(self) -> int:
        return sum(store.reserved_bytes() for store in self.stores)


class SinkSegment:
    """Each row's first ``n`` real tokens (after its left padding) in full precision.

    They also keep their (unused) slots in the other tiers, so all rows stay on one time axis; reads
    put the sink values back over those slots. ``pads [B]`` (left padding per row) comes from the layer.
    """

    def __init__(self, n: int):
        self.n = n
        self.k = self.v = None  # [B, H, S, D]; None once every sink left a sliding window

    def allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h = k.shape[:2]
        self.k = k.new_zeros(b, h, self.n, k.shape[3])  # [B, H, S, D]
        self.v = v.new_zeros(b, h, self.n, v.shape[3])

    @property
    def held(self) -> bool:
        return self.k is not None

    def capture(self, k: torch.Tensor, v: torch.Tensor, t0: int, pads: torch.Tensor, pads_max: int) -> None:
        """Copy the sink tokens of each row found among positions ``[t0, t0 + n)`` of ``k, v``."""
        if self.k is None or t0 >= pads_max + self.n:
            return
        n = k.shape[2]
        if pads_max == 0:  # no padding: sink slot s is position s, a plain slice copy
            end = min(self.n, t0 + n)
            if end > t0:
                self.k[:, :, t0:end].copy_(k[:, :, : end - t0])
                self.v[:, :, t0:end].copy_(v[:, :, : end - t0])
            return
        rel = pads[:, None] + torch.arange(self.n, device=k.device) - t0  # [B, S]
        valid = ((rel >= 0) & (rel < n))[:, None, :, None]
        idx = rel.clamp(0, n - 1)[:, None, :, None]
        for sink, new in ((self.k, k), (self.v, v)):
            got = new.gather(2, idx.expand(-1, new.shape[1], -1, new.shape[3]))
            sink.copy_(torch.where(valid, got, sink))

    def apply(self, x: torch.Tensor, t0: int, sink: torch.Tensor, pads: torch.Tensor, pads_max: int):
        """Put ``sink`` (``self.k`` or ``self.v``) over its positions in ``x[B, H, n, D]`` (positions
        ``[t0, t0 + n)``); returns ``x`` (written in place)."""
        if t0 >= pads_max + self.n or x.shape[2] == 0:
            return x
        m = min(x.shape[2], pads_max + self.n - t0)
        slot = torch.arange(m, device=x.device) + t0 - pads[:, None]  # [B, m]
        is_sink = ((slot >= 0) & (slot < self.n))[:, None, :, None]
        got = sink.gather(
            2, slot.clamp(0, self.n - 1)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
        )
        x[:, :, :m] = torch.where(is_sink, got, x[:, :, :m])
        return x

    def valid(self, p0: int, p1: int, pads: torch.Tensor) -> torch.Tensor:
        """``[B, S]``: which sink tokens lie in positions ``[p0, p1)``."""
        pos = pads[:, None] + torch.arange(self.n, device=pads.device)  # [B, S]
        return (pos >= p0) & (pos < p1)

    def drop(self) -> None:
        self.k = self.v = None

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.k is not None:
            self.k, self.v = fn(self.k), fn(self.v)

    def nbytes(self, seq_len: int, pads: torch.Tensor, pads_max: int) -> int:
        """Bytes of the sink tokens seen so far (``min(seq_len - pad, n)`` per row, K and V)."""
        if self.k is None:
            return 0
        b = pads.shape[0]
        if pads_max == 0:  # no padding: no device read (also what keeps byte prediction on meta)
            held = b * min(seq_len, self.n)
        else:
            held = int((seq_len - pads).clamp(0, self.n).sum().item())
        return held * self.k.shape[1] * self.k.shape[3] * self.k.element_size() * 2

    def reserved_bytes(self) -> int:
        return _nbytes(self.k) + _nbytes(self.v)
