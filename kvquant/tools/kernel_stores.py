"""Quantized K/V stores for the GPU kernel benchmarks (``bench_kernels``, ``sweep_kernels``).

A store is quantized from the first :data:`QUANTIZE_TOKENS` tokens of ``x`` and tiled along the
tokens up to its length: the time of a decode step does not depend on the values, and quantizing
32k tokens of every format (trellis searches included) would cost more than the timing.
"""

from __future__ import annotations

import torch

QUANTIZE_TOKENS = 4096  # tokens quantized per store; the rest of the context repeats them


def nbytes(*ts: torch.Tensor | None) -> int:
    """Bytes held by the tensors given (``None`` counts 0)."""
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def tiled_store(x: torch.Tensor, fmt: str, group: int, axis: str, scale_dtype=torch.float16):
    """Quantize ``x[B, H, T, D]`` into TokenStore buffers (``kernels.ops``); returns (codes, scale, zero).

    The first :data:`QUANTIZE_TOKENS` tokens are quantized and tiled up to ``T`` (see the module
    docstring).

    Example:
        >>> codes, scale, zero = tiled_store(torch.randn(1, 2, 5000, 64), "int4", 64, "token")
        >>> codes.shape, scale.shape
        (torch.Size([1, 2, 5000, 32]), torch.Size([1, 2, 5000, 1]))
    """
    from kvquant.cache.store import TokenStore

    b, h, t, d = x.shape
    n = min(t, QUANTIZE_TOKENS)
    s = TokenStore(fmt, group, axis, scale_dtype)
    n -= n % s.block
    s.allocate(b, h, d, n, x.dtype, x.device)
    s.write(0, x[:, :, :n])
    reps = -(-t // n)

    def tile(buf, src, rows):  # [B, H, src, W] -> [B, H, rows, W]
        return None if buf is None else buf[:, :, :src].repeat(1, 1, reps, 1)[:, :, :rows].contiguous()

    # codes: one row per token; scales / zero points: one row per token (token axis) or per block of
    # `s.block` tokens (channel axis)
    rows = -(-t // s.block)
    codes = tile(s.codes, n, t)
    return codes, tile(s.scale, n // s.block, rows), tile(s.zero, n // s.block, rows)
