"""What a layer hands the ``kvquant`` attention instead of dequantized tensors: its tiers as operands.

:class:`KVView` lists, for the positions the call attends to before its own tokens, the quantized
tiers as :class:`QuantizedRead` (codes and scales read in place by the decode op) and the
full-precision tokens (sinks, tail, the call's own) as segments, plus the key transform they were
stored with. Nothing in it changes when the layer appends the call's tokens afterwards: quantized
tiers only add rows past a read's end or move into new buffers; a decode step's segments are the
sinks' and the tail's own rows, which that append leaves in place (it writes past the tail's end,
room made before the view is taken, and the sinks are complete), and otherwise they are one copy.

:func:`view_of` builds one from a :class:`~kvquant.cache.layer.QuantizedKVLayer`'s tiers (its
``view``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvquant.cache.store import Operand
from kvquant.kernels import ops
from kvquant.transforms import KeyTransform


class DequantizedKV:
    """``keys`` / ``values`` of a cache layer that stores through ``update``: read-only, each a full
    dequantized read (``read_history``) of every position the next call attends to, None before the
    first update. transformers reads ``layer.keys`` / ``layer.values`` where a layer is written once
    and read at every step without an update (T5 / BART / Whisper cross-attention inside an
    ``EncoderDecoderCache``); ``CacheLayerMixin.__init__`` and ``reset`` assign None."""

    @property
    def keys(self) -> torch.Tensor | None:
        """Dequantized keys ``[B, H, n, D]``."""
        return self.read_history()[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value: None) -> None:
        if value is not None:
            raise AttributeError(
                f"keys: a {type(self).__name__} stores keys through update(), not by assignment"
            )

    @property
    def values(self) -> torch.Tensor | None:
        """Dequantized values ``[B, H, n, D]``."""
        return self.read_history()[1] if self.is_initialized else None

    @values.setter
    def values(self, value: None) -> None:
        if value is not None:
            raise AttributeError(
                f"values: a {type(self).__name__} stores values through update(), not by assignment"
            )


@dataclass(frozen=True)
class QuantizedRead:
    """Positions ``[p0, p1)`` of one quantized tier; buffer index = position - ``origin``.

    ``start [B]`` (int64): each row's first buffer index to attend (its padding and sink slots
    skipped); ``end``: the buffer index past the last.
    """

    k: Operand
    v: Operand
    p0: int
    p1: int
    origin: int
    start: torch.Tensor

    @property
    def end(self) -> int:
        return self.p1 - self.origin

    def dequantized(self, k_dtype: torch.dtype, v_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, p1 - p0, D]`` in the stored (transformed) space."""
        i0, i1 = self.p0 - self.origin, self.p1 - self.origin
        return self.k.read(i0, i1, k_dtype), self.v.read(i0, i1, v_dtype)


