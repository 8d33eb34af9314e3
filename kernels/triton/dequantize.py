"""Read a store's rows back to fp32 on the GPU: ``dequantize``, the twin of
:func:`kvquant.kernels.reference.dequantize_ref`.

``dequantize_kernel``, grid ``(B * H, cdiv(n, BT))``: program ``(bh, i)`` loads the code values of
``BT`` tokens with the decode kernel's reader (``load_levels``: integers, fp8, codebook and trellis
tables), multiplies by the scales (per token and channel group, per channel over token blocks, or
one static scale per head) and adds the zero points, as :func:`kvquant.formats.dequantize` does: two
fp32 roundings (built without FMA contraction), so the rows are the same bit for bit. What a
tier's oldest tokens cost when they age into the next (``ops.transcode``: this kernel, then the
quantize kernel), in one launch where the torch reference takes a handful of ops.

Example:
    >>> rows = dequantize(codes, scale, zero, 3, 7, fmt="int4", group=64, axis="token", head_dim=64)
    >>> rows.shape                                              # codes [B, H, cap, 32] -> [B, H, 4, 64]
    torch.Size([1, 2, 4, 64])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvquant.formats import format_spec, is_static_scale
from kvquant.kernels.triton._common import as_bytes, level_table
from kvquant.kernels.triton.decode_tiles import load_levels, load_scale


@triton.jit
def dequantize_kernel(p_c, p_lut, p_s, p_z, p_out, i0, n, H, stride_cb, stride_ch, stride_ct, stride_cw,
                      stride_sb, stride_sh, stride_sr, stride_sg, stride_zb, stride_zh, stride_zr, stride_zg,
                      stride_ob, stride_oh, stride_ot, stride_od, D: tl.constexpr, BT: tl.constexpr,
                      BITS: tl.constexpr, FP8: tl.constexpr, LUT: tl.constexpr, M: tl.constexpr,
                      G: tl.constexpr, CHANNEL: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr,
                      SFP8: tl.constexpr):  # fmt: skip
    i_bh, i_t = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    o_n = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # [BT] rows of the output
    m_n = o_n < n
    o_t = i0 + o_n  # buffer indices
    o_d = tl.arange(0, D)
    p_c = p_c + i_b * stride_cb + i_h * stride_ch
    b_x = load_levels(p_c, p_lut, o_t, m_n, stride_ct, stride_cw, BT, D, BITS, FP8, LUT, M)  # [BT, D]
    b_x = b_x.to(tl.float32)
    if SCALE:
        if CHANNEL:  # one scale row per G tokens
            o_r = (o_t // G)[:, None] * stride_sr + o_d[None, :] * stride_sg
            o_rz = (o_t // G)[:, None] * stride_zr + o_d[None, :] * stride_zg
        else:  # per token, one scale per G channels (a static scale: strides 0)
            o_r = o_t[:, None] * stride_sr + (o_d // G)[None, :] * stride_sg
            o_rz = o_t[:, None] * stride_zr + (o_d // G)[None, :] * stride_zg
        b_x = b_x * load_scale(p_s + i_b * stride_sb + i_h * stride_sh + o_r, m_n[:, None], SFP8)
        if ZERO:
            b_x = b_x + load_scale(p_z + i_b * stride_zb + i_h * stride_zh + o_rz, m_n[:, None], SFP8)
    p_o = p_out + i_b * stride_ob + i_h * stride_oh + o_n[:, None] * stride_ot + o_d[None, :] * stride_od
    tl.store(p_o, b_x, mask=m_n[:, None])


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    i0: int,
    i1: int,
    *,
    fmt: str,
    group: int,
    axis: str,
    head_dim: int,
) -> torch.Tensor:
    """Buffer indices ``[i0, i1)`` of a store's buffers (``codes [B, H, cap, W]``; scales per token
    ``[B, H, cap, D / G]``, per channel ``[B, H, cap / G, D]`` or static ``[1, H, 1, 1]``) as fp32
    ``[B, H, i1 - i0, D]``: the values of :func:`kvquant.formats.dequantize` bit for bit (Triton;
    ``D`` a power of two >= 16, a format with a Triton reader)."""
    spec = format_spec(fmt)
    read = spec.triton_read()
    if read is None or not spec.has_scale:
        raise ValueError(f"fmt: the Triton dequantize kernel does not read {fmt}")
    b, h, _, _ = codes.shape
    n, d = i1 - i0, head_dim
    out = torch.empty(b, h, max(n, 0), d, dtype=torch.float32, device=codes.device)
    if n <= 0 or b * h == 0:
        return out
    g = group if axis == "channel" else min(group, d)
    if axis == "token" and is_static_scale(scale, axis):  # [1, H, 1, 1] -> stride-0 view [B, H, cap, 1]
        scale, g = scale.expand(b, h, codes.shape[2], 1), d
    s, z = as_bytes(scale), as_bytes(zero)
    bt = max(1, min(triton.next_power_of_2(n), 4096 // d))
    dequantize_kernel[(b * h, triton.cdiv(n, bt))](
        as_bytes(codes), level_table(read, codes), s, z if z is not None else s, out, i0, n, h,
        *codes.stride(), *s.stride(), *(z if z is not None else s).stride(), *out.stride(),
        D=d, BT=bt, BITS=read.bits, FP8=read.fp8, LUT=read.lut, M=read.state_codes, G=g,
        CHANNEL=axis == "channel", SCALE=True, ZERO=z is not None,
        SFP8=scale.dtype == torch.float8_e4m3fn, enable_fp_fusion=False,
    )  # fmt: skip
    return out
