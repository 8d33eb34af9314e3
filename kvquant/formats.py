"""The numeric spec of kvquant's KV formats, in plain torch.

This module knows nothing about transformers or Triton: it turns a block of head vectors
``x[B, H, T, D]`` into codes + scales (+ zero points) and back. The Triton kernels in
``kvquant.kernels`` follow exactly this spec and are tested against it.

Formats
-------
``none``      pass-through: the tensor itself, in its own dtype (no scales)
``int8``      symmetric, ``code = round(x / s)`` in ``[-127, 127]``, stored as ``torch.int8``
``int4``      asymmetric, ``code = round((x - m) / s)`` in ``[0, 15]``, two codes per byte
``int2``      asymmetric, ``code = round((x - m) / s)`` in ``[0, 3]``, four codes per byte
``fp8_e4m3``  scaled, ``code = fp8(x / s)`` with ``s = amax / 448``
``fp8_e5m2``  scaled, ``code = fp8(x / s)`` with ``s = amax / 57344``

Scale granularity (``axis``)
---------------------------
``token``    one scale per (token, head, group of ``G`` channels): scales ``[B, H, T, D // G]``.
             ``G == D`` is the default "per-head" scale.
``channel``  keys only (KIVI): one scale per (channel, block of ``G`` tokens): scales
             ``[B, H, T // G, D]``; ``T`` must be a multiple of ``G``.

Packing (planar, kernel friendly): for int4 byte ``j`` of a head vector holds channel ``j`` in
its low nibble and channel ``j + D/2`` in its high nibble; for int2 byte ``j`` holds channels
``j, j + D/4, j + D/2, j + 3D/4`` from the low to the high bit pair. A kernel unpacks a byte row
into contiguous channel slices with one shift and mask each.

Scales and zero points are stored in ``scale_dtype`` (fp16 by default). They are rounded
*outward* when stored (scale up, zero point ``m`` down) and the codes are computed from the stored
values, so every element stays within half a quantization step of its input: no clipping. A zero
range gets scale 1 (an all-zero vector round-trips exactly); a scale the dtype cannot hold, or a
NaN/Inf input, raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMAT_NAMES = ("none", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2")
AXES = ("token", "channel")
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class FormatSpec:
    """What one format is made of.

    ``kind`` is one of ``passthrough``, ``int_sym``, ``int_asym``, ``float``; ``qmax`` is the
    largest code magnitude (integers) or the largest finite value (fp8).
    """

    name: str
    bits: int
    kind: str
    qmax: float
    code_dtype: torch.dtype | None  # None: the input's own dtype (pass-through)

    @property
    def has_zero(self) -> bool:
        return self.kind == "int_asym"

    @property
    def per_byte(self) -> int:
        """Codes per stored byte (1 for 8-bit formats)."""
        return 8 // self.bits if self.bits < 8 else 1

    def code_width(self, head_dim: int) -> int:
        """Stored elements per head vector along the last dim of ``codes``."""
        return head_dim // self.per_byte


_SPECS = {
    "none": FormatSpec("none", 16, "passthrough", float("inf"), None),
    "int8": FormatSpec("int8", 8, "int_sym", 127.0, torch.int8),
    "int4": FormatSpec("int4", 4, "int_asym", 15.0, torch.uint8),
    "int2": FormatSpec("int2", 2, "int_asym", 3.0, torch.uint8),
    "fp8_e4m3": FormatSpec("fp8_e4m3", 8, "float", 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": FormatSpec("fp8_e5m2", 8, "float", 57344.0, torch.float8_e5m2),
}


def format_spec(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of ``name``; ``ValueError`` naming the allowed names otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"format: unknown format {name!r}; allowed: {', '.join(FORMAT_NAMES)}") from None


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


# --------------------------------------------------------------------------------------------- rounding


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype, direction: int) -> torch.Tensor:
    """Cast fp32 ``x`` to ``dtype`` rounding up (``direction=+1``) or down (``-1``), not to nearest.

    Underflow rounds up to the smallest subnormal instead of 0; overflow gives ``inf``.
    """
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    yf = y.float()
    wrong = yf < x if direction > 0 else yf > x
    toward = torch.full_like(y, float("inf") if direction > 0 else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, toward), y)


# --------------------------------------------------------------------------------------------- packing


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., D]`` (uint8, values < 2**bits) into ``[..., D * bits // 8]`` bytes.

    Planar layout: the ``k``-th bit field of byte ``j`` holds channel ``j + k * D * bits // 8``.
    """
    if bits == 8:
        return codes
    per_byte = 8 // bits
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"head_dim: {d} is not a multiple of {per_byte} (needed to pack {bits}-bit codes)")
    parts = codes.view(*codes.shape[:-1], per_byte, d // per_byte)  # [..., per_byte, D/per_byte]
    packed = torch.zeros_like(parts[..., 0, :])
    for k in range(per_byte):
        packed |= parts[..., k, :] << (k * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes ``[..., W]`` -> uint8 codes ``[..., W * 8 // bits]``.

    Works on 32-bit words where the layout allows (one shift and mask unpacks four bytes at once:
    torch's uint8 shifts are not vectorized on CPU), else byte by byte.
    """
    if bits == 8:
        return packed
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    if packed.shape[-1] % 4 == 0 and packed.stride(-1) == 1 and packed.storage_offset() % 4 == 0:
        try:
            words = packed.view(torch.int32)  # [..., W / 4]
        except RuntimeError:
            words = None
        if words is not None:
            word_mask = int.from_bytes(bytes([mask]) * 4, "little")
            parts = [((words >> (k * bits)) & word_mask).view(torch.uint8) for k in range(per_byte)]
            return torch.cat(parts, dim=-1)
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------------------- grouping


def _group_view(x: torch.Tensor, group_size: int, axis: str) -> tuple[torch.Tensor, int]:
    """View ``x[B, H, T, D]`` so that one scale group is one slice along the returned dim."""
    b, h, t, d = x.shape
    if axis == "token":
        if d % group_size:
            raise ValueError(f"group_size: {group_size} does not divide head_dim {d}")
        return x.reshape(b, h, t, d // group_size, group_size), -1  # [B, H, T, D/G, G]
    if axis == "channel":
        if t % group_size:
            raise ValueError(
                f"channel-axis quantization needs T ({t}) to be a multiple of group_size {group_size}"
            )
        return x.reshape(b, h, t // group_size, group_size, d), -2  # [B, H, T/G, G, D]
    raise ValueError(f"axis: unknown axis {axis!r}; allowed: {', '.join(AXES)}")


def is_static_scale(scale: torch.Tensor, axis: str) -> bool:
    """Whether ``scale`` is a static per-head scale ``[1, H, 1, 1]`` rather than a per-token one."""
    return axis == "token" and scale.shape[0] == 1 and scale.shape[2] == 1 and scale.shape[3] == 1


def _ungroup(xg: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return xg.reshape(shape)


def _check_finite(x: torch.Tensor, *stats: torch.Tensor, scale_dtype: torch.dtype) -> None:
    ok = torch.stack([torch.isfinite(s).all() for s in stats]).all()
    if bool(ok):
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError("input: key/value states contain NaN or Inf; refusing to quantize them")
    raise ValueError(
        f"scale_dtype: {scale_dtype} cannot hold the scale/zero point of these values "
        f"(|x| up to {x.abs().max().item():.3g}); use scale_dtype 'float32' or 'bfloat16'"
    )


# --------------------------------------------------------------------------------------------- quantize


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    group_size: int | None = None,
    axis: str = "token",
    scale_dtype: torch.dtype = torch.float16,
    static_scale: torch.Tensor | None = None,
) -> QuantizedBlock:
    """Quantize head vectors ``x[B, H, T, D]`` into ``fmt``.

    Args:
        group_size: channels per scale (token axis) or tokens per block (channel axis); ``None``
            means the whole head (token axis only).
        static_scale: ``[H]`` per-head scales (int8 / fp8 only) used instead of computing them;
            values beyond the representable range are clipped. The returned ``scale`` is then
            ``static_scale`` viewed as ``[1, H, 1, 1]``.

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
    if spec.kind == "passthrough":
        return QuantizedBlock(x, None, None)
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if axis == "channel" and group_size is None:
        raise ValueError("group_size: channel-axis quantization needs a group_size (tokens per block)")
    xf = x.float()

    if static_scale is not None:
        if spec.kind == "int_asym":
            raise ValueError(f"static_scale: only int8 and fp8 formats take static scales, not {fmt}")
        scale = static_scale.to(scale_dtype).view(1, -1, 1, 1)
        _check_finite(x, xf.abs().amax(), scale_dtype=scale_dtype)
        codes = _encode_symmetric(xf, scale.float(), spec)
        return QuantizedBlock(codes, scale, None)

    xg, red = _group_view(xf, g, axis)
    if spec.kind == "int_asym":
        mn = xg.amin(dim=red, keepdim=True)
        mx = xg.amax(dim=red, keepdim=True)
        zero = round_to_dtype(mn, scale_dtype, -1)
        raw = (mx - zero.float()) / spec.qmax
        scale = round_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), scale_dtype, +1)
        _check_finite(x, scale, zero, scale_dtype=scale_dtype)
        q = torch.round((xg - zero.float()) / scale.float()).clamp_(0, spec.qmax).to(torch.uint8)
        codes = pack_codes(_ungroup(q, x.shape), spec.bits)
        return QuantizedBlock(codes, scale.squeeze(red), zero.squeeze(red))

    amax = xg.abs().amax(dim=red, keepdim=True)
    raw = amax / spec.qmax
    scale = round_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), scale_dtype, +1)
    _check_finite(x, scale, scale_dtype=scale_dtype)
    codes = _encode_symmetric(xg, scale.float(), spec)
    return QuantizedBlock(_ungroup(codes, x.shape), scale.squeeze(red), None)


