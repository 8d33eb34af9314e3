"""A tile of a quantized store, loaded for the decode kernels: code bytes unpacked in registers, code
values as fp16 / fp32 operands, scales decoded (fp8 scales from their bytes).

``load_levels`` is what the split kernel (:mod:`kvquant.kernels.triton.decode_kernels`) and the
dequantize kernel call per tile: ``[BT, D]`` code values in channel order for every format the
Triton backend reads (integer codes by their bit pattern, fp8 decoded, codebook and trellis values
looked up in the format's table); the rest are its parts.
"""

import triton
import triton.language as tl


@triton.jit
def unpack_bytes(b_c, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Planar code bytes ``b_c [BT, W]`` as codes ``[BT, D]`` in channel order: byte ``w`` holds
    channels ``w, w + W, ...`` from the low field up (``W = D * BITS / 8``; 1, 2, 4 bits); 8 bits and
    wider as they are."""
    PB: tl.constexpr = 8 // BITS if BITS < 8 else 1
    if PB == 2:  # byte w: channel w (low nibble), channel w + W (high nibble)
        b_c = tl.join(b_c & 0xF, b_c >> 4)  # [BT, W, 2]
        b_c = tl.reshape(tl.permute(b_c, (0, 2, 1)), (BT, D))  # [BT, D]
    elif PB == 4:  # byte w: channels w, w + W, w + 2W, w + 3W from the low bit pair up
        b_c = tl.join(tl.join(b_c & 3, (b_c >> 2) & 3), tl.join((b_c >> 4) & 3, b_c >> 6))  # [BT, W, 2, 2]
        b_c = tl.reshape(tl.permute(b_c, (0, 3, 2, 1)), (BT, D))  # [BT, D]: field 2 * i3 + i2
    elif PB == 8:  # byte w: channels w + i * W at bit i
        b_lo = tl.join(tl.join(b_c & 1, (b_c >> 1) & 1), tl.join((b_c >> 2) & 1, (b_c >> 3) & 1))
        b_hi = tl.join(tl.join((b_c >> 4) & 1, (b_c >> 5) & 1), tl.join((b_c >> 6) & 1, b_c >> 7))
        b_c = tl.join(b_lo, b_hi)  # [BT, W, 2, 2, 2]: field 4 * i4 + 2 * i3 + i2
        b_c = tl.reshape(tl.permute(b_c, (0, 4, 3, 2, 1)), (BT, D))  # [BT, D]
    return b_c


@triton.jit
def unpack_codes(p_c, o_t, m_t, stride_t, stride_w, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Stored codes of tokens ``o_t`` as ``[BT, D]`` in channel order, in the store's dtype: each row's
    bytes loaded contiguously and unpacked in registers (:func:`unpack_bytes`). Masked tokens read 0."""
    PB: tl.constexpr = 8 // BITS if BITS < 8 else 1
    o_w = tl.arange(0, D // PB)
    b_c = tl.load(
        p_c + o_t[:, None] * stride_t + o_w[None, :] * stride_w, mask=m_t[:, None], other=0
    )  # [BT, W]
    return unpack_bytes(b_c, BT, D, BITS)


@triton.jit
def plane_codes(p_c, o_t, m_t, stride_t, stride_w, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                OFF: tl.constexpr, J: tl.constexpr):  # fmt: skip
    """int32 ``[BT, D]``: at channel ``d`` the code of channel ``(d - J) mod D`` in one planar plane of
    ``BITS``-bit fields (1, 2, 4, 8) that starts at byte ``OFF`` of each row, from one contiguous load
    of the row's ``W = D * BITS / 8`` bytes.

    Channel ``d = w + k W`` (byte ``w``, field ``k``) less ``J = q W + r`` is channel ``(w - r) + (k - q) W``:
    the byte ``r`` places before (circularly over the plane's ``W`` bytes), its field ``q`` below, or
    ``q + 1`` below where the byte index wrapped (``w < r``); fields wrap too (field ``-1`` is the top
    field: channel ``d - J + D``). So each loaded byte is rotated up by that many fields, then unpacked.
    """
    PB: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PB
    Q: tl.constexpr = J // W
    R: tl.constexpr = J % W
    SA: tl.constexpr = (Q % PB) * BITS  # rotation (bits) of bytes that did not wrap
    SB: tl.constexpr = ((Q + 1) % PB) * BITS  # ... and of those that did
    o_w = tl.arange(0, W)
    o_src = (o_w + (W - R)) % W
    b = tl.load(p_c + o_t[:, None] * stride_t + (OFF + o_src)[None, :] * stride_w, mask=m_t[:, None], other=0)
    b = b.to(tl.int32)  # [BT, W]
    if SA != 0 or SB != 0:
        b_a = ((b << SA) | (b >> (8 - SA))) & 0xFF
        b_b = ((b << SB) | (b >> (8 - SB))) & 0xFF
        b = tl.where((o_w < R)[None, :], b_b, b_a)
    return unpack_bytes(b, BT, D, BITS)


@triton.jit
def shifted_codes(p_c, o_t, m_t, stride_t, stride_w, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  J: tl.constexpr):  # fmt: skip
    """Integer codes (int32 ``[BT, D]``) of channels ``(d - J) mod D`` of tokens ``o_t``: 3 bits as two
    planes (the low bit pairs like 2-bit codes, then the high bits eight per byte), else one."""
    if BITS == 3:
        b_c = plane_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, 2, 0, J)
        b_c = b_c | (plane_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, 1, D // 4, J) << 2)
    else:
        b_c = plane_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, BITS, 0, J)
    return b_c


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
    """Code values of tokens ``o_t`` as fp16 ``[BT, D]`` (exact) in channel order (planar int4 / int2
    unpacked); format none's stored values as they are.

    fp8 codes arrive as their bytes (``FP8`` 1: e4m3fn, 2: e5m2) and are decoded through fp16 bit
    patterns (exact, no fp8 hardware or fp8 casts needed): e5m2 is the high byte of an fp16; e4m3's
    exponent / mantissa shifted into fp16 position is the value times 2**-8. Integer codes: :func:`codes_to_f16`.
    """
    b_c = unpack_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, BITS)
    if FP8 == 1:
        b_c = b_c.to(tl.uint16)
        b_c = ((b_c & 0x80) << 8) | ((b_c & 0x7F) << 7)
        b_v = b_c.to(tl.float16, bitcast=True) * 256.0  # exact: a power of two, e4m3 lies within fp16
    elif FP8 == 2:
        b_v = (b_c.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    elif b_c.dtype.is_floating():  # format none: the values themselves
        b_v = b_c
    else:
        b_v = codes_to_f16(b_c)
    return b_v


@triton.jit
def codes_to_f16(b_c):
    """Integer codes (int8 ``[-128, 128)``, else ``[0, 1024)``) as exact fp16, without an int-to-float
    conversion (``I2F``, which sm_90 issues at a quarter of the rate of logic ops and fp16 adds): the fp16
    of bits ``0x6400 | c`` is ``1024 + c``; signed 8-bit codes are offset by 128 first (``c ^ 0x80``)."""
    if b_c.dtype == tl.int8:
        b_u = (b_c.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16)
        b_v = (b_u | 0x6400).to(tl.float16, bitcast=True) - 1152.0
    else:
        b_v = (b_c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return b_v


@triton.jit
def load_levels(
    p_c,
    p_lut,
    o_t,
    m_t,
    stride_t,
    stride_w,
    BT: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
    LUT: tl.constexpr,
    M: tl.constexpr,
):
    """Values before scaling of tokens ``o_t`` as ``[BT, D]`` (:class:`kvquant.formats.TritonRead`):
    fp16 (exact) for codes read as they are (format none: the stored dtype), fp32 for table values.

    ``LUT`` 0: the code itself (:func:`load_codes`; 3-bit planes: :func:`shifted_codes`); 1:
    ``table[code]`` (codebooks); 2: ``table[state]``, the state of channel ``d`` being
    ``c_d | c_(d-1) << BITS | ...`` over ``M`` codes read circularly over the head (trellis): one
    contiguous load of each row's bytes per code of the state (:func:`plane_codes`), unpacked in
    registers. Masked tokens read code 0 (a valid entry).
    """
    if LUT == 0 and BITS != 3:
        b_v = load_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, BITS, FP8)
    else:
        b_c = shifted_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, BITS, 0)  # [BT, D]
        if LUT == 2:
            for j in tl.static_range(1, M):
                b_c = b_c | (shifted_codes(p_c, o_t, m_t, stride_t, stride_w, BT, D, BITS, j) << (j * BITS))
        if LUT == 0:
            b_v = codes_to_f16(b_c)
        else:
            b_v = tl.load(p_lut + b_c)  # [BT, D] fp32 table values
    return b_v


@triton.jit
def load_scale(p, mask, SFP8: tl.constexpr):
    """Scales (or zero points) at ``p`` as fp32; ``SFP8``: stored as float8_e4m3fn bytes (decoded
    through fp16 bit patterns, exact)."""
    if SFP8:
        b = tl.load(p, mask=mask, other=0).to(tl.uint16)
        b = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        v = b.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        v = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    return v
