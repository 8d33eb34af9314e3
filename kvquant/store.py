"""``TokenStore``: the quantized keys (or values) of one layer, laid out for the decode kernel.

Buffers (``cap`` = capacity in tokens, grown geometrically):

- ``codes``  ``[B, H_kv, cap, D * bits / 8]`` uint8 (int8: ``torch.int8``; fp8: its own dtype;
  ``none``: the model's dtype, ``[B, H_kv, cap, D]``)
- ``scale``  ``[B, H_kv, cap, D / G]`` (token axis) or ``[B, H_kv, cap / G, D]`` (channel axis),
  in the scale dtype; absent for ``none`` and for static scales (then ``static_scale[1, H_kv, 1, 1]``)
- ``zero``   like ``scale``, asymmetric integer formats only.

Every buffer is contiguous along the token axis so that one split-KV program streams one head's
tokens. The store only knows buffer indices; which absolute token positions they hold is the
layer's business.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvquant.formats import QuantizedBlock, dequantize, format_spec, quantize


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class TokenStore:
    """Codes and scales of one of K / V of one layer.

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
        capacity = -(-capacity // self.block) * self.block
        width = head_dim if self.spec.code_dtype is None else self.spec.code_width(head_dim)
        code_dtype = dtype if self.spec.code_dtype is None else self.spec.code_dtype
        self.codes = torch.zeros(batch, heads, capacity, width, dtype=code_dtype, device=device)
        self.scale = self.zero = None
        if self.spec.kind == "passthrough" or self.static_scale is not None:
            if self.static_scale is not None:
                self.static_scale = self.static_scale.to(device)
            return
        rows = capacity // self.block
        cols = head_dim // self.group_size if self.axis == "token" else head_dim
        self.scale = torch.ones(batch, heads, rows, cols, dtype=self.scale_dtype, device=device)
        if self.spec.has_zero:
            self.zero = torch.zeros(batch, heads, rows, cols, dtype=self.scale_dtype, device=device)

    def grow(self, needed: int, used: int) -> None:
        """Make room for ``needed`` tokens, keeping the first ``used``; capacity at least doubles."""
        if needed <= self.capacity:
            return
        old = (self.codes, self.scale, self.zero)
        b, h, _, _ = self.codes.shape
        self.allocate(
            b, h, self.head_dim, max(needed, 2 * self.capacity), self.codes.dtype, self.codes.device
        )
        rows = -(-used // self.block)
        self.codes[:, :, :used].copy_(old[0][:, :, :used])
        if self.scale is not None:
            self.scale[:, :, :rows].copy_(old[1][:, :, :rows])
        if self.zero is not None:
            self.zero[:, :, :rows].copy_(old[2][:, :, :rows])

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    # ------------------------------------------------------------------------------------ data

    def quantize(self, x: torch.Tensor) -> QuantizedBlock:
        """Quantize ``x[B, H, n, D]`` with this store's format (``n`` a multiple of the block)."""
        return quantize(
            x,
            self.fmt,
            group_size=self.group_size,
            axis=self.axis,
            scale_dtype=self.scale_dtype,
            static_scale=None if self.static_scale is None else self.static_scale.flatten(),
        )

    def write(self, index: int, q: QuantizedBlock) -> None:
        """Write a quantized block at buffer index ``index`` (block aligned) in place."""
        n = q.codes.shape[2]
        self.codes[:, :, index : index + n].copy_(q.codes)
        if self.scale is not None:
            r0, r1 = index // self.block, (index + n) // self.block
            self.scale[:, :, r0:r1].copy_(q.scale)
            if self.zero is not None:
                self.zero[:, :, r0:r1].copy_(q.zero)

    def block_at(self, i0: int, i1: int) -> tuple[QuantizedBlock, int]:
        """Views of buffer indices ``[i0, i1)`` widened to whole blocks, and the offset of ``i0`` in them."""
        a = (i0 // self.block) * self.block
        b = -(-i1 // self.block) * self.block
        scale = self.static_scale
        zero = None
        if self.scale is not None:
            scale = self.scale[:, :, a // self.block : b // self.block]
            zero = None if self.zero is None else self.zero[:, :, a // self.block : b // self.block]
        return QuantizedBlock(self.codes[:, :, a:b], scale, zero), i0 - a

    def read(self, i0: int, i1: int, out_dtype: torch.dtype) -> torch.Tensor:
        """Dequantize buffer indices ``[i0, i1)`` -> ``[B, H, i1 - i0, D]``."""
        blk, off = self.block_at(i0, i1)
        x = dequantize(
            blk,
            self.fmt,
            head_dim=self.head_dim,
            group_size=self.group_size,
            axis=self.axis,
            out_dtype=out_dtype,
        )
        return x[:, :, off : off + (i1 - i0)]

    def move(self, src: int, end: int, dst: int) -> None:
        """Move buffer indices ``[src, end)`` to ``dst`` (block aligned, ``dst < src``), in place."""
        n = end - src
        self.codes[:, :, dst : dst + n] = self.codes[:, :, src:end].clone()
        r = self.block
        for t in (self.scale, self.zero):
            if t is not None:
                rows = -(-n // r)
                t[:, :, dst // r : dst // r + rows] = t[:, :, src // r : src // r + rows].clone()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension op (reorder / select / repeat) to every buffer."""
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
