"""Per-head Hadamard rotation.

Rotating every head vector by the same orthogonal matrix ``R`` spreads outlier channels over the
whole head before quantization, and leaves attention unchanged: ``(q R) . (k R) = q . k`` and
``softmax(.) (V R) R^T = softmax(.) V``. kvquant uses the normalized Walsh-Hadamard matrix
``R = H_D / sqrt(D)`` (symmetric, so ``R^T = R``), with ``D`` a power of two.

Example:
    >>> x = torch.randn(1, 2, 3, 64)
    >>> torch.allclose(unrotate(rotate(x)), x, atol=1e-5)
    True
"""

from __future__ import annotations

import functools

import torch


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(d: int) -> torch.Tensor:
    if not is_power_of_two(d):
        raise ValueError(f"rotation: Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).float()  # [D, D], orthogonal and symmetric


def hadamard_matrix(
    d: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The normalized ``[D, D]`` Walsh-Hadamard matrix (orthogonal, symmetric)."""
    return _hadamard_cpu(d).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x[..., D] @ R`` in fp32 (returned in ``x``'s dtype)."""
    r = hadamard_matrix(x.shape[-1], x.device)
    return (x.float() @ r).to(x.dtype)


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate` (``R`` is symmetric and orthogonal, so ``R^-1 = R``)."""
    return rotate(x)
