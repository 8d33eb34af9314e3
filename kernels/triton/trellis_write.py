"""Quantize-and-append of trellis codes on the GPU: ``trellis_append``, the twin of
:meth:`kvquant.formats.families.Trellis.encode_groups` plus the store's write.

Three steps, none of them a host sync:

1. ``trellis_search_units_kernel``, one program per head vector (``(b, h, t)``): each group's RMS,
   rounded up to the scale dtype (1 for an all-zero group), and the vector in units of it
   ``y = x / search`` (``[N, D]`` fp32 scratch);
2. the Viterbi search of ``y`` (:func:`kvquant.kernels.triton.trellis.trellis_encode_triton`): codes
   ``[N, D]``;
3. ``trellis_store_kernel``, one program per head vector: the levels of the path (each channel's
   state from its code and the ``m - 1`` before it, circularly, looked up in the table), each group's
   scale stretched so the dequantized group keeps the input's norm (to the nearer neighbour in the
   scale dtype, never down to 0; 0 for an all-zero group), the codes packed planar into the store at
   buffer index ``index`` and the scales stored.

Both kernels raise the device's deferred-error flag in place (2: non-finite input, 1: a scale the
dtype cannot hold), as the quantize kernel does. Divisions are ``div_rn``, square roots ``sqrt_rn``,
built without FMA contraction; the group sums run in another order than torch's, so a scale may
differ in the last bit before it is rounded to the scale dtype (which absorbs it in the tests: codes
and scales bit for bit there; otherwise the same search on a last-bit different ``y``).

Example:
    >>> trellis_append(x, codes, scale, 12, fmt="tcq2", group=64, flag=flag)   # x [B, H, n, D] on CUDA
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvquant.formats import format_spec
from kvquant.formats.trellis import check_channels, trellis_table
from kvquant.kernels.triton._common import (
    SCALE_KIND,
    as_bytes,
    e4m3_bits,
    is_pow2,
    nonfinite,
    round_to_scale_dtype,
    store_codes,
)
from kvquant.kernels.triton.trellis import trellis_encode_triton


@triton.jit
def _row(r, n, H, p_x, stride_xb, stride_xh, stride_xt, stride_xd, D: tl.constexpr, G: tl.constexpr):
    """Head vector ``r`` of ``x[B, H, n, D]`` as fp32 groups ``[D / G, G]`` (and its b, h, t)."""
    i_b, i_h, i_t = r // (H * n), (r // n) % H, r % n
    o_d = tl.arange(0, D)
    p = p_x + i_b * stride_xb + i_h * stride_xh + i_t * stride_xt + o_d * stride_xd
    return tl.reshape(tl.load(p).to(tl.float32), (D // G, G)), i_b, i_h, i_t


@triton.jit
def _search(b_xg, G: tl.constexpr, SCALE_KIND: tl.constexpr):
    """Each group's RMS rounded up to the scale dtype (1 where it is 0): ``[D / G, 1]``."""
    b_rms = tl.sqrt_rn(tl.div_rn(tl.sum(b_xg * b_xg, axis=1), G))[:, None]
    return round_to_scale_dtype(tl.where(b_rms == 0.0, 1.0, b_rms), SCALE_KIND, True)


