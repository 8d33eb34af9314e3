"""Decode attention over the quantized store in plain torch, chunked along the KV length.

The torch twin of the Triton kernel (:mod:`kvquant.kernels.triton`; same signature, plus ``chunk``)
and of the C kernel (:mod:`kvquant.kernels.cpu`); runs on any device. It never
builds a full-precision copy of the history: each chunk of codes is widened to float (the codes
themselves, not dequantized values), scales and zero points are folded into the query (keys) and
into the probabilities (values), and an online softmax carries the running max / sum across chunks.
Each KV head is read once for all the query heads of its GQA group.

:data:`BACKEND` offers it to :mod:`kvquant.kernels.ops` as the ``chunked`` backend: every format,
any device. It also rotates head vectors (``rotate``) with the fewest torch launches.
"""

from __future__ import annotations

import functools

import torch

from kvquant.formats import format_spec, unpack_codes
from kvquant.kernels.backend import Backend, DecodeCall, RotateCall
from kvquant.kernels.hadamard import hadamard_matrix, rotate_ref


def _codes_as_float(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes ``[B, H, c, W]`` -> float32 ``[B, H, c, D]``: the values before scaling (integer levels,
    codebook levels, trellis table values at their states, fp8 values, raw values); the scale is
    folded in like an integer's."""
    return format_spec(fmt).decode_codes(codes)


def _code_planes(codes: torch.Tensor, fmt: str) -> list[torch.Tensor]:
    """Codes ``[B, H, c, W]`` -> float32 planes whose concatenation along the last dim is the head.

    Planar integer codes come back as their planar pieces (int4: channels ``[0, D/2)`` and
    ``[D/2, D)``), each extracted from 32-bit words with one shift and mask and widened to float
    once; no concatenated copy is made.
    """
    spec = format_spec(fmt)
    if not (spec.integer and spec.planar):  # one plane: the whole head
        return [_codes_as_float(codes, fmt)]
    w = codes.shape[-1]
    if w % 4 == 0 and codes.stride(-1) == 1 and codes.storage_offset() % 4 == 0:
        words = codes.view(torch.int32)  # [B, H, c, W / 4]
        mask = int.from_bytes(bytes([(1 << spec.bits) - 1]) * 4, "little")
        return [((words >> (k * spec.bits)) & mask).view(torch.uint8).float() for k in range(spec.per_byte)]
    planes = unpack_codes(codes, spec.bits)
    return [planes[..., k * w : (k + 1) * w].float() for k in range(spec.per_byte)]


def _rows(t: torch.Tensor | None, r0: int, r1: int, b: int, h: int) -> torch.Tensor | None:
    """Scale / zero rows ``[r0, r1)``; a static ``[1, H, 1, 1]`` scale is broadcast to every row."""
    if t is None:
        return None
    if t.shape[0] == 1 and t.shape[2] == 1 and t.shape[3] == 1:
        return t.float().expand(b, h, r1 - r0, 1)
    return t[:, :, r0:r1].float()


def _key_scores(qg, kf, scale, zero, axis, group, c0, c1):
    """Raw ``q . k_dequant`` for a chunk: ``qg[B, Hkv, G, D]``, ``kf[B, Hkv, c, D]`` -> ``[B, Hkv, G, c]``."""
    b, h, c, d = kf.shape
    if scale is None:  # pass-through
        return qg @ kf.transpose(-1, -2)
    if axis == "channel":
        r0, r1 = c0 // group, c1 // group
        s, z = _rows(scale, r0, r1, b, h), _rows(zero, r0, r1, b, h)  # [B, Hkv, nb, D]
        q_fold = qg[:, :, :, None, :] * s[:, :, None]  # [B, Hkv, G, nb, D]
        raw = torch.einsum("bhgnd,bhnkd->bhgnk", q_fold, kf.view(b, h, r1 - r0, group, d))
        if z is not None:
            raw = raw + torch.einsum("bhgd,bhnd->bhgn", qg, z)[..., None]
        return raw.reshape(*raw.shape[:3], c)
    s, z = _rows(scale, c0, c1, b, h), _rows(zero, c0, c1, b, h)  # [B, Hkv, c, ng]
    ng = s.shape[-1]
    if ng == 1:
        raw = (qg @ kf.transpose(-1, -2)) * s[..., 0][:, :, None]
        if z is not None:
            raw = raw + qg.sum(-1, keepdim=True) * z[..., 0][:, :, None]
        return raw
    gs = d // ng
    q_n = qg.view(*qg.shape[:3], ng, gs)
    raw = torch.einsum("bhgnd,bhcnd->bhgcn", q_n, kf.view(b, h, c, ng, gs))
    raw = (raw * s[:, :, None]).sum(-1)
    if z is not None:
        raw = raw + torch.einsum("bhgn,bhcn->bhgc", q_n.sum(-1), z)
    return raw


def _value_out(p, vf, scale, zero, c0, c1):
    """``sum_t p_t v_dequant_t``: ``p[B, Hkv, G, c]``, ``vf[B, Hkv, c, D]`` -> ``[B, Hkv, G, D]``."""
    b, h, c, d = vf.shape
    if scale is None:
        return p @ vf
    s, z = _rows(scale, c0, c1, b, h), _rows(zero, c0, c1, b, h)  # [B, Hkv, c, ng]
    ng = s.shape[-1]
    if ng == 1:
        out = (p * s[..., 0][:, :, None]) @ vf
        if z is not None:
            out = out + (p @ z)
        return out
    gs = d // ng
    ps = p[..., None] * s[:, :, None]  # [B, Hkv, G, c, ng]
    out = torch.einsum("bhgcn,bhcnd->bhgnd", ps, vf.view(b, h, c, ng, gs))
    if z is not None:
        out = out + torch.einsum("bhgc,bhcn->bhgn", p, z)[..., None]
    return out.reshape(*out.shape[:3], d)


def _key_scores_planes(qg, planes, scale, zero, c0, c1):
    """``_key_scores`` for one scale per (token, head), plane by plane: ``[B, Hkv, G, c]``."""
    raw, off = None, 0
    for plane in planes:
        w = plane.shape[-1]
        part = qg[..., off : off + w] @ plane.transpose(-1, -2)
        raw = part if raw is None else raw + part
        off += w
    if scale is None:
        return raw
    b, h = planes[0].shape[:2]
    raw = raw * _rows(scale, c0, c1, b, h)[..., 0][:, :, None]
    if zero is not None:
        raw = raw + qg.sum(-1, keepdim=True) * _rows(zero, c0, c1, b, h)[..., 0][:, :, None]
    return raw


def _value_out_planes(p, planes, scale, zero, c0, c1):
    """``_value_out`` for one scale per (token, head), plane by plane: ``[B, Hkv, G, D]``."""
    b, h = planes[0].shape[:2]
    ps = p if scale is None else p * _rows(scale, c0, c1, b, h)[..., 0][:, :, None]
    out = torch.cat([ps @ plane for plane in planes], dim=-1) if len(planes) > 1 else ps @ planes[0]
    if zero is not None:
        out = out + p @ _rows(zero, c0, c1, b, h)
    return out


def decode_attention_torch(
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
    k_group: int,
    v_group: int,
    k_axis: str,
    start: torch.Tensor,
    end: int,
    scaling: float,
    softcap: float | None = None,
    chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per row over store buffer indices ``[start[b], end)``.

    Args:
        q: ``[B, Hq, D]``, ``Hq`` a multiple of the store's ``Hkv``.
        k_codes / v_codes, k_scale / v_scale, k_zero / v_zero: the store's buffers (see
            :mod:`kvquant.store`); scales may be static ``[1, Hkv, 1, 1]``.
        start: ``[B]`` first valid buffer index of each row; ``end``: exclusive end for all rows.
        chunk: tokens widened to float at a time (rounded to whole key blocks).

    Returns:
        ``out[B, Hq, D]`` fp32 (zeros for an empty row) and ``lse[B, Hq]`` fp32 (natural-log
        sum of exp of the scores; ``-inf`` for an empty row), to merge with other partials.
    """
    b, hq, d = q.shape
    hkv = k_codes.shape[1]
    g = hq // hkv
    qg = q.float().view(b, hkv, g, d)
    m = torch.full((b, hkv, g), float("-inf"), device=q.device)
    l_sum = torch.zeros(b, hkv, g, device=q.device)
    acc = torch.zeros(b, hkv, g, d, device=q.device)
    block = k_group if k_axis == "channel" else 1
    lo = int(start.min()) if start.numel() else end
    lo = lo // block * block
    chunk = max(block, chunk // block * block)
    start = start.to(q.device)
    start_max = int(start.max()) if start.numel() else end
    # one scale per (token, head): work plane by plane, no unpacked copy of the chunk
    k_fast = k_axis == "token" and (k_scale is None or k_scale.shape[-1] == 1)
    v_fast = v_scale is None or v_scale.shape[-1] == 1
    for c0 in range(lo, end, chunk):
        c1 = min(end, c0 + chunk)
        if k_fast:
            scores = _key_scores_planes(
                qg, _code_planes(k_codes[:, :, c0:c1], k_fmt), k_scale, k_zero, c0, c1
            )
        else:
            kf = _codes_as_float(k_codes[:, :, c0:c1], k_fmt)
            scores = _key_scores(qg, kf, k_scale, k_zero, k_axis, k_group, c0, c1)
        scores = scores * scaling  # [B, Hkv, G, c]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if start_max > c0:  # some row starts inside this chunk (left padding, sinks, windows)
            pos = torch.arange(c0, c1, device=q.device)
            valid = (pos[None, :] >= start[:, None])[:, None, None, :]  # [B, 1, 1, c]
            scores = scores.masked_fill(~valid, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - m_safe[..., None])
        corr = torch.exp(m - m_safe)
        l_sum = l_sum * corr + p.sum(-1)
        if v_fast:
            pv = _value_out_planes(p, _code_planes(v_codes[:, :, c0:c1], v_fmt), v_scale, v_zero, c0, c1)
        else:
            pv = _value_out(p, _codes_as_float(v_codes[:, :, c0:c1], v_fmt), v_scale, v_zero, c0, c1)
        acc = acc * corr[..., None] + pv
        m = m_new
    # an empty row gives zeros; a NaN score (NaN in q or the store) stays NaN, as in sdpa
    out = torch.where(l_sum[..., None] == 0, torch.zeros_like(acc), acc / l_sum.clamp_min(1e-30)[..., None])
    lse = m + torch.log(l_sum)
    return out.view(b, hq, d), lse.view(b, hq)


class ChunkedBackend(Backend):
    """:func:`decode_attention_torch` as a backend: every format and layout, any device."""

    name = "chunked"
    devices = frozenset({"cpu", "cuda", "mps", "xpu"})

    def supports_decode(self, call: DecodeCall) -> str | None:
        return None

    def decode_attention(self, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, **kw):
        return decode_attention_torch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, **kw)

    def supports_rotate(self, call: RotateCall) -> str | None:
        return None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_torch(x)


# at or above this many head vectors the rotation runs as the fast transform (log2(D) passes over the
# data); below it, one product with the cached matrix costs fewer kernel launches
FWHT_MIN_ROWS = 4096


@functools.lru_cache(maxsize=32)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    return hadamard_matrix(d, device)  # [D, D], built once per device, never copied per call


def rotate_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`kvquant.kernels.reference.rotate_ref` in as few kernel launches as torch allows: one
    product with the cached matrix for a few rows (equal to the twin up to fp32 rounding), the fast
    transform for many."""
    if x.numel() // x.shape[-1] >= FWHT_MIN_ROWS:
        return rotate_ref(x)
    return x @ _hadamard(x.shape[-1], x.device)


BACKEND = ChunkedBackend()
