"""The Triton kernels of flash-decoding over a quantized store (the launcher is ``decode_attention``).

``decode_attention_split_kernel``: program ``(b, h, s)`` serves the ``G_q`` query heads of KV head
``h`` over the ``s``-th share of the row's tiles, dequantizing codes in the loop (see
:mod:`kvquant.kernels.triton.decode_attention` for the scale modes and the precision argument);
``merge_splits_kernel`` merges the split partials by log-sum-exp.
"""

import triton
import triton.language as tl

from kvquant.kernels.triton.decode_tiles import load_levels, load_scale

# --------------------------------------------------------------------------------------------- helpers


@triton.jit
def split_f16(a):
    """fp32 ``a[M, K]`` -> ``(hi, lo, pow2)`` with ``a ~= (hi + lo) * pow2[:, None]`` to 22 bits.

    ``pow2`` (per row) brings the row's largest magnitude into ``[1, 2)``, so ``hi`` / ``lo`` are in
    fp16 range; a zero row gets ``pow2 = 1``.
    """
    e_bits = tl.max(tl.abs(a), axis=1).to(tl.int32, bitcast=True) & 0x7F800000  # [M]
    e_bits = tl.where(e_bits == 0, 127 << 23, e_bits)
    pow2 = e_bits.to(tl.float32, bitcast=True)
    inv = ((254 << 23) - e_bits).to(tl.float32, bitcast=True)
    a = a * inv[:, None]
    hi = a.to(tl.float16)
    lo = (a - hi.to(tl.float32)).to(tl.float16)
    return hi, lo, pow2


@triton.jit
def dot_split(a, b):
    """``a @ b`` in fp32 for fp32 ``a[M, K]`` and fp16 ``b[K, N]`` whose values are exact in fp16."""
    hi, lo, pow2 = split_f16(a)
    acc = tl.dot(hi, b)
    acc = tl.dot(lo, b, acc)
    return acc * pow2[:, None]


@triton.jit
def group_major(a, M: tl.constexpr, NG: tl.constexpr, G: tl.constexpr):
    """``a[M, NG * G]`` as ``[NG, M, G]``: channel group first, for a batched dot per group."""
    return tl.permute(tl.reshape(a, (M, NG, G)), (1, 0, 2))


