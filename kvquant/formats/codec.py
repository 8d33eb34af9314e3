"""``quantize`` / ``dequantize`` / ``error_bound``: head vectors ``x[B, H, T, D]`` to codes + scales
(+ zero points) and back, for any format of the registry (the format object does the work)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.formats.packing import pack_codes
from kvquant.formats.registry import format_spec
from kvquant.formats.spec import Encoder, check_finite, group_view


@dataclass
class QuantizedBlock:
    """Codes and scales of a block of head vectors, as :func:`quantize` returns them.

    codes: ``[B, H, T, code_width]``; scale / zero: ``[B, H, T, D // G]`` (token axis) or
    ``[B, H, T // G, D]`` (channel axis); ``zero`` is None for symmetric / float formats, both are
    None for ``none``.
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None


def is_static_scale(scale: torch.Tensor, axis: str) -> bool:
    """Whether ``scale`` is a static per-head scale ``[1, H, 1, 1]`` rather than a per-token one."""
    return axis == "token" and scale.shape[0] == 1 and scale.shape[2] == 1 and scale.shape[3] == 1


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    group_size: int | None = None,
    axis: str = "token",
    scale_dtype: torch.dtype = torch.float16,
    static_scale: torch.Tensor | None = None,
    encoder: Encoder | None = None,
) -> QuantizedBlock:
    """Quantize head vectors ``x[B, H, T, D]`` into ``fmt``.

    Args:
        group_size: channels per scale (token axis) or tokens per block (channel axis); ``None``
            means the whole head (token axis only).
        static_scale: ``[H]`` per-head scales (int8 / fp8 only) used instead of computing them;
            values beyond the representable range are clipped. The returned ``scale`` is then
            ``static_scale`` viewed as ``[1, H, 1, 1]``.
        encoder: ``encoder(y[N, D], bits) -> codes[N, D]`` (uint8), the search of a trellis code
            for ``y`` in units of the scale (default: the torch search; the kernels pass the C one,
            which gives the same codes). Other formats ignore it.

    Example:
        >>> x = torch.randn(1, 2, 5, 64)
        >>> q = quantize(x, "int4")
        >>> q.codes.shape, q.scale.shape
        (torch.Size([1, 2, 5, 32]), torch.Size([1, 2, 5, 1]))
        >>> (dequantize(q, "int4", head_dim=64) - x).abs().max() <= q.scale.float().max() / 2 + 1e-6
        tensor(True)
    """
    spec = format_spec(fmt)
    if x.dim() != 4:
        raise ValueError(f"x: expected [B, H, T, D], got shape {tuple(x.shape)}")
    if not spec.has_scale:
        return QuantizedBlock(x, None, None)
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if axis == "channel" and group_size is None:
        raise ValueError("group_size: channel-axis quantization needs a group_size (tokens per block)")
    xf = x.float()

    if static_scale is not None:
        if not spec.takes_static_scale:
            raise ValueError(f"static_scale: only int8 and fp8 formats take static scales, not {fmt}")
        scale = static_scale.to(scale_dtype).view(1, -1, 1, 1)
        check_finite(x, xf.abs().amax(), scale_dtype=scale_dtype)
        return QuantizedBlock(spec.encode_units(xf / scale.float()), scale, None)

    if spec.token_axis_only and axis != "token":
        raise ValueError(f"axis: {spec.kind} format {fmt} takes scales along the token axis only")
    xg, red = group_view(xf, g, axis)
    q, scale, zero = spec.encode_groups(x, xg, red, scale_dtype, encoder)
    codes = q.reshape(x.shape)  # [B, H, T, D] one code per element
    if spec.packed:
        codes = pack_codes(codes, spec.bits)
    return QuantizedBlock(codes, scale.squeeze(red), None if zero is None else zero.squeeze(red))


def dequantize(
    block: QuantizedBlock,
    fmt: str,
    *,
    head_dim: int,
    group_size: int | None = None,
    axis: str = "token",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild ``[B, H, T, D]`` from a :class:`QuantizedBlock` (the inverse of :func:`quantize`).

    Example:
        >>> x = torch.randn(1, 1, 3, 64)
        >>> dequantize(quantize(x, "int8"), "int8", head_dim=64).shape
        torch.Size([1, 1, 3, 64])
    """
    spec = format_spec(fmt)
    if not spec.has_scale:
        return block.codes.to(out_dtype)
    q = spec.decode_codes(block.codes)  # [B, H, T, D] fp32, before scaling
    b, h, t, _ = q.shape
    g = head_dim if group_size is None else group_size
    scale = block.scale.float()
    if is_static_scale(scale, axis):  # [1, H, 1, 1]: one scale per head for every token
        scale, g = scale.expand(b, h, t, 1), head_dim
    qg, red = group_view(q, g, axis)
    x = qg * scale.unsqueeze(red)
    if block.zero is not None:
        x = x + block.zero.float().unsqueeze(red)
    return x.reshape(q.shape).to(out_dtype)


def error_bound(
    block: QuantizedBlock, fmt: str, x: torch.Tensor, *, group_size=None, axis="token"
) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` implied by the format, ``[B, H, T, D]``.

    Integers: half a step (``scale / 2``). Codebooks: half the widest gap between levels, or the
    distance beyond the outermost level, times the scale. fp8: half an ulp of the scaled value (relative
    ``2**-(mantissa+1)``, or half the smallest subnormal step near zero), times the scale.
    A small fp32 slack (1e-6 relative) covers the arithmetic of the round trip itself. Trellis codes
    have none (``ValueError``): they trade errors between channels for the least total error.

    Example:
        >>> x = torch.randn(1, 1, 3, 64)
        >>> q = quantize(x, "int4")
        >>> bool(((dequantize(q, "int4", head_dim=64) - x).abs() <= error_bound(q, "int4", x)).all())
        True
    """
    spec = format_spec(fmt)
    if not spec.has_scale:
        return torch.zeros_like(x, dtype=torch.float32)
    spec.check_bounded()
    d = x.shape[-1]
    g = d if group_size is None else group_size
    scale = block.scale.float()
    if is_static_scale(scale, axis):
        scale, g = scale.expand(x.shape[0], -1, x.shape[2], 1), d
    ones = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    sg, red = group_view(ones, g, axis)
    s = (sg * scale.unsqueeze(red)).reshape(x.shape)  # [B, H, T, D] the scale of each element
    return spec.element_bound(x.float(), s)
