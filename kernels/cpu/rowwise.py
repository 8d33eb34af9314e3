"""The C kernels' row-wise calls, tensor side: the Hadamard rotation (``kvq_rotate``, and
``kvq_rotate_pair`` for a step's keys and values with the key smoothing) and dequantizing a range of
a store (``kvq_dequantize``), each bit for bit its torch reference in :mod:`kvquant.kernels.reference`.

Example:
    >>> x = torch.randn(3, 64)
    >>> torch.equal(rotate_native(x), rotate_ref(x))
    True
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from kvquant.kernels.cpu.binding import cached_operand, work_threads
from kvquant.kernels.cpu.build import library
from kvquant.kernels.hadamard import rotation_block


def rotate_native(x: torch.Tensor) -> torch.Tensor:
    """``x[..., D]`` (CPU, fp32, ``D`` even) rotated by the normalized Hadamard matrix in C:
    a new fp32 tensor, bit for bit :func:`kvquant.kernels.reference.rotate_ref`."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)  # a view where the layout allows (decode: always), else one copy
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < d):
        rows = rows.contiguous()
    n = rows.shape[0]
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)  # [n, D]
    library().kvq_rotate(
        rows.data_ptr(), rows.stride(0), out.data_ptr(), n, d, hadamard_norm(d), work_threads(n)
    )
    return out.view(x.shape)


def rotate_pair_native(k: torch.Tensor, v: torch.Tensor, mean: torch.Tensor | None, std: torch.Tensor | None):
    """``(R ((k - mean) / std), R v)`` in one C call for fp32 CPU ``k, v [B, H, n, D]`` (``mean`` /
    ``std [B, H, 1, D]`` fp32 or None): two views of one new ``[2, B, H, n, D]`` tensor, bit for bit
    the torch ops followed by :func:`rotate_native`."""
    b, h, n, d = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    stats = [None if t is None else t.contiguous() for t in (mean, std)]
    out = torch.empty(2, b, h, n, d, dtype=torch.float32)
    library().kvq_rotate_pair(
        k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3], b, h, n, d,
        *(None if t is None else t.data_ptr() for t in stats), hadamard_norm(d), out.data_ptr(),
    )  # fmt: skip
    return out[0], out[1]


@functools.lru_cache(maxsize=64)
def hadamard_norm(d: int) -> float:
    """The normalization of the Hadamard rotation of ``d`` channels: ``1 / sqrt(block)``."""
    return 1.0 / math.sqrt(rotation_block(d))


def dequantize_native(
    codes, scale, zero, i0: int, i1: int, *, fmt: str, group: int, axis: str, head_dim: int
):
    """Buffer indices ``[i0, i1)`` of a store's buffers dequantized in C -> fp32 ``[B, H, i1 - i0, D]``,
    bit for bit :func:`kvquant.kernels.reference.dequantize_ref`."""
    keep: list = []
    op = cached_operand(codes, scale, zero, fmt, group, axis, keep)
    b, h = codes.shape[:2]
    out = torch.empty(b, h, i1 - i0, head_dim, dtype=torch.float32)
    library().kvq_dequantize(ctypes.byref(op), b, h, i0, i1 - i0, head_dim, out.data_ptr())
    return out
