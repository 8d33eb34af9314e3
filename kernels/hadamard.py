"""The Hadamard rotation's spec in plain torch: the block a head of ``d`` channels rotates in, the
matrix, and the fast transform every backend's ``rotate`` equals (:mod:`kvquant.kernels.reference`
serves it as the reference backend's op).

Example:
    >>> x = torch.randn(2, 64)
    >>> torch.allclose(rotate_ref(x), x @ hadamard_matrix(64), atol=1e-5)
    True
"""

from __future__ import annotations

import math

import torch


def rotation_block(d: int) -> int:
    """The Hadamard block of a head of ``d`` channels: the largest power of two dividing ``d`` (``d``
    itself when it is one; 32 for 96, 16 for 80 and 112). The rotation is block-diagonal in it."""
    return d & -d


def hadamard_matrix(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized ``[D, D]`` fp32 Walsh-Hadamard matrix (orthogonal, symmetric), block-diagonal
    in blocks of ``n = rotation_block(D)``: ``H[i, j] = (-1) ** popcount(i & j) / sqrt(n)`` where
    ``i // n == j // n``, else 0."""
    n = rotation_block(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h] * (d // n)) if d > n else h
    return (h / math.sqrt(n)).to(device=device, dtype=torch.float32)  # [D, D]


def rotate_ref(x: torch.Tensor) -> torch.Tensor:
    """``x[..., D] @ hadamard_matrix(D)`` for fp32 ``x``, as the fast Walsh-Hadamard transform:
    ``log2(n)`` passes (``n = rotation_block(D)``) that turn each pair ``(a, b)`` of channels ``h``
    apart into ``(a + b, a - b)``, ``h = 1, 2, ..., n / 2``, then one product by ``1 / sqrt(n)``
    (rounded to fp32). A new tensor, the shape of ``x``."""
    if x.is_meta:  # (kvquant.memory's byte counts run a layer on meta tensors: the shape is all)
        return torch.empty_like(x)
    d = x.shape[-1]
    n = rotation_block(d)
    y = x.reshape(-1, d)
    h = 1
    while h < n:
        y = y.view(-1, d // (2 * h), 2, h)  # [N, D/2h, 2, h]: the butterfly pairs of this pass
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).view(x.shape)
