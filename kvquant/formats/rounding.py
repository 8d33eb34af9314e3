"""Directed rounding into narrow dtypes: scales rounded up, zero points down, so codes never clip."""

from __future__ import annotations

import torch

_FP8_GRIDS: dict[torch.dtype, torch.Tensor] = {}


def _fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8-bit float dtype, ascending, as fp32 ``[n]``."""
    if dtype not in _FP8_GRIDS:
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        grid = torch.unique(v[torch.isfinite(v)])  # sorted; -0 and +0 merge
        _FP8_GRIDS[dtype] = torch.where(grid == 0, torch.zeros_like(grid), grid)  # as +0
    return _FP8_GRIDS[dtype]


def div_rn(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device. PyTorch on CUDA divides by a Python scalar
    as a multiplication by its reciprocal (one rounding more), which lands one ulp off for some
    inputs (``3 / 7`` gives ``0.42857146``, not ``0.42857143``); a scale rounded up from that can
    be one step too large and differ from the C and Triton kernels (``div_rn``). A tensor divisor
    takes the IEEE division.

    Example:
        >>> div_rn(torch.tensor([3.0]), 7).item()  # the fp32 nearest to 3 / 7
        0.4285714328289032
    """
    return x / torch.full_like(x, divisor)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root of fp32 ``x`` (through fp64, exact for fp32 inputs), on every
    CPU: torch's own fp32 ``sqrt`` goes through the vector math library, which is 1 ulp off for a
    CPU-dependent share of inputs (about 17% on one AVX2 machine, 0.6% on an AVX-512 one), so scales
    built on it would differ between machines and from the C and Triton kernels (``sqrtf`` /
    ``sqrt_rn``, correctly rounded)."""
    return x.double().sqrt().to(x.dtype)


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype, direction: int) -> torch.Tensor:
    """Cast fp32 ``x`` to ``dtype`` rounding up (``direction=+1``) or down (``-1``), not to nearest.

    Underflow rounds up to the smallest subnormal instead of 0; overflow gives ``inf`` (NaN for
    ``float8_e4m3fn``, which holds no infinity, where a plain cast would saturate silently).

    Example:
        >>> round_to_dtype(torch.tensor([1 / 3]), torch.float16, +1).item() > 1 / 3
        True
    """
    if dtype.itemsize == 1:  # 8-bit floats: the nearest grid value on the asked side
        grid = _fp8_grid(dtype).to(x.device)
        xf = x.float().contiguous()
        if direction > 0:
            i = torch.searchsorted(grid, xf)
            out = i >= grid.numel()
        else:
            i = torch.searchsorted(grid, xf, right=True) - 1
            out = i < 0
        y = grid[i.clamp(0, grid.numel() - 1)]
        return torch.where(out | torch.isnan(xf), torch.full_like(y, float("nan")), y).to(dtype)
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    yf = y.float()
    wrong = yf < x if direction > 0 else yf > x
    toward = torch.full_like(y, float("inf") if direction > 0 else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, toward), y)


def round_nearest_positive(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``raw > 0`` to the nearer of its two neighbours in ``dtype``, never down to 0 (overflow
    still NaN / inf): for scales that keep no bound, where rounding up would inflate norms."""
    up, down = round_to_dtype(raw, dtype, +1), round_to_dtype(raw, dtype, -1)
    use_down = (down.float() > 0) & (raw - down.float() < up.float() - raw)
    return torch.where(use_down, down, up)