def _encode_symmetric(x: torch.Tensor, scale: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    y = (x / scale).clamp_(-spec.qmax, spec.qmax)
    if spec.kind == "int_sym":
        return torch.round(y).to(torch.int8)
    return y.to(spec.code_dtype)


# --------------------------------------------------------------------------------------------- dequantize


def dequantize(
    block: QuantizedBlock,
    fmt: str,
    *,
    head_dim: int,
    group_size: int | None = None,
    axis: str = "token",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild ``[B, H, T, D]`` from a :class:`QuantizedBlock` (the inverse of :func:`quantize`)."""
    spec = format_spec(fmt)
    if spec.kind == "passthrough":
        return block.codes.to(out_dtype)
    if spec.kind == "int_asym":
        q = unpack_codes(block.codes, spec.bits).float()
    else:
        q = block.codes.float()
    b, h, t, _ = q.shape
    g = head_dim if group_size is None else group_size
    scale = block.scale.float()
    if is_static_scale(scale, axis):  # [1, H, 1, 1]: one scale per head for every token
        scale, g = scale.expand(b, h, t, 1), head_dim
    qg, red = _group_view(q, g, axis)
    x = qg * scale.unsqueeze(red)
    if block.zero is not None:
        x = x + block.zero.float().unsqueeze(red)
    return _ungroup(x, q.shape).to(out_dtype)


def error_bound(
    block: QuantizedBlock, fmt: str, x: torch.Tensor, *, group_size=None, axis="token"
) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` implied by the format, ``[B, H, T, D]``.

    Integers: half a step (``scale / 2``). fp8: half an ulp of the scaled value (relative
    ``2**-(mantissa+1)``, or half the smallest subnormal step near zero), times the scale.
    A small fp32 slack (1e-6 relative) covers the arithmetic of the round trip itself.
    """
    spec = format_spec(fmt)
    if spec.kind == "passthrough":
        return torch.zeros_like(x, dtype=torch.float32)
    d = x.shape[-1]
    g = d if group_size is None else group_size
    scale = block.scale.float()
    if is_static_scale(scale, axis):
        scale, g = scale.expand(x.shape[0], -1, x.shape[2], 1), d
    ones = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    sg, red = _group_view(ones, g, axis)
    s = _ungroup(sg * scale.unsqueeze(red), x.shape)
    xf = x.float()
    slack = 1e-6 * xf.abs() + 1e-30
    if spec.kind in ("int_sym", "int_asym"):
        return s * 0.5 * (1 + 1e-6) + slack
    mant, min_sub = (3, 2.0**-9) if fmt == "fp8_e4m3" else (2, 2.0**-16)
    scaled = xf.abs() / s
    half_ulp = torch.maximum(scaled * 2.0 ** -(mant + 1), torch.full_like(scaled, min_sub / 2))
    return half_ulp * s * (1 + 1e-6) + slack
