"""Bit packing of integer codes, planar (kernel friendly): one shift and mask per channel slice.

For 4-bit codes byte ``j`` of a head vector holds channel ``j`` in its low nibble and channel
``j + D/2`` in its high nibble; for 2-bit codes byte ``j`` holds channels ``j, j + D/4, j + D/2,
j + 3D/4`` from the low to the high bit pair. 3-bit codes are two planes: the low two bits packed
like 2-bit codes (``D/4`` bytes), then the high bit packed eight per byte (``D/8`` bytes).
"""

from __future__ import annotations

import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., D]`` (uint8, values < 2**bits) into ``[..., D * bits // 8]`` bytes.

    Planar layout: the ``k``-th bit field of byte ``j`` holds channel ``j + k * D * bits // 8``.

    Example:
        >>> pack_codes(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8), 4).tolist()
        [[49, 66]]
    """
    if bits == 8:
        return codes
    if bits == 3:  # two planes: low bit pairs like int2, then the high bits eight per byte
        return torch.cat([pack_codes(codes & 3, 2), pack_codes(codes >> 2, 1)], dim=-1)
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
    if bits == 3:
        w = packed.shape[-1] // 3  # D / 8
        return unpack_codes(packed[..., : 2 * w], 2) | (unpack_codes(packed[..., 2 * w :], 1) << 2)
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
