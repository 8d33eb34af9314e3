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

import torch

from kvquant.cache.store import Operand, TokenStore

KV = tuple[torch.Tensor, torch.Tensor]


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class TailSegment:
    """The newest positions ``[begin, end)`` in full precision; keeps ``residual`` of them (and up to
    ``block - 1`` more: the channel axis quantizes whole blocks of ``block`` tokens)."""

    def __init__(self, residual: int, block: int):
        self.residual, self.block = residual, block
        self.begin = self.end = 0
        self.k = self.v = None  # [B, H, cap, D]

    def allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        cap = self.residual + self.block + 1
        self.k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])  # [B, H, cap, D]
        self.v = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])

    def __len__(self) -> int:
        return self.end - self.begin

    def _reserve(self, n: int) -> None:
        if n > self.k.shape[2]:
            grow = max(n, 2 * self.k.shape[2])
            held = len(self)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], grow, old.shape[3])
                new[:, :, :held] = old[:, :, :held]
                setattr(self, name, new)

    def push(self, k: torch.Tensor, v: torch.Tensor) -> KV | None:
        """Append ``k, v [B, H, n, D]``; return the oldest whole blocks beyond ``residual``."""
        held, n = len(self), k.shape[2]
        total = held + n
        n_out = max(total - self.residual, 0) // self.block * self.block
        self.end += n
        if n_out == 0:
            self._reserve(total)
            self.k[:, :, held:total] = k
            self.v[:, :, held:total] = v
            return None
        if held:
            k = torch.cat([self.k[:, :, :held], k], dim=2)
            v = torch.cat([self.v[:, :, :held], v], dim=2)
        rest = total - n_out
        self._reserve(rest)
        self.k[:, :, :rest] = k[:, :, n_out:]
        self.v[:, :, :rest] = v[:, :, n_out:]
        self.begin += n_out
        return k[:, :, :n_out], v[:, :, :n_out]

    def read(self, p0: int) -> KV:
        """Views of positions ``[max(p0, begin), end)`` (they change with the next push: copy to keep)."""
        i0 = max(p0 - self.begin, 0)
        return self.k[:, :, i0 : len(self)], self.v[:, :, i0 : len(self)]

    def reset(self, begin: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold exactly positions ``[begin, begin + n)`` = ``k, v [B, H, n, D]`` (after a crop)."""
        n = k.shape[2]
        self._reserve(n)
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

    @property
    def stores(self) -> tuple[TokenStore, TokenStore]:
        return self.k_store, self.v_store

    @property
    def block(self) -> int:
        return self.k_store.block

    def allocate(self, b: int, h: int, d: int, capacity: int, dtype: torch.dtype, device) -> None:
        for store in self.stores:
            store.allocate(b, h, d, capacity, dtype, device)

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
        for store in self.stores:
            store.grow(needed, used)

    def push(self, k: torch.Tensor, v: torch.Tensor) -> KV | None:
        """Quantize ``k, v [B, H, n, D]`` (stored space) as the newest positions; return, dequantized
        in the input's dtype, the oldest positions beyond ``limit`` (None for the main store)."""
        n = k.shape[2]
        if self.limit is None:
            self._reserve(self.end + n)
            self._write(self.end - self.origin, k, v)
            self.end += n
            return None
        held = self.end - self.origin
        over = max(held + n - self.limit, 0)
        leave, direct = min(over, held), max(n - self.limit, 0)  # old tokens out; new ones passing by
        out = None
        if leave + direct:
            old = [s.read(0, leave, k.dtype) for s in self.stores] if leave else None
            out_k = k[:, :, :direct] if not leave else torch.cat([old[0], k[:, :, :direct]], 2)
            out_v = v[:, :, :direct] if not leave else torch.cat([old[1], v[:, :, :direct]], 2)
            out = (out_k, out_v)
        kept, fresh = held - leave, n - direct
        if leave:  # new buffers: an operand handed out earlier keeps reading the old ones
            for store in self.stores:
                store.move(leave, held, max(store.capacity, kept + fresh))
        else:
            for store in self.stores:
                store.grow(kept + fresh, kept)
        if fresh:
            self._write(kept, k[:, :, n - fresh :], v[:, :, n - fresh :])
        self.origin += leave + direct
        self.end += n
        self.begin = max(self.begin, self.origin)
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
        if self.limit is not None and p <= self.origin:
            self.origin = self.begin = self.end = p  # the recent window empties
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
