"""Small pieces shared by the kernels: Triton helpers (rounding, fp8 encoding) and launch-side constants.

Rounding is done with integer and floor arithmetic rather than casts wherever the result must be
bit-identical to :mod:`kvquant.formats` on every backend: Triton's interpreter casts fp32 -> fp8 and
fp32 -> bf16 by truncation (not round-to-nearest-even) and cannot be trusted for codes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Whether the @triton.jit decorators below ran in interpreter mode (Triton reads TRITON_INTERPRET
# when a function is decorated, i.e. when this package is imported).
try:
    from triton import knobs

    INTERPRET = bool(knobs.runtime.interpret)
except ImportError:  # pragma: no cover - triton < 3.4
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SCALE_KIND = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3}


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def level_table(read, like: torch.Tensor) -> torch.Tensor:
    """The level table of a format's :class:`~kvquant.formats.TritonRead` on ``like``'s device, copied
    there once (``like`` itself, as a pointer never read, where the format has none)."""
    if read.table is None:
        return like
    key = (id(read.table), like.device)
    if key not in _TABLES:
        _TABLES[key] = read.table.to(like.device).contiguous()
    return _TABLES[key]


def as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """fp8 buffers (codes, scales) as their bytes: the kernels decode them, no fp8 loads needed."""
    return t.view(torch.uint8) if t is not None and t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


@triton.jit
def rint(x):
    """Round half to even (``torch.round``) for fp32 ``|x| < 2**22``, with floor arithmetic only."""
    fl = tl.floor(x)
    d = x - fl  # exact
    odd = (fl.to(tl.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    return fl + up.to(tl.float32)


@triton.jit
def round_to_scale_dtype(x, SCALE_KIND: tl.constexpr, UP: tl.constexpr):
    """fp32 ``x`` rounded to the scale dtype up (``UP``) or down, returned as fp32 (exact in that dtype).

    ``formats.round_to_dtype``: cast, then step one ulp outward if the cast went the wrong way. Any
    cast that lands on one of the two neighbours works (RNE on GPU, truncation in the interpreter).
    float8_e4m3fn (``SCALE_KIND`` 3): the nearest byte by integer arithmetic, stepped the same way;
    beyond the largest finite value (448) it is NaN, as in the spec.
    """
    if SCALE_KIND == 0:
        r = x
    elif SCALE_KIND == 3:
        a = tl.minimum(tl.abs(x), 448.0)
        bits = fp8_bits(tl.where(x < 0, -a, a), 3, 7)  # nearest (int32)
        mag = bits & 0x7F
        bits = tl.where(mag == 0, 0, bits)  # -0 -> +0 (the spec's grid holds one zero)
        v = e4m3_value(bits)
        neg = bits >= 0x80
        if UP:
            step = tl.where(neg, bits - 1, mag + 1)  # toward +inf
            wrong = v < x
        else:
            step = tl.where(neg | (mag == 0), 0x80 | (mag + 1), bits - 1)  # toward -inf
            wrong = v > x
        bits = tl.where(wrong, step, bits)
        bits = tl.where(bits == 0x80, 0, bits)
        r = tl.where((x != x) | ((bits & 0x7F) == 0x7F), float("nan"), e4m3_value(bits))
    else:
        if SCALE_KIND == 1:
            y = x.to(tl.float16)
        else:
            y = x.to(tl.bfloat16)
        yf = y.to(tl.float32)
        if UP:
            wrong = yf < x
        else:
            wrong = yf > x
        bits = y.to(tl.int16, bitcast=True).to(tl.int32)
        neg = bits < 0
        if UP:
            step = tl.where(neg, -1, 1)
        else:
            step = tl.where(neg, 1, -1)
        bits = (bits + tl.where(wrong, step, 0)).to(tl.int16)
        if SCALE_KIND == 1:
            r = bits.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            r = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return r


@triton.jit
def e4m3_value(bits):
    """fp32 value of float8_e4m3fn bits (int32 in [0, 255], not NaN): exact, through fp16 bit patterns."""
    b = bits.to(tl.uint16)
    b = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return b.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def e4m3_bits(v):
    """Bits (int32) of an fp32 value that float8_e4m3fn holds exactly, or NaN (0x7F); +0 for zero."""
    ok = v == v
    bits = fp8_bits(tl.where(ok, v, 0.0), 3, 7)
    bits = tl.where((bits & 0x7F) == 0, 0, bits)
    return tl.where(ok, bits, 0x7F)


@triton.jit
def fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Bits (int32 in [0, 255]) of fp32 ``y`` cast to fp8 with ``MANT`` mantissa bits, round to nearest even.

    ``y`` must be finite with ``|y|`` at most the format's largest finite value (the quantizer clamps
    first), so there is no overflow / NaN handling. Matches ``torch.Tensor.to(torch.float8_*)``.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a_bits = bits & 0x7FFFFFFF
    # normal range: drop 23 - MANT mantissa bits, ties to even (a carry moves into the exponent)
    lsb = (a_bits >> (23 - MANT)) & 1
    mag_n = ((a_bits + ((1 << (22 - MANT)) - 1) + lsb) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # subnormal range: multiples of 2**(1 - BIAS - MANT); exact power-of-two scaling, then rint
    a_s = tl.abs(y) * (1 << (BIAS - 1 + MANT))
    mag_s = rint(tl.minimum(a_s, 1 << MANT)).to(tl.int32)  # clamped: no int overflow where unused
    mag = tl.where(a_s < (1 << MANT), mag_s, mag_n)
    return (sign << 7) | mag


@triton.jit
def nonfinite(b):
    """1 where ``b`` is NaN or +-inf, else 0 (int32)."""
    return ((b != b) | (tl.abs(b) == float("inf"))).to(tl.int32)


@triton.jit
def store_codes(p_c, b_q, m_t, stride_cw, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Store ``BT`` rows of codes ``b_q [BT, D]`` (int32, channel order) at ``p_c [BT, 1]`` (row
    pointers; ``m_t [BT]`` the rows to write), packed planar: byte ``j`` holds channels ``j, j + W, ...``
    (``W = D * BITS / 8``); 3 bits as two planes, the low bit pairs like 2-bit codes, then the high
    bits 8 per byte; 8 bits and wider one code per element."""
    if BITS == 3:
        b_lo = tl.sum(tl.reshape(b_q & 3, (BT, 4, D // 4)) << (tl.arange(0, 4) * 2)[None, :, None], axis=1)
        b_hi = tl.sum(tl.reshape(b_q >> 2, (BT, 8, D // 8)) << tl.arange(0, 8)[None, :, None], axis=1)
        o_lo, o_hi = tl.arange(0, D // 4), D // 4 + tl.arange(0, D // 8)
        tl.store(p_c + o_lo[None, :] * stride_cw, b_lo.to(p_c.dtype.element_ty), mask=m_t[:, None])
        tl.store(p_c + o_hi[None, :] * stride_cw, b_hi.to(p_c.dtype.element_ty), mask=m_t[:, None])
    else:
        PB: tl.constexpr = 8 // BITS if BITS < 8 else 1
        W: tl.constexpr = D // PB
        if PB > 1:
            b_q = tl.sum(tl.reshape(b_q, (BT, PB, W)) << (tl.arange(0, PB) * BITS)[None, :, None], axis=1)
        tl.store(p_c + tl.arange(0, W)[None, :] * stride_cw, b_q.to(p_c.dtype.element_ty), mask=m_t[:, None])