@triton.jit
def trellis_search_units_kernel(p_x, p_y, p_flag, n, H, stride_xb, stride_xh, stride_xt, stride_xd, stride_yn,
                                D: tl.constexpr, G: tl.constexpr, SCALE_KIND: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    b_xg, _, _, _ = _row(r, n, H, p_x, stride_xb, stride_xh, stride_xt, stride_xd, D, G)
    b_s = _search(b_xg, G, SCALE_KIND)
    b_y = tl.div_rn(b_xg, b_s)
    b_y = tl.where(nonfinite(b_y) != 0, 0.0, b_y)  # (the flag reports it; the search runs on numbers)
    tl.store(p_y + r * stride_yn + tl.arange(0, D), tl.reshape(b_y, (D,)))
    code = tl.maximum(tl.max(nonfinite(b_xg)) * 2, tl.max(nonfinite(b_s)))
    tl.atomic_max(p_flag, code, mask=code > 0)


@triton.jit
def trellis_store_kernel(p_x, p_q, p_tab, p_codes, p_scale, p_flag, index, n, H, stride_xb, stride_xh, stride_xt,
                         stride_xd, stride_qn, stride_cb, stride_ch, stride_ct, stride_cw, stride_sb, stride_sh,
                         stride_st, stride_sg, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                         M: tl.constexpr, SCALE_KIND: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    b_xg, i_b, i_h, i_t = _row(r, n, H, p_x, stride_xb, stride_xh, stride_xt, stride_xd, D, G)
    NG: tl.constexpr = D // G
    o_d = tl.arange(0, D)
    p_q = p_q + r * stride_qn
    b_q = tl.load(p_q + o_d).to(tl.int32)  # [D] codes
    b_st = b_q
    for j in tl.static_range(1, M):  # the state: this code and the m - 1 before it, circularly
        b_st = b_st | (tl.load(p_q + (o_d + (D - j)) % D).to(tl.int32) << (j * BITS))
    b_lg = tl.reshape(tl.load(p_tab + b_st), (NG, G))  # [NG, G] levels
    b_s = _search(b_xg, G, SCALE_KIND)
    b_nx = tl.sqrt_rn(tl.sum(b_xg * b_xg, axis=1))[:, None]
    b_nl = tl.sqrt_rn(tl.sum(b_lg * b_lg, axis=1))[:, None]
    keep = b_nl > 0.0
    b_raw = tl.where(keep, tl.div_rn(b_nx, tl.where(keep, b_nl, 1.0)), b_s)
    b_up = round_to_scale_dtype(b_raw, SCALE_KIND, True)
    b_dn = round_to_scale_dtype(b_raw, SCALE_KIND, False)
    b_sc = tl.where((b_dn > 0.0) & (b_raw - b_dn < b_up - b_raw), b_dn, b_up)
    b_sc = tl.where(tl.max(tl.abs(b_xg), axis=1)[:, None] == 0.0, 0.0, b_sc)  # [NG, 1]
    p_c = p_codes + i_b * stride_cb + i_h * stride_ch + (index + i_t) * stride_ct
    p_c = p_c + tl.zeros((1, 1), tl.int64)  # [1, 1]: one row
    store_codes(p_c, tl.reshape(b_q, (1, D)), tl.full((1,), 1, tl.int1), stride_cw, 1, D, BITS)
    b_out = tl.reshape(b_sc, (NG,))
    if SCALE_KIND == 3:
        b_out = e4m3_bits(b_out)
    p_s = (
        p_scale + i_b * stride_sb + i_h * stride_sh + (index + i_t) * stride_st + tl.arange(0, NG) * stride_sg
    )
    tl.store(p_s, b_out.to(p_scale.dtype.element_ty))
    code = tl.max(nonfinite(b_sc))
    tl.atomic_max(p_flag, code, mask=code > 0)


def fused(fmt: str, head_dim: int, group: int, scale_dtype: torch.dtype) -> bool:
    """Whether :func:`trellis_append` writes this store: a trellis format, ``head_dim`` and ``group``
    powers of two with ``group`` dividing ``head_dim`` and ``head_dim`` a multiple of 8 codes per
    plane, a scale dtype the kernels round into."""
    spec = format_spec(fmt)
    return (
        spec.state_bits is not None
        and is_pow2(head_dim)
        and is_pow2(group)
        and group <= head_dim
        and head_dim >= 32
        and str(scale_dtype).removeprefix("torch.") in SCALE_KIND
    )


def trellis_append(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    index: int,
    *,
    fmt: str,
    group: int,
    flag: torch.Tensor,
) -> None:
    """Trellis codes and scales of ``x[B, H, n, D]`` written into a store's buffers (``codes [B, H,
    cap, W]``, ``scale [B, H, cap, D / G]``) at buffer index ``index``: those of
    :func:`kvquant.formats.quantize` with the Triton search (see the module). ``flag``: the device's
    deferred-error flag (int32 ``[1]``), raised for non-finite input or scales."""
    spec = format_spec(fmt)
    b, h, n, d = x.shape
    check_channels(d, spec.bits)
    if not fused(fmt, d, group, scale.dtype):
        raise ValueError(f"fmt: the fused trellis write does not take {fmt} at head_dim {d}, group {group}")
    rows = b * h * n
    if rows == 0:
        return
    kind = SCALE_KIND[str(scale.dtype).removeprefix("torch.")]
    y = torch.empty(rows, d, dtype=torch.float32, device=x.device)
    trellis_search_units_kernel[(rows,)](
        x, y, flag, n, h, *x.stride(), y.stride(0), D=d, G=group, SCALE_KIND=kind, enable_fp_fusion=False
    )
    path = trellis_encode_triton(y, spec.bits)  # [rows, D] uint8
    s = as_bytes(scale)
    trellis_store_kernel[(rows,)](
        x, path, trellis_table(spec.bits, x.device), codes, s, flag, index, n, h, *x.stride(), path.stride(0),
        *codes.stride(), *s.stride(), D=d, G=group, BITS=spec.bits, M=spec.state_bits // spec.bits,
        SCALE_KIND=kind, enable_fp_fusion=False,
    )  # fmt: skip
