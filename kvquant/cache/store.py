"""``TokenStore``: the quantized keys (or values) of one segment, laid out for the decode kernel.

Buffers (``cap`` = capacity in tokens, grown geometrically):

- ``codes``  ``[B, H_kv, cap, D * bits / 8]`` uint8 (int8: ``torch.int8``; fp8: its own dtype;
  ``none``: the model's dtype, ``[B, H_kv, cap, D]``)
- ``scale``  ``[B, H_kv, cap, D / G]`` (token axis) or ``[B, H_kv, cap / G, D]`` (channel axis),
  in the scale dtype; absent for ``none`` and for static scales (then ``static_scale[1, H_kv, 1, 1]``)
- ``zero``   like ``scale``, asymmetric integer formats only.

Every buffer is contiguous along the token axis so that one split-KV program streams one head's
tokens. The store only knows buffer indices; which positions they hold is its segment's business.
Rows already written are never rewritten in place: :meth:`TokenStore.move` builds new buffers, so an
:class:`Operand` handed to the attention stays valid while the next tokens are appended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvquant.formats import format_spec
from kvquant.kernels import ops


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(frozen=True)
class Operand:
    """One of K / V of a quantized segment as a kernel reads it: the store's buffers, in place.

    ``codes [B, H_kv, cap, W]``; ``scale`` / ``zero`` as :class:`TokenStore` holds them (a static
    scale is ``[1, H_kv, 1, 1]``; both None for ``none``).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    fmt: str
    group: int
    axis: str
    head_dim: int

    @property
    def block(self) -> int:
        return self.group if self.axis == "channel" else 1

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.codes, self.scale, self.zero

    def read(self, i0: int, i1: int, out_dtype: torch.dtype) -> torch.Tensor:
        """Dequantize buffer indices ``[i0, i1)`` -> ``[B, H, i1 - i0, D]`` in ``out_dtype``."""
        kw = dict(fmt=self.fmt, group=self.group, axis=self.axis, head_dim=self.head_dim)
        return ops.dequantize(self.codes, self.scale, self.zero, i0, i1, **kw).to(out_dtype)