@triton.jit
def tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def decode_attention_split_kernel(
    p_q,
    p_kc,
    p_ks,
    p_kz,
    p_vc,
    p_vs,
    p_vz,
    p_klut,
    p_vlut,
    p_start,
    p_valid,
    p_o,
    p_lse,
    end,
    num_splits,
    Hkv,
    scaling,
    softcap,
    stride_valb,
    stride_valt,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_kcw,
    stride_ksb,
    stride_ksh,
    stride_ksr,
    stride_ksg,
    stride_kzb,
    stride_kzh,
    stride_kzr,
    stride_kzg,
    stride_vcb,
    stride_vch,
    stride_vct,
    stride_vcw,
    stride_vsb,
    stride_vsh,
    stride_vsr,
    stride_vsg,
    stride_vzb,
    stride_vzh,
    stride_vzr,
    stride_vzg,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    GQ: tl.constexpr,
    GQP: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_FP8: tl.constexpr,
    V_FP8: tl.constexpr,
    K_LUT: tl.constexpr,
    V_LUT: tl.constexpr,
    K_M: tl.constexpr,
    V_M: tl.constexpr,
    K_SFP8: tl.constexpr,
    V_SFP8: tl.constexpr,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
    K_CHANNEL: tl.constexpr,
    K_G: tl.constexpr,
    V_G: tl.constexpr,
    K_SCALE: tl.constexpr,
    K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    F32_DOT: tl.constexpr,
    VALID: tl.constexpr,
):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hkv).to(tl.int64), (i_bh % Hkv).to(tl.int64)
    o_g = tl.arange(0, GQP)  # query heads of the group (padded to GQP >= 16 rows for tl.dot)
    m_g = o_g < GQ
    o_d = tl.arange(0, D)

    p_q = p_q + i_b * stride_qb + (i_h * GQ + o_g)[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None], other=0.0).to(tl.float32)  # [GQP, D]
    b_qsum = tl.sum(b_q, axis=1)  # [GQP]
    if K_MODE == 0:
        if Q_SPLIT:
            b_qhi, b_qlo, b_qp2 = split_f16(b_q)  # [GQP, D], [GQP, D], [GQP]
        else:
            b_q16 = b_q.to(tl.float16)  # exact: q is fp16
    elif K_MODE == 3:  # q by channel group: [NG, GQP, G]
        NGK: tl.constexpr = D // K_G
        o_kg = tl.arange(0, NGK)
        b_qsum3 = tl.sum(group_major(b_q, GQP, NGK, K_G), axis=2)  # [NG, GQP]
        if Q_SPLIT:
            b_qhi, b_qlo, b_qp2 = split_f16(b_q)  # [GQP, D], [GQP, D], [GQP]
            b_qhi3 = group_major(b_qhi, GQP, NGK, K_G)
            b_qlo3 = group_major(b_qlo, GQP, NGK, K_G)
        else:
            b_qhi3 = group_major(b_q.to(tl.float16), GQP, NGK, K_G)  # exact: q is fp16

    p_kc = p_kc + i_b * stride_kcb + i_h * stride_kch
    p_ks = p_ks + i_b * stride_ksb + i_h * stride_ksh
    p_kz = p_kz + i_b * stride_kzb + i_h * stride_kzh
    p_vc = p_vc + i_b * stride_vcb + i_h * stride_vch
    p_vs = p_vs + i_b * stride_vsb + i_h * stride_vsh
    p_vz = p_vz + i_b * stride_vzb + i_h * stride_vzh

    # this program's share of the row's tiles: tiles are aligned to multiples of BT, each holds >= 1 valid token
    st = tl.maximum(tl.load(p_start + i_b).to(tl.int32), 0)
    t_lo = st // BT
    t_hi = tl.cdiv(end, BT)
    n_tiles = tl.where(st < end, t_hi - t_lo, 0)
    per = tl.cdiv(n_tiles, num_splits)
    i_lo = t_lo + i_s * per
    i_hi = tl.minimum(i_lo + per, t_hi)

    b_m = tl.full([GQP], float("-inf"), dtype=tl.float32)  # running max (base 2)
    b_l = tl.zeros([GQP], dtype=tl.float32)  # running sum
    b_acc = tl.zeros([GQP, D], dtype=tl.float32)
    for i_t in range(i_lo, i_hi):
        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # [BT]
        m_t = (o_t >= st) & (o_t < end)
        if VALID:  # a token mask [B, end] (bytes): token t attends where it is nonzero
            m_t = m_t & (tl.load(p_valid + i_b * stride_valb + o_t * stride_valt, mask=m_t, other=0) != 0)

        # ---- scores [GQP, BT]
        b_k = load_levels(p_kc, p_klut, o_t, m_t, stride_kct, stride_kcw, BT, D, K_BITS, K_FP8, K_LUT, K_M)
        if K_MODE == 0:
            b_kt = tl.trans(b_k).to(tl.float16)  # [D, BT], exact (table values: their high half)
            if Q_SPLIT:
                b_s = tl.dot(b_qhi, b_kt)
                b_s = tl.dot(b_qlo, b_kt, b_s)
            else:
                b_s = tl.dot(b_q16, b_kt)
            if K_LUT > 0:  # the low half: hi + lo holds a table value to 22 bits
                b_ktl = (tl.trans(b_k) - b_kt.to(tl.float32)).to(tl.float16)  # [D, BT]
                if Q_SPLIT:
                    b_s = tl.dot(b_qhi, b_ktl, b_s)
                else:
                    b_s = tl.dot(b_q16, b_ktl, b_s)
            if Q_SPLIT:
                b_s = b_s * b_qp2[:, None]
            if K_SCALE:
                b_ks = load_scale(p_ks + o_t * stride_ksr, m_t, K_SFP8)  # [BT]
                b_s = b_s * b_ks[None, :]
            if K_ZERO:
                b_kz = load_scale(p_kz + o_t * stride_kzr, m_t, K_SFP8)  # [BT]
                b_s += b_qsum[:, None] * b_kz[None, :]
        elif K_MODE == 3:  # a scale per token and K_G channels: one dot per group, the scales folded out
            b_kh = b_k.to(tl.float16)  # [BT, D] exact (table values: their high half)
            b_k3 = tl.permute(tl.reshape(b_kh, (BT, NGK, K_G)), (1, 2, 0))  # [NG, G, BT]
            b_s3 = tl.dot(b_qhi3, b_k3)  # [NG, GQP, BT]
            if Q_SPLIT:
                b_s3 = tl.dot(b_qlo3, b_k3, b_s3)
            if K_LUT > 0:  # the low half
                b_kl = (b_k - b_kh.to(tl.float32)).to(tl.float16)
                b_s3 = tl.dot(b_qhi3, tl.permute(tl.reshape(b_kl, (BT, NGK, K_G)), (1, 2, 0)), b_s3)
            o_ks = o_t[None, :] * stride_ksr + o_kg[:, None] * stride_ksg  # [NG, BT]
            b_ks = load_scale(p_ks + o_ks, m_t[None, :], K_SFP8)  # [NG, BT]
            b_s = tl.sum(b_s3 * b_ks[:, None, :], axis=0)  # [GQP, BT]
            if Q_SPLIT:
                b_s = b_s * b_qp2[:, None]
            if K_ZERO:
                o_kz = o_t[None, :] * stride_kzr + o_kg[:, None] * stride_kzg
                b_kz = load_scale(p_kz + o_kz, m_t[None, :], K_SFP8)  # [NG, BT]
                b_s += tl.sum(b_qsum3[:, :, None] * b_kz[:, None, :], axis=0)
        elif K_MODE == 1:  # the tile lies in one token block: its per-channel scales fold into q
            r = (i_t * BT) // K_G
            b_ks = load_scale(p_ks + r * stride_ksr + o_d * stride_ksg, o_d < D, K_SFP8)  # [D]
            b_s = dot_split(b_q * b_ks[None, :], tl.trans(b_k).to(tl.float16))
            if K_ZERO:
                b_kz = load_scale(p_kz + r * stride_kzr + o_d * stride_kzg, o_d < D, K_SFP8)  # [D]
                b_s += tl.sum(b_q * b_kz[None, :], axis=1)[:, None]
        else:  # dequantize the tile
            b_k = b_k.to(tl.float32)
            if K_SCALE and not K_CHANNEL and K_G == D:  # one scale per token: [BT] loads, broadcast
                b_k = b_k * load_scale(p_ks + o_t * stride_ksr, m_t, K_SFP8)[:, None]
                if K_ZERO:
                    b_k += load_scale(p_kz + o_t * stride_kzr, m_t, K_SFP8)[:, None]
            elif K_SCALE:
                if K_CHANNEL:
                    o_r = (o_t // K_G)[:, None] * stride_ksr + o_d[None, :] * stride_ksg
                    o_rz = (o_t // K_G)[:, None] * stride_kzr + o_d[None, :] * stride_kzg
                else:
                    o_r = o_t[:, None] * stride_ksr + (o_d // K_G)[None, :] * stride_ksg
                    o_rz = o_t[:, None] * stride_kzr + (o_d // K_G)[None, :] * stride_kzg
                b_k = b_k * load_scale(p_ks + o_r, m_t[:, None], K_SFP8)
                if K_ZERO:
                    b_k += load_scale(p_kz + o_rz, m_t[:, None], K_SFP8)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=F32_DOT)
        b_s = b_s * scaling
        if SOFTCAP:
            b_s = softcap * tanh(b_s / softcap)
        b_s = tl.where(m_t[None, :], b_s * 1.4426950408889634, float("-inf"))  # base 2

        # ---- online softmax
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))  # [GQP], finite: the tile has a valid token
        if VALID:  # ... unless the mask took them all: nothing so far, weights 0
            b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_alpha = tl.exp2(b_m - b_ms)
            b_p = tl.exp2(b_s - b_ms[:, None])
        else:
            b_alpha = tl.exp2(b_m - b_mn)
            b_p = tl.exp2(b_s - b_mn[:, None])  # [GQP, BT]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_m = b_mn

        # ---- P @ V [GQP, D]
        b_v = load_levels(p_vc, p_vlut, o_t, m_t, stride_vct, stride_vcw, BT, D, V_BITS, V_FP8, V_LUT, V_M)
        if V_MODE == 0:
            b_pv = b_p
            if V_SCALE:
                b_vs = load_scale(p_vs + o_t * stride_vsr, m_t, V_SFP8)  # [BT]
                b_pv = b_p * b_vs[None, :]
            b_vh = b_v.to(tl.float16)  # exact (table values: their high half)
            if V_LUT > 0:  # p (hi + lo) @ (v_hi + v_lo), the lo @ lo term (2**-22 relative) left out
                b_phi, b_plo, b_pp2 = split_f16(b_pv)
                b_o = tl.dot(b_phi, b_vh)
                b_o = tl.dot(b_plo, b_vh, b_o)
                b_o = tl.dot(b_phi, (b_v - b_vh.to(tl.float32)).to(tl.float16), b_o) * b_pp2[:, None]
            else:
                b_o = dot_split(b_pv, b_vh)
            if V_ZERO:
                b_vz = load_scale(p_vz + o_t * stride_vzr, m_t, V_SFP8)  # [BT]
                b_o += tl.sum(b_p * b_vz[None, :], axis=1)[:, None]
        elif V_MODE == 3:  # a scale per token and V_G channels: (p * s_g) @ C_g per group
            NGV: tl.constexpr = D // V_G
            o_vg = tl.arange(0, NGV)
            o_vs = o_t[None, :] * stride_vsr + o_vg[:, None] * stride_vsg  # [NG, BT]
            b_vs = load_scale(p_vs + o_vs, m_t[None, :], V_SFP8)  # [NG, BT]
            b_pv3 = b_p[None, :, :] * b_vs[:, None, :]  # [NG, GQP, BT]
            b_phi, b_plo, b_pp2 = split_f16(tl.reshape(b_pv3, (NGV * GQP, BT)))  # per (group, query) row
            b_phi3 = tl.reshape(b_phi, (NGV, GQP, BT))
            b_vh = b_v.to(tl.float16)  # [BT, D] exact (table values: their high half)
            b_vh3 = group_major(b_vh, BT, NGV, V_G)  # [NG, BT, G]
            b_o3 = tl.dot(b_phi3, b_vh3)  # [NG, GQP, G]
            b_o3 = tl.dot(tl.reshape(b_plo, (NGV, GQP, BT)), b_vh3, b_o3)
            if V_LUT > 0:  # the low half; lo @ lo (2**-22 relative) left out
                b_vl = (b_v - b_vh.to(tl.float32)).to(tl.float16)
                b_o3 = tl.dot(b_phi3, group_major(b_vl, BT, NGV, V_G), b_o3)
            b_o3 = b_o3 * tl.reshape(b_pp2, (NGV, GQP))[:, :, None]
            if V_ZERO:
                o_vz = o_t[None, :] * stride_vzr + o_vg[:, None] * stride_vzg
                b_vz = load_scale(p_vz + o_vz, m_t[None, :], V_SFP8)  # [NG, BT]
                b_o3 += tl.sum(b_p[None, :, :] * b_vz[:, None, :], axis=2)[:, :, None]
            b_o = tl.reshape(tl.permute(b_o3, (1, 0, 2)), (GQP, D))
        else:
            b_v = b_v.to(tl.float32)
            if V_SCALE and V_G == D:  # one scale per token: [BT] loads, broadcast
                b_v = b_v * load_scale(p_vs + o_t * stride_vsr, m_t, V_SFP8)[:, None]
                if V_ZERO:
                    b_v += load_scale(p_vz + o_t * stride_vzr, m_t, V_SFP8)[:, None]
            elif V_SCALE:
                o_r = o_t[:, None] * stride_vsr + (o_d // V_G)[None, :] * stride_vsg
                b_v = b_v * load_scale(p_vs + o_r, m_t[:, None], V_SFP8)
                if V_ZERO:
                    o_rz = o_t[:, None] * stride_vzr + (o_d // V_G)[None, :] * stride_vzg
                    b_v += load_scale(p_vz + o_rz, m_t[:, None], V_SFP8)
            b_o = tl.dot(b_p, b_v, input_precision=F32_DOT)
        b_acc = b_acc * b_alpha[:, None] + b_o

    m_ok = b_l > 0
    b_lsafe = tl.where(m_ok, b_l, 1.0)
    b_out = tl.where(m_ok[:, None], b_acc / b_lsafe[:, None], 0.0)  # [GQP, D]
    b_lse = tl.where(m_ok, (b_m + tl.log2(b_lsafe)) * 0.6931471805599453, float("-inf"))  # natural log
    o_h = i_h * GQ + o_g
    p_o = p_o + i_b * stride_ob + o_h[:, None] * stride_oh + i_s * stride_os + o_d[None, :] * stride_od
    tl.store(p_o, b_out.to(p_o.dtype.element_ty), mask=m_g[:, None])
    tl.store(p_lse + i_b * stride_lb + o_h * stride_lh + i_s * stride_ls, b_lse, mask=m_g)


@triton.jit
def merge_splits_kernel(
    p_op,
    p_lp,
    p_o,
    p_lse,
    num_splits,
    Hq,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    D: tl.constexpr,
    BS: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_b, i_h = (i_bh // Hq).to(tl.int64), (i_bh % Hq).to(tl.int64)
    o_s = tl.arange(0, BS)
    m_s = o_s < num_splits
    o_d = tl.arange(0, D)
    b_lp = tl.load(
        p_lp + i_b * stride_qb + i_h * stride_qh + o_s * stride_qs, mask=m_s, other=float("-inf")
    )  # [BS]
    b_m = tl.max(b_lp, axis=0)
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_w = tl.exp(b_lp - b_m)  # [BS]; empty splits weigh 0
    b_l = tl.sum(b_w, axis=0)
    p_op = p_op + i_b * stride_pb + i_h * stride_ph + o_s[:, None] * stride_ps + o_d[None, :] * stride_pd
    b_op = tl.load(p_op, mask=m_s[:, None], other=0.0)  # [BS, D]
    b_lsafe = tl.where(b_l > 0, b_l, 1.0)
    b_o = tl.sum(b_w[:, None] * b_op, axis=0) / b_lsafe  # [D]
    b_lse = tl.where(b_l > 0, b_m + tl.log(b_lsafe), float("-inf"))
    tl.store(p_o + i_b * stride_ob + i_h * stride_oh + o_d * stride_od, b_o.to(p_o.dtype.element_ty))
    tl.store(p_lse + i_b * stride_lb + i_h * stride_lh, b_lse)
