"""Flash-decoding over a quantized KV store: one query token per row, codes dequantized in the loop.

``quantized_decode_attention`` launches two kernels:

1. ``decode_attention_split_kernel``, grid ``(B * Hkv, S)``: program ``(b, h, s)`` serves all ``G_q``
   query heads of KV head ``h`` (each K/V tile is loaded once for the whole GQA group) over the
   ``s``-th share of the row's tiles ``[start[b], end)``. Per tile of ``BT`` tokens it unpacks codes
   (int4 / int2 planes with one shift + mask each, joined back into channel order), computes the
   scores, runs an online softmax (base 2) and accumulates ``P @ V``; it writes the normalized
   partial output and its log-sum-exp.
2. ``merge_splits_kernel``, grid ``(B * Hq,)``: merges the ``S`` partials by log-sum-exp (skipped when
   ``S == 1``: the split kernel then writes the final output itself).

How scales enter (``K_MODE`` / ``V_MODE``):

- ``0`` per-token scale (one group per head, or a static per-head scale): folded out of the dot
  products. Keys: ``scores = s_t * (q . c_t) + z_t * sum(q)``; values: ``out = (p * s) @ C + p @ z``.
- ``1`` channel-axis keys (KIVI): the per-channel scales of the tile's token block are folded into
  ``q``: ``scores = (q * s) . c_t + q . z``. Tiles never straddle a block (``BT`` divides ``G``).
- ``2`` anything else (channel groups smaller than the head, odd channel-axis blocks, the ``none``
  format in bf16 / fp32): the tile is dequantized in registers (``c * s + z``) before the dot.

Precision: every code value (int8, int4, int2, fp8) is exact in fp16, so the folded dots multiply
exact fp16 codes by an fp32 operand carried as two fp16 halves (``hi + lo``, 22 significant bits,
row-scaled by a power of two so nothing overflows); fp16 queries are used as they are. Dequantized
tiles (mode 2) use fp32 dots (``tf32x3`` on GPU). The result matches the fp32 reference
(:func:`kvquant.kernels.reference.quantized_decode_attention_ref`) to fp32 rounding.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from kvquant.formats import format_spec, is_static_scale
from kvquant.kernels.reference import check_attention, quantized_decode_attention_ref
from kvquant.kernels.triton._common import INTERPRET, fp8_code, is_pow2

# --------------------------------------------------------------------------------------------- helpers


@triton.jit
def load_codes(
    p_c,
    o_t,
    m_t,
    stride_t,
    stride_w,
    BT: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
):
    """Code values of tokens ``o_t`` as fp32 ``[BT, D]`` in channel order (planar int4 / int2 unpacked).

    fp8 codes arrive as their bytes (``FP8`` 1: e4m3fn, 2: e5m2) and are decoded through fp16 bit
    patterns (exact, no fp8 hardware or fp8 casts needed): e5m2 is the high byte of an fp16; e4m3's
    exponent / mantissa shifted into fp16 position is the value times 2**-8.
    """
    PB: tl.constexpr = 8 // BITS if BITS < 8 else 1
    W: tl.constexpr = D // PB
    o_w = tl.arange(0, W)
    b_c = tl.load(
        p_c + o_t[:, None] * stride_t + o_w[None, :] * stride_w, mask=m_t[:, None], other=0.0
    )  # [BT, W]
    if PB == 2:  # byte j: channel j (low nibble), channel j + W (high nibble)
        b_c = tl.join(b_c & 0xF, b_c >> 4)  # [BT, W, 2]
        b_c = tl.reshape(tl.permute(b_c, (0, 2, 1)), (BT, D))  # [BT, D]
    elif PB == 4:  # byte j: channels j, j + W, j + 2W, j + 3W from the low bit pair up
        b_c = tl.join(tl.join(b_c & 3, (b_c >> 2) & 3), tl.join((b_c >> 4) & 3, b_c >> 6))  # [BT, W, 2, 2]
        b_c = tl.reshape(tl.permute(b_c, (0, 3, 2, 1)), (BT, D))  # [BT, D]: plane 2 * i3 + i2
    if FP8 == 1:
        b_c = b_c.to(tl.uint16)
        b_c = ((b_c & 0x80) << 8) | ((b_c & 0x7F) << 7)
        b_c = b_c.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    elif FP8 == 2:
        b_c = (b_c.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    return b_c.to(tl.float32)


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
    p_start,
    p_o,
    p_lse,
    end,
    num_splits,
    Hkv,
    scaling,
    softcap,
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

        # ---- scores [GQP, BT]
        b_k = load_codes(p_kc, o_t, m_t, stride_kct, stride_kcw, BT, D, K_BITS, K_FP8)  # [BT, D]
        if K_MODE == 0:
            b_kt = tl.trans(b_k).to(tl.float16)  # [D, BT], exact
            if Q_SPLIT:
                b_s = tl.dot(b_qhi, b_kt)
                b_s = tl.dot(b_qlo, b_kt, b_s) * b_qp2[:, None]
            else:
                b_s = tl.dot(b_q16, b_kt)
            if K_SCALE:
                b_ks = tl.load(p_ks + o_t * stride_ksr, mask=m_t, other=0.0).to(tl.float32)  # [BT]
                b_s = b_s * b_ks[None, :]
            if K_ZERO:
                b_kz = tl.load(p_kz + o_t * stride_kzr, mask=m_t, other=0.0).to(tl.float32)  # [BT]
                b_s += b_qsum[:, None] * b_kz[None, :]
        elif K_MODE == 1:  # the tile lies in one token block: its per-channel scales fold into q
            r = (i_t * BT) // K_G
            b_ks = tl.load(p_ks + r * stride_ksr + o_d * stride_ksg).to(tl.float32)  # [D]
            b_s = dot_split(b_q * b_ks[None, :], tl.trans(b_k).to(tl.float16))
            if K_ZERO:
                b_kz = tl.load(p_kz + r * stride_kzr + o_d * stride_kzg).to(tl.float32)  # [D]
                b_s += tl.sum(b_q * b_kz[None, :], axis=1)[:, None]
        else:  # dequantize the tile
            if K_SCALE:
                if K_CHANNEL:
                    o_r = (o_t // K_G)[:, None] * stride_ksr + o_d[None, :] * stride_ksg
                    o_rz = (o_t // K_G)[:, None] * stride_kzr + o_d[None, :] * stride_kzg
                else:
                    o_r = o_t[:, None] * stride_ksr + (o_d // K_G)[None, :] * stride_ksg
                    o_rz = o_t[:, None] * stride_kzr + (o_d // K_G)[None, :] * stride_kzg
                b_k = b_k * tl.load(p_ks + o_r, mask=m_t[:, None], other=0.0).to(tl.float32)
                if K_ZERO:
                    b_k += tl.load(p_kz + o_rz, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=F32_DOT)
        b_s = b_s * scaling
        if SOFTCAP:
            b_s = softcap * tanh(b_s / softcap)
        b_s = tl.where(m_t[None, :], b_s * 1.4426950408889634, float("-inf"))  # base 2

        # ---- online softmax
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))  # [GQP], finite: the tile has a valid token
        b_alpha = tl.exp2(b_m - b_mn)
        b_p = tl.exp2(b_s - b_mn[:, None])  # [GQP, BT]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_m = b_mn

        # ---- P @ V [GQP, D]
        b_v = load_codes(p_vc, o_t, m_t, stride_vct, stride_vcw, BT, D, V_BITS, V_FP8)  # [BT, D]
        if V_MODE == 0:
            b_pv = b_p
            if V_SCALE:
                b_vs = tl.load(p_vs + o_t * stride_vsr, mask=m_t, other=0.0).to(tl.float32)  # [BT]
                b_pv = b_p * b_vs[None, :]
            b_o = dot_split(b_pv, b_v.to(tl.float16))
            if V_ZERO:
                b_vz = tl.load(p_vz + o_t * stride_vzr, mask=m_t, other=0.0).to(tl.float32)  # [BT]
                b_o += tl.sum(b_p * b_vz[None, :], axis=1)[:, None]
        else:
            if V_SCALE:
                o_r = o_t[:, None] * stride_vsr + (o_d // V_G)[None, :] * stride_vsg
                b_v = b_v * tl.load(p_vs + o_r, mask=m_t[:, None], other=0.0).to(tl.float32)
                if V_ZERO:
                    o_rz = o_t[:, None] * stride_vzr + (o_d // V_G)[None, :] * stride_vzg
                    b_v += tl.load(p_vz + o_rz, mask=m_t[:, None], other=0.0).to(tl.float32)
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


# --------------------------------------------------------------------------------------------- launcher


def _operand(codes, scale, zero, fmt, group, axis, d):
    """(bits, mode, scale, zero, has_scale, has_zero) of one of K / V for the kernel."""
    spec = format_spec(fmt)
    if not spec.has_scale:  # pass-through
        if codes.shape[-1] != d:
            raise ValueError(
                f"codes: format none needs raw [B, H, cap, {d}] tensors, got {tuple(codes.shape)}"
            )
        mode = 0 if codes.dtype == torch.float16 else 2  # fp16 is exact in the fp16 dot
        return 16, mode, None, None, False, False
    if codes.shape[-1] != spec.code_width(d):
        raise ValueError(f"codes: last dim {codes.shape[-1]} != {spec.code_width(d)} for {fmt}, head_dim {d}")
    if scale is None:
        raise ValueError(f"scale: format {fmt} needs scales")
    if spec.has_zero and zero is None:
        raise ValueError(f"zero: format {fmt} needs zero points")
    b, h, cap, _ = codes.shape
    if axis == "token" and is_static_scale(scale, axis):  # [1, H, 1, 1] -> stride-0 view [B, H, cap, 1]
        if zero is not None:
            raise ValueError("zero: a static per-head scale takes no zero points")
        return spec.bits, 0, scale.expand(b, h, cap, 1), None, True, False
    cols = d if axis == "channel" else d // group
    rows = -(-cap // group) if axis == "channel" else cap
    for name, t in (("scale", scale), ("zero", zero if spec.has_zero else None)):
        if t is not None and (t.shape[:2] != (b, h) or t.shape[3] != cols or t.shape[2] < rows):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} does not fit codes {tuple(codes.shape)} ({axis} axis, G={group})"
            )
    if axis == "channel":
        mode = 1
    else:
        mode = 0 if group == d else 2
    return spec.bits, mode, scale, zero if spec.has_zero else None, True, spec.has_zero


def _block_t(d: int, k_mode: int, v_mode: int, k_axis: str, k_group: int) -> tuple[int, int]:
    """Tokens per tile (a power of two >= 16) and the key mode (channel fold needs BT | G).

    Sized so that sm_90 builds (8 warps) do not spill: 64 tokens for head_dim <= 128 with folded
    scales, 32 for head_dim 256 or when a tile is dequantized to fp32 (mode 2, tf32x3 dots).
    """
    bt = 64 if d <= 128 and 2 not in (k_mode, v_mode) else 32
    if k_axis == "channel" and k_mode == 1:
        while bt > 16 and k_group % bt:
            bt //= 2
        if k_group % bt:
            k_mode = 2  # odd / small blocks: dequantize with per-element scale rows instead
    return bt, k_mode


def default_num_splits(batch_heads: int, n_tiles: int, device: torch.device) -> int:
    """Splits per (batch, KV head): enough programs to fill the device, at least 4 tiles per split."""
    if n_tiles <= 1:
        return 1
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # interpreter: few programs (each one is slow), but still exercise the merge
        target = 2 * batch_heads
    return max(1, min(triton.cdiv(target, batch_heads), triton.cdiv(n_tiles, 4), 128))


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if t is None else tuple(t.stride())


def quantized_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    *,
    k_fmt: str,
    v_fmt: str,
    k_group: int | None,
    v_group: int | None,
    k_axis: str,
    start: torch.Tensor,
    end: int,
    scaling: float,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding over a quantized store (Triton); the contract of
    :func:`kvquant.kernels.reference.quantized_decode_attention_ref`.

    ``num_splits`` overrides the split count; ``out[B, Hq, D]`` / ``lse[B, Hq]`` (fp32) may be
    preallocated and are written in place. A ``head_dim`` that is not a power of two >= 16 falls
    back to the reference (with a warning).
    """
    check_attention(q, k_codes, v_codes, start, end, k_axis, k_group)
    b, hq, d = q.shape
    hkv = k_codes.shape[1]
    if not (is_pow2(d) and d >= 16):
        warnings.warn(
            f"quantized_decode_attention: head_dim {d} is not a power of two >= 16; using the torch reference",
            stacklevel=2,
        )
        return quantized_decode_attention_ref(
            q,
            k_codes,
            k_scale,
            k_zero,
            v_codes,
            v_scale,
            v_zero,
            k_fmt=k_fmt,
            v_fmt=v_fmt,
            k_group=k_group,
            v_group=v_group,
            k_axis=k_axis,
            start=start,
            end=end,
            scaling=scaling,
            softcap=softcap,
            out=out,
            lse=lse,
        )
    kg = d if k_group is None else (min(k_group, d) if k_axis == "token" else k_group)
    vg = d if v_group is None else min(v_group, d)
    if k_axis == "token" and d % kg or d % vg:
        raise ValueError(f"k_group / v_group: {kg}, {vg} must divide head_dim {d}")
    k_bits, k_mode, k_scale, k_zero, k_has_s, k_has_z = _operand(
        k_codes, k_scale, k_zero, k_fmt, kg, k_axis, d
    )
    v_bits, v_mode, v_scale, v_zero, v_has_s, v_has_z = _operand(
        v_codes, v_scale, v_zero, v_fmt, vg, "token", d
    )
    bt, k_mode = _block_t(d, k_mode, v_mode, k_axis, kg)
    if out is None:
        out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if out.shape != (b, hq, d) or lse.shape != (b, hq) or lse.dtype != torch.float32:
        raise ValueError(f"out / lse: expected [{b}, {hq}, {d}] and fp32 [{b}, {hq}]")
    if b * hq == 0:
        return out, lse
    n_tiles = triton.cdiv(max(end, 0), bt)
    s = num_splits if num_splits is not None else default_num_splits(b * hkv, n_tiles, q.device)
    s = max(1, min(int(s), max(n_tiles, 1)))
    if s == 1:  # the split kernel writes the final result
        o_part, l_part = out, lse
        o_str = (out.stride(0), out.stride(1), 0, out.stride(2))
        l_str = (lse.stride(0), lse.stride(1), 0)
    else:
        o_part = torch.empty(b, hq, s, d, dtype=torch.float32, device=q.device)
        l_part = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
        o_str, l_str = o_part.stride(), l_part.stride()
    gq = hq // hkv
    dummy = k_codes  # any pointer for absent scale / zero buffers (never read)
    k_fp8, v_fp8 = fp8_code(k_fmt), fp8_code(v_fmt)
    k_codes = k_codes.view(torch.uint8) if k_fp8 else k_codes  # fp8: decoded from its bytes
    v_codes = v_codes.view(torch.uint8) if v_fp8 else v_codes
    decode_attention_split_kernel[(b * hkv, s)](
        q,
        k_codes,
        k_scale if k_scale is not None else dummy,
        k_zero if k_zero is not None else dummy,
        v_codes,
        v_scale if v_scale is not None else dummy,
        v_zero if v_zero is not None else dummy,
        start,
        o_part,
        l_part,
        int(end),
        s,
        hkv,
        float(scaling),
        float(softcap) if softcap else 1.0,
        *q.stride(),
        *k_codes.stride(),
        *_strides4(k_scale),
        *_strides4(k_zero),
        *v_codes.stride(),
        *_strides4(v_scale),
        *_strides4(v_zero),
        *o_str,
        *l_str,
        GQ=gq,
        GQP=max(16, triton.next_power_of_2(gq)),
        D=d,
        BT=bt,
        K_BITS=k_bits,
        V_BITS=v_bits,
        K_FP8=k_fp8,
        V_FP8=v_fp8,
        K_MODE=k_mode,
        V_MODE=v_mode,
        K_CHANNEL=k_axis == "channel",
        K_G=kg,
        V_G=vg,
        K_SCALE=k_has_s,
        K_ZERO=k_has_z,
        V_SCALE=v_has_s,
        V_ZERO=v_has_z,
        Q_SPLIT=q.dtype != torch.float16,
        SOFTCAP=bool(softcap),
        F32_DOT="ieee" if INTERPRET else "tf32x3",
        num_warps=8,
    )
    if s > 1:
        merge_splits_kernel[(b * hq,)](
            o_part,
            l_part,
            out,
            lse,
            s,
            hq,
            *o_part.stride(),
            *l_part.stride(),
            *out.stride(),
            *lse.stride(),
            D=d,
            BS=triton.next_power_of_2(s),
        )
    return out, lse