@dataclass
class KVView:
    """The history a call attends to, as tiers, and the call's own tokens.

    ``new_k / new_v [B, H, q, D]``: the call's full-precision tokens. ``reads``: the quantized
    tiers, oldest first. ``fp_parts_k / fp_parts_v``: every full-precision token, as segments
    ``[B, H, n_i, D]`` on the token axis: the sinks (``n_sinks`` = s of them, when the history still
    has quantized positions), the tail (t), then the call's own (q); ``fp_k / fp_v
    [B, H, s + t + q, D]`` joins them. ``dense_valid [B, s + t]`` (False: padding, or a sink
    outside the visible history; None: all count). ``sinks_back(x, p0)``: puts the sink values over their slots
    in dequantized positions ``[p0, p0 + n)``. ``plans``: the layer's memo of the decode plan it last
    ran (``ops.plan_decode_attention``: the tiers' buffers described once, reused while they stay).
    """

    new_k: torch.Tensor
    new_v: torch.Tensor
    seq_before: int
    hist_begin: int
    reads: list[QuantizedRead]
    fp_parts_k: tuple[torch.Tensor, ...]
    fp_parts_v: tuple[torch.Tensor, ...]
    n_sinks: int
    dense_valid: torch.Tensor | None
    pads: torch.Tensor  # [B] int64
    transform: KeyTransform
    sinks_back: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    plans: dict = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        b, h, q, d = self.new_k.shape
        return torch.Size((b, h, self.seq_before - self.hist_begin + q, d))

    @property
    def fp_k(self) -> torch.Tensor:
        """The full-precision keys in one tensor ``[B, H, s + t + q, D]``."""
        return ops.join_segments(self.fp_parts_k)

    @property
    def fp_v(self) -> torch.Tensor:
        """The full-precision values in one tensor ``[B, H, s + t + q, D]``."""
        return ops.join_segments(self.fp_parts_v)

    @property
    def dtype(self) -> torch.dtype:
        return self.new_k.dtype

    @property
    def device(self) -> torch.device:
        return self.new_k.device

    def attended(self) -> torch.Tensor:
        """``[B, n]`` bool over positions ``[hist_begin, seq_before + q)``: what the fused decode reads for
        the last query (every position but the row's left padding), to compare with a mask."""
        pos = torch.arange(self.hist_begin, self.seq_before + self.new_k.shape[2], device=self.pads.device)
        return pos[None, :] >= self.pads[:, None]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The history (dequantized where stored) followed by the call's tokens: ``[B, H, n, D]``."""
        dtype = self.new_k.dtype
        parts_k, parts_v = [], []
        if self.reads:
            kdt = self.transform.key_dtype(dtype)
            stored = [r.dequantized(kdt, dtype) for r in self.reads]
            k = torch.cat([s[0] for s in stored], 2)
            v = torch.cat([s[1] for s in stored], 2)
            k, v = self.transform.undo(k, v)
            k, v = self.sinks_back(k.to(dtype), v.to(dtype), self.reads[0].p0)
            parts_k.append(k)
            parts_v.append(v)
        parts_k += self._after_sinks(self.fp_parts_k)  # the tail, then the call's tokens
        parts_v += self._after_sinks(self.fp_parts_v)
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    def _after_sinks(self, parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """``parts`` less their first ``n_sinks`` tokens."""
        out, skip = [], self.n_sinks
        for p in parts:
            out.append(p[:, :, min(skip, p.shape[2]) :])
            skip = max(skip - p.shape[2], 0)
        return out


@functools.lru_cache(maxsize=256)
def _same_start(b: int, index: int, device: torch.device) -> torch.Tensor:
    """``[b]`` int64 filled with ``index``: a read's start when no row is padded (read-only: shared
    by every layer and step that asks for the same value)."""
    return torch.full((b,), index, dtype=torch.long, device=device)


def _one_copy(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``parts`` concatenated on the token axis, a copy of the cache's own buffers; the call's tokens
    (the last part) alone are used as they are."""
    if parts[-1].shape[2] and not any(p.shape[2] for p in parts[:-1]):
        return parts[-1]
    return torch.cat(parts, 2)


def view_of(layer, k: torch.Tensor, v: torch.Tensor) -> KVView:
    """A :class:`KVView` of ``layer``'s history (a :class:`~kvquant.cache.layer.QuantizedKVLayer`)
    before the call's ``k, v [B, H, q, D]`` are appended: its tiers as reads, its sinks, tail and
    ``k, v`` as full-precision segments."""
    begin, store_end = layer.history_begin(), layer.store_end
    sinks = layer.sinks is not None and layer.sinks.held
    n_s = layer.sinks.n if sinks else 0
    first = None if layer.pads_max == 0 else layer.pads + n_s  # [B] first position neither padding nor sink
    reads, lo = [], begin
    for tier in layer.tiers:
        p0, p1 = max(lo, tier.begin), tier.end
        if p1 > p0:
            if first is None:  # no padding: one start for every row, a shared constant tensor
                start = _same_start(layer.pads.shape[0], max(n_s, p0) - tier.origin, layer.device)
            else:
                start = torch.clamp(first, min=p0) - tier.origin  # [B]
            reads.append(QuantizedRead(*tier.operands(), p0, p1, tier.origin, start))
        lo = max(lo, p1)
    with_sinks = sinks and begin < store_end
    # a decode step's own rows stay put through its append (see the module's docstring); otherwise
    # (more tokens, or a sink still being captured) the segments are one copy
    in_place = k.shape[2] == 1 and not (sinks and layer.seq_len < layer.pads_max + layer.sinks.n)
    if in_place:
        layer.tail.make_room(1)
    tail_k, tail_v = layer.tail.read(begin)  # views of the tail's buffer
    fp_k, fp_v = (tail_k, k), (tail_v, v)
    if with_sinks:
        fp_k, fp_v = (layer.sinks.k, *fp_k), (layer.sinks.v, *fp_v)
    if not in_place:
        fp_k, fp_v = (_one_copy(fp_k),), (_one_copy(fp_v),)
    all_valid = layer.pads_max == 0 and begin == 0 and (not with_sinks or layer.sinks.n <= store_end)
    valid = None
    if not all_valid:  # [B, n]: padding, and sinks outside the visible history, do not count
        tail_pos = torch.arange(max(begin, store_end), layer.seq_len, device=layer.device)
        parts = [layer.sinks.valid(begin, store_end, layer.pads)] if with_sinks else []
        valid = torch.cat(parts + [tail_pos[None, :] >= layer.pads[:, None]], 1)
    return KVView(
        new_k=k,
        new_v=v,
        seq_before=layer.seq_len,
        hist_begin=begin,
        reads=reads,
        fp_parts_k=fp_k,  # [B, H, n_i, D] each: s + t + q tokens
        fp_parts_v=fp_v,
        n_sinks=layer.sinks.n if with_sinks else 0,
        dense_valid=valid,
        pads=layer.pads,
        transform=layer.transform,
        # the sinks as they are now: a sliding layer may drop them in this call's append
        sinks_back=functools.partial(
            layer._sinks_back, sinks=(layer.sinks.k, layer.sinks.v) if sinks else None
        ),
        plans=layer.plans,
    )