class TokenStore:
    """Codes and scales of one of K / V of one segment.

    Args:
        fmt: format name (see :mod:`kvquant.formats`).
        group_size: channels per scale (token axis) or tokens per block (channel axis).
        axis: ``token`` or ``channel``.
        scale_dtype: dtype of scales and zero points.
        static_scale: optional ``[H_kv]`` per-head scales (int8 / fp8).
    """

    def __init__(
        self,
        fmt: str,
        group_size: int,
        axis: str,
        scale_dtype: torch.dtype,
        static_scale: torch.Tensor | None = None,
    ):
        self.fmt = fmt
        self.spec = format_spec(fmt)
        self.group_size = group_size
        self.axis = axis
        self.scale_dtype = scale_dtype
        self.static_scale = None if static_scale is None else static_scale.to(scale_dtype).view(1, -1, 1, 1)
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.head_dim = 0
        self._operand: Operand | None = None  # operand() of the current buffers (None: to describe)
        self._writer = None  # ops.plan_quantize_append into the current buffers (None: to plan)
        self._transcoder = None  # (source operand, via, ops.plan_transcode from it into these buffers)

    # ------------------------------------------------------------------------------------ layout

    @property
    def block(self) -> int:
        """Tokens that share one row of ``scale`` (G on the channel axis, else 1)."""
        return self.group_size if self.axis == "channel" else 1

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    def allocate(
        self, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device
    ) -> None:
        """Allocate empty buffers for ``capacity`` tokens (rounded up to whole blocks)."""
        self.head_dim = head_dim
        self._operand = self._writer = self._transcoder = None
        capacity = -(-capacity // self.block) * self.block
        width = head_dim if self.spec.code_dtype is None else self.spec.code_width(head_dim)
        code_dtype = dtype if self.spec.code_dtype is None else self.spec.code_dtype
        self.codes = torch.zeros(batch, heads, capacity, width, dtype=code_dtype, device=device)
        self.scale = self.zero = None
        if self.static_scale is not None:
            self.static_scale = self.static_scale.to(device)
        if not self.spec.has_scale or self.static_scale is not None:
            return
        rows = capacity // self.block
        cols = head_dim // self.group_size if self.axis == "token" else head_dim
        self.scale = torch.ones(batch, heads, rows, cols, dtype=self.scale_dtype, device=device)
        if self.spec.has_zero:
            self.zero = torch.zeros(batch, heads, rows, cols, dtype=self.scale_dtype, device=device)

    def _reallocate(self, capacity: int, src: int, used: int) -> None:
        """New buffers of ``capacity`` tokens holding old indices ``[src, used)`` at ``[0, used - src)``."""
        old = (self.codes, self.scale, self.zero)
        b, h, _, _ = self.codes.shape
        self.allocate(b, h, self.head_dim, capacity, self.codes.dtype, self.codes.device)
        n, r = used - src, self.block
        self.codes[:, :, :n].copy_(old[0][:, :, src:used])
        for new, prev in ((self.scale, old[1]), (self.zero, old[2])):
            if new is not None:
                rows = -(-n // r)
                new[:, :, :rows].copy_(prev[:, :, src // r : src // r + rows])

    def grow(self, needed: int, used: int) -> None:
        """Make room for ``needed`` tokens, keeping the first ``used``; capacity at least doubles."""
        if needed > self.capacity:
            self._reallocate(max(needed, 2 * self.capacity), 0, used)

    def move(self, src: int, end: int, capacity: int | None = None) -> None:
        """Keep buffer indices ``[src, end)`` at ``[0, end - src)`` (``src`` block aligned), in new
        buffers of ``capacity`` tokens (default: the current one)."""
        self._reallocate(capacity or self.capacity, src, end)

    def operand(self) -> Operand:
        """The buffers as a kernel reads them: the same object until they change (a grow, a move, a
        batch op), so that a decode plan made for it can be reused step after step."""
        if self._operand is None:
            self._operand = Operand(*self.source(), self.head_dim)
        return self._operand

    def buffers(self) -> tuple[torch.Tensor | None, ...]:
        """Every buffer the store writes or reads: codes, scale, zero point, static scale."""
        return self.codes, self.scale, self.zero, self.static_scale

    def source(self) -> tuple:
        """The buffers as ``ops.transcode`` reads a source: ``(codes, scale, zero, fmt, group, axis)``."""
        scale = self.scale if self.scale is not None else self.static_scale
        return self.codes, scale, self.zero, self.fmt, self.group_size, self.axis

    def dest(self) -> tuple:
        """The buffers as ``ops.transcode`` writes a destination: ``(codes, scale, zero, fmt,
        group_size, axis, static_scale)``."""
        return (*self.source(), self.static_scale is not None)

    # ------------------------------------------------------------------------------------ data

    def write_from(self, index: int, src: Operand, i0: int, i1: int, via: torch.dtype) -> None:
        """Buffer indices ``[i0, i1)`` of another store's operand ``src`` into indices ``[index,
        index + i1 - i0)``: as :meth:`write` of ``src.read(i0, i1, via)``, in one op."""
        if self.codes.is_meta:
            return
        planned = self._transcoder
        if planned is None or planned[0] is not src or planned[1] != via:  # (once per pair of buffers)
            run = ops.plan_transcode(
                (src.codes, src.scale, src.zero, src.fmt, src.group, src.axis),
                self.dest(),
                via=via,
                head_dim=self.head_dim,
            )
            planned = self._transcoder = (src, via, run)
        planned[2](i0, i1, index)

    def write(self, index: int, x: torch.Tensor) -> None:
        """Quantize ``x[B, H, n, D]`` into buffer indices ``[index, index + n)`` (block aligned)."""
        if self.codes.is_meta:  # byte prediction (kvquant.memory): shapes only, nothing to compute
            return
        if self._writer is None:  # planned once per buffers: a decode step pays for the write alone
            codes, scale, zero, fmt, group, axis, static = self.dest()
            self._writer = ops.plan_quantize_append(
                codes, scale, zero, fmt=fmt, group_size=group, head_dim=self.head_dim, axis=axis,
                static_scale=static,
            )  # fmt: skip
        self._writer(x, index)

    def read(self, i0: int, i1: int, out_dtype: torch.dtype) -> torch.Tensor:
        """Dequantize buffer indices ``[i0, i1)`` -> ``[B, H, i1 - i0, D]``."""
        return self.operand().read(i0, i1, out_dtype)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension op (reorder / select / repeat) to every buffer."""
        self._operand = self._writer = self._transcoder = None
        self.codes = fn(self.codes)
        if self.scale is not None:
            self.scale = fn(self.scale)
        if self.zero is not None:
            self.zero = fn(self.zero)

    # ------------------------------------------------------------------------------------ memory

    def nbytes(self, i0: int, i1: int) -> int:
        """Bytes held for buffer indices ``[i0, i1)``: codes, plus the scale / zero rows covering them."""
        if self.codes is None or i1 <= i0:
            return 0
        b, h, _, w = self.codes.shape
        total = b * h * (i1 - i0) * w * self.codes.element_size()
        if self.scale is not None:
            rows = -(-i1 // self.block) - i0 // self.block
            per_row = b * h * self.scale.shape[-1] * self.scale.element_size()
            total += rows * per_row * (2 if self.zero is not None else 1)
        elif self.static_scale is not None:
            total += _nbytes(self.static_scale)
        return total

    def reserved_bytes(self) -> int:
        return sum(_nbytes(t) for t in (self.codes, self.scale, self.zero, self.static_scale))
