"""Quantize new tokens straight into a store's buffers: ``quantize_append``.

One program quantizes ``BT`` tokens of one (batch, head): it loads ``x`` as ``[BT, D]``, reduces each
scale group (``G`` channels of a token, or ``G`` tokens of a channel on the channel axis), rounds the
scale / zero point outward to the scale dtype, encodes, packs int4 / int2 planar (byte ``j`` holds
channels ``j, j + W, ...`` with ``W = D * bits / 8``; int3 as two planes) and stores codes, scales
and zero points at buffer index ``index``. Codebooks (``nuq*``) run the scale search of
``Codebook.encode_groups`` in the kernel: the candidates ``RMS * CODEBOOK_SCALE_GRID`` and
``max|x| / top level``, the nearest level by the midpoints, the least squared error, the norm
stretch and the re-pick. Scales may be float8_e4m3fn (rounded by integer arithmetic, stored as
bytes). The plain-torch twin is :func:`kvquant.kernels.reference.quantize_append_ref`.

Restrictions of the kernel: ``D`` and ``G`` powers of two (other shapes fall back to the reference,
with a warning). Non-finite inputs, and scales the scale dtype cannot hold, do not stop the kernel
(the scale becomes ``inf`` / NaN; raising would cost a device sync per step): given a ``flag``, each
program atomically raises it to 2 (non-finite input) or 1 (a written scale or zero point not finite),
the codes of :data:`kvquant.kernels.backend.DEFERRED_ERRORS`; :func:`kvquant.formats.quantize` raises
``ValueError`` for the same values.

Exactness: divisions use ``tl.div_rn`` (Triton's ``/`` is an approximate division on NVIDIA GPUs),
square roots ``tl.sqrt_rn``, rounding is half-to-even by floor arithmetic (``torch.round``), fp8
codes and fp8 scales are encoded from the fp32 bits with integer arithmetic (Triton's interpreter
casts fp32 -> fp8 without correct rounding), and the kernel is built without FMA contraction; so
integer and fp8 codes match ``formats.quantize`` bit for bit, exact ``.5`` ties included. Codebook
codes and scales match too wherever the group's sums come out the same; the kernel sums squares in
another order than torch, so a group's RMS / norm may differ in the last bit: with fp16 / bf16 /
fp8 scales the rounding to the scale dtype absorbs that (in the tests, bit for bit), with fp32
scales the stored scale may differ by an ulp and the squared error is equal to fp32 rounding.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from kvquant.formats import CODEBOOK_SCALE_GRID, format_spec
from kvquant.kernels.reference import check_append, quantize_append_ref, resolve_static
from kvquant.kernels.triton._common import (
    SCALE_KIND,
    e4m3_bits,
    e4m3_value,
    fp8_bits,
    is_pow2,
    nonfinite,
    rint,
    round_to_scale_dtype,
    store_codes,
)


@triton.jit
def _store_rows(p_base, b_val, i_b, i_h, index, i_t, o_t, o_d, m_t, stride_b, stride_h, stride_r, stride_g,
                G: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, CHANNEL: tl.constexpr,
                SCALE_KIND: tl.constexpr):  # fmt: skip
    """Store a block of scales (or zero points): one ``[D]`` row per token block on the channel axis,
    ``[BT, NG]`` per-token group values otherwise; float8_e4m3fn (``SCALE_KIND`` 3) as its bytes."""
    if SCALE_KIND == 3:
        b_val = e4m3_bits(b_val)
    p = p_base + i_b.to(tl.int64) * stride_b + i_h.to(tl.int64) * stride_h
    if CHANNEL:
        r = (index + i_t * BT) // G
        tl.store(p + r * stride_r + o_d * stride_g, tl.reshape(b_val, (D,)).to(p_base.dtype.element_ty))
    else:
        o_g = tl.arange(0, NG)
        p = p + (index + o_t)[:, None] * stride_r + o_g[None, :] * stride_g
        tl.store(p, tl.reshape(b_val, (BT, NG)).to(p_base.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _nearest(b_y, p_edges, NL: tl.constexpr):
    """Index of the nearest codebook level (``torch.bucketize`` over the midpoints: edges below ``y``;
    NaN sorts above every edge, as there: the 0 / 0 of an all-zero group gives the top code)."""
    b_q = tl.zeros(b_y.shape, dtype=tl.int32)
    for i in tl.static_range(NL - 1):
        b_q += ((b_y > tl.load(p_edges + i)) | (b_y != b_y)).to(tl.int32)
    return b_q


@triton.jit
def _codebook_groups(b_xg, p_levels, p_edges, p_grid, QMAX: tl.constexpr, NL: tl.constexpr,
                     NGRID: tl.constexpr, G: tl.constexpr, SCALE_KIND: tl.constexpr):  # fmt: skip
    """Codes ``[BT, NG, G]`` and scales ``[BT, NG, 1]`` of groups ``b_xg`` (``Codebook.encode_groups``):
    of the candidates ``RMS * grid`` and ``max|x| / QMAX`` (each rounded up to the scale dtype) the
    one with the least squared error (the first on ties), stretched so the group keeps its norm,
    rounded up, codes re-picked for it; an all-zero group stores scale 0."""
    b_rms = tl.sqrt_rn(tl.div_rn(tl.sum(b_xg * b_xg, axis=2), G))[:, :, None]  # [BT, NG, 1]
    b_rms = tl.where(b_rms == 0.0, 1.0, b_rms)
    b_amax = tl.max(tl.abs(b_xg), axis=2)[:, :, None]
    b_fit = tl.where(b_amax == 0.0, 1.0, tl.div_rn(b_amax, QMAX))
    for i in tl.static_range(NGRID + 1):
        if i < NGRID:
            b_raw = b_rms * tl.load(p_grid + i)
        else:
            b_raw = b_fit
        b_s = round_to_scale_dtype(b_raw, SCALE_KIND, True)
        b_q = _nearest(tl.div_rn(b_xg, b_s), p_edges, NL)
        b_d = tl.load(p_levels + b_q) * b_s - b_xg
        b_err = tl.sum(b_d * b_d, axis=2)[:, :, None]
        if i == 0:
            best_q, best_s, best_err = b_q, b_s, b_err
        else:
            better = b_err < best_err
            best_q = tl.where(better, b_q, best_q)
            best_s = tl.where(better, b_s, best_s)
            best_err = tl.minimum(b_err, best_err)
    b_norm_x = tl.sqrt_rn(tl.sum(b_xg * b_xg, axis=2))[:, :, None]
    b_lq = tl.load(p_levels + best_q) * best_s
    b_norm_q = tl.sqrt_rn(tl.sum(b_lq * b_lq, axis=2))[:, :, None]
    keep = b_norm_q > 0.0
    b_raw = tl.where(keep, tl.div_rn(best_s * b_norm_x, tl.where(keep, b_norm_q, 1.0)), b_rms)
    b_s = round_to_scale_dtype(b_raw, SCALE_KIND, True)
    b_q = _nearest(tl.div_rn(b_xg, b_s), p_edges, NL)
    b_s = tl.where(b_amax == 0.0, 0.0, b_s)
    return b_q, b_s


@triton.jit
def quantize_append_kernel(
    p_x,
    p_codes,
    p_scale,
    p_zero,
    p_levels,
    p_edges,
    p_grid,
    p_flag,
    n,
    index,
    H,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_cw,
    stride_sb,
    stride_sh,
    stride_sr,
    stride_sg,
    stride_zb,
    stride_zh,
    stride_zr,
    stride_zg,
    D: tl.constexpr,
    G: tl.constexpr,
    BT: tl.constexpr,
    CHANNEL: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    STATIC: tl.constexpr,
    NL: tl.constexpr,
    NGRID: tl.constexpr,
    FLAG: tl.constexpr,
):
    i_bh, i_t = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NG: tl.constexpr = D // G

    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # [BT]
    o_d = tl.arange(0, D)  # [D]
    m_t = o_t < n
    p_x = p_x + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
    b_x = tl.load(p_x + o_t[:, None] * stride_xt + o_d[None, :] * stride_xd, mask=m_t[:, None], other=0.0)
    b_x = b_x.to(tl.float32)  # [BT, D]

    # ---- statistics per scale group -> b_s (and b_z), broadcastable against b_xg
    if CHANNEL:
        b_xg = b_x  # [BT = G, D]: one group per channel
    else:
        b_xg = tl.reshape(b_x, (BT, NG, G))  # [BT, NG, G]
    if STATIC:
        b_s = tl.load(p_scale + i_h.to(tl.int64) * stride_sh)  # scalar per head
        if SCALE_KIND == 3:
            b_s = e4m3_value(b_s.to(tl.int32))
        else:
            b_s = b_s.to(tl.float32)
    elif KIND == 2:  # int_asym: zero point rounded down, scale up
        if CHANNEL:
            b_mn = tl.min(b_xg, axis=0)[None, :]  # [1, D]
            b_mx = tl.max(b_xg, axis=0)[None, :]
        else:
            b_mn = tl.min(b_xg, axis=2)[:, :, None]  # [BT, NG, 1]
            b_mx = tl.max(b_xg, axis=2)[:, :, None]
        b_z = round_to_scale_dtype(b_mn, SCALE_KIND, False)
        b_raw = tl.div_rn(b_mx - b_z, QMAX)
        b_s = round_to_scale_dtype(tl.where(b_raw == 0.0, 1.0, b_raw), SCALE_KIND, True)
    elif KIND != 4:
        if CHANNEL:
            b_amax = tl.max(tl.abs(b_xg), axis=0)[None, :]  # [1, D]
        else:
            b_amax = tl.max(tl.abs(b_xg), axis=2)[:, :, None]  # [BT, NG, 1]
        b_raw = tl.div_rn(b_amax, QMAX)
        b_s = round_to_scale_dtype(tl.where(b_raw == 0.0, 1.0, b_raw), SCALE_KIND, True)

    # ---- codes
    if KIND == 4:  # codebook (token axis): the scale search picks scale and codes together
        b_q, b_s = _codebook_groups(b_xg, p_levels, p_edges, p_grid, QMAX, NL, NGRID, G, SCALE_KIND)
    elif KIND == 2:
        b_y = tl.minimum(tl.maximum(tl.div_rn(b_xg - b_z, b_s), 0.0), QMAX)
        b_q = rint(b_y).to(tl.int32)
    else:
        b_y = tl.minimum(tl.maximum(tl.div_rn(b_xg, b_s), -QMAX), QMAX)
        if KIND == 1:
            b_q = rint(b_y).to(tl.int32)
        else:
            b_q = fp8_bits(b_y, MANT, BIAS)
    b_q = tl.reshape(b_q, (BT, D))  # [BT, D] channel order
    p_c = p_codes + i_b.to(tl.int64) * stride_cb + i_h.to(tl.int64) * stride_ch
    p_c = p_c + (index + o_t)[:, None] * stride_ct
    store_codes(p_c, b_q, m_t, stride_cw, BT, D, BITS)

    # ---- scales / zero points
    if not STATIC:
        _store_rows(p_scale, b_s, i_b, i_h, index, i_t, o_t, o_d, m_t, stride_sb, stride_sh, stride_sr, stride_sg,
                    G, BT, D, NG, CHANNEL, SCALE_KIND)  # fmt: skip
        if KIND == 2:
            _store_rows(p_zero, b_z, i_b, i_h, index, i_t, o_t, o_d, m_t, stride_zb, stride_zh, stride_zr, stride_zg,
                        G, BT, D, NG, CHANNEL, SCALE_KIND)  # fmt: skip

    # ---- the deferred error flag: 2 non-finite input, 1 a stored scale / zero point not finite
    if FLAG:
        code = tl.max(nonfinite(b_x)) * 2  # (tokens past n were loaded as 0)
        if not STATIC:
            code = tl.maximum(code, tl.max(nonfinite(b_s)))
            if KIND == 2:
                code = tl.maximum(code, tl.max(nonfinite(b_z)))
        tl.atomic_max(p_flag, code, mask=code > 0)


def _strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if t is None else tuple(t.stride())


def quantize_append(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    index: int,
    fmt: str,
    group_size: int | None,
    axis: str = "token",
    *,
    static_scale: bool | None = None,
    flag: torch.Tensor | None = None,
) -> None:
    """Quantize ``x[B, H, n, D]`` into the store buffers at buffer index ``index``, in place (Triton).

    Same contract and results as :func:`kvquant.kernels.reference.quantize_append_ref`: codes,
    scales and zero points bit-identical to :func:`kvquant.formats.quantize`. ``x`` fp16 / bf16 / fp32;
    ``D`` and the group size powers of two (else the reference runs, which raises at once for
    non-finite values). ``flag``: an int32 ``[1]`` tensor on ``x``'s device that the kernel raises to
    2 for non-finite input, 1 for a scale the scale dtype cannot hold (never lowered; no host sync).
    """
    g, _ = check_append(x, codes, scale, zero, index, fmt, group_size, axis)
    b, h, n, d = x.shape
    spec = format_spec(fmt)
    if not spec.has_scale:  # pass-through
        codes[:, :, index : index + n].copy_(x)
        return
    if n == 0 or b * h == 0:
        return
    scale_name = None if scale is None else str(scale.dtype).removeprefix("torch.")
    if not (is_pow2(d) and is_pow2(g)) or (scale_name is not None and scale_name not in SCALE_KIND):
        warnings.warn(
            f"quantize_append: head_dim {d} / group_size {g} not powers of two, or scale dtype {scale_name} "
            "(the kernel rounds into fp32 / fp16 / bf16); using the torch reference",
            stacklevel=2,
        )
        quantize_append_ref(x, codes, scale, zero, index, fmt, group_size, axis, static_scale=static_scale)
        return
    if spec.triton_write() is None and spec.state_bits is not None:  # trellis: the search kernel
        from kvquant.kernels.triton import trellis_write
        from kvquant.kernels.triton.trellis import trellis_encode_triton

        if flag is not None and axis == "token" and trellis_write.fused(fmt, d, g, scale.dtype):
            trellis_write.trellis_append(x, codes, scale, index, fmt=fmt, group=g, flag=flag)
        else:  # the spec's scales in torch around it
            quantize_append_ref(
                x, codes, scale, zero, index, fmt, group_size, axis, encoder=trellis_encode_triton
            )
        return
    static = resolve_static(scale, zero, codes, axis, static_scale)
    if static and not spec.takes_static_scale:
        raise ValueError(f"static_scale: only int8 and fp8 formats take static scales, not {fmt}")
    if spec.token_axis_only and axis != "token":
        raise ValueError(f"axis: {spec.kind} format {fmt} takes scales along the token axis only")
    constants = spec.triton_write()
    if constants is None:
        raise ValueError(f"fmt: the Triton quantize kernel does not write {fmt}")
    kind, bits, qmax, mant, bias = constants
    scale_kind = SCALE_KIND[scale_name]
    if axis == "channel":
        bt = g
    else:
        bt = min(triton.next_power_of_2(n), max(1, 4096 // d))
    c = codes.view(torch.uint8) if spec.code_dtype.is_floating_point else codes  # fp8 codes: their bits
    s, z = (t.view(torch.uint8) if t is not None and scale_kind == 3 else t for t in (scale, zero))
    levels, edges, grid = _codebook_tables(spec, x.device)
    quantize_append_kernel[(b * h, triton.cdiv(n, bt))](
        x,
        c,
        s,
        z if z is not None else s,
        levels,
        edges,
        grid,
        flag if flag is not None else levels,
        n,
        index,
        h,
        *x.stride(),
        *c.stride(),
        *_strides(s),
        *_strides(z),
        D=d,
        G=g,
        BT=bt,
        CHANNEL=axis == "channel",
        KIND=kind,
        BITS=bits,
        QMAX=qmax,
        MANT=mant,
        BIAS=bias,
        SCALE_KIND=scale_kind,
        STATIC=static,
        NL=levels.numel(),
        NGRID=grid.numel(),
        FLAG=flag is not None,
        enable_fp_fusion=False,  # err = (level * s - x)^2 as the spec rounds it (no FMA): the same pick
    )


_TABLES: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _codebook_tables(spec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels ``[NL]``, midpoints ``[NL - 1]`` and the scale grid ``[NGRID]`` (fp32, on ``device``,
    made once) of a codebook format, as ``Codebook.encode_groups`` computes them; one-entry
    placeholders for the others (never read)."""
    key = (spec.name, device)
    if key not in _TABLES:
        if spec.triton_write()[0] == 4:
            levels = spec.levels.to(device)
            edges = (levels[1:] + levels[:-1]) / 2
            grid = torch.tensor(CODEBOOK_SCALE_GRID, dtype=torch.float32, device=device)
        else:
            levels = edges = grid = torch.zeros(1, device=device)
        _TABLES[key] = (levels.contiguous(), edges.contiguous(), grid)
    return _TABLES[key]
