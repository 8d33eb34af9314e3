"""Plain-torch twins of the Triton kernels: the same signatures, the spec they are tested against.

Everything here is built on :mod:`kvquant.formats` (the numeric spec) and runs on any device.

- :func:`quantize_append_ref` quantizes ``x[B, H, n, D]`` with :func:`kvquant.formats.quantize` and
  writes codes / scales / zero points into a store's preallocated buffers at buffer index ``index``.
- :func:`quantized_decode_attention_ref` dequantizes the valid range of a store with
  :func:`kvquant.formats.dequantize` and computes one-query-token attention in fp32.
- :func:`dense_decode_attention_ref` attends one query token over full-precision tokens (sinks,
  the residual tail, the new token) and returns the same ``(out, lse)`` partial.
- :func:`rotate_ref` rotates head vectors by the normalized Walsh-Hadamard matrix (the key
  transform's rotation) with the fast transform.
- :func:`merge_attention` combines partial attentions (e.g. the quantized store and the
  full-precision sink / residual tokens) by log-sum-exp.

:data:`BACKEND` offers them to :mod:`kvquant.kernels.ops` as the ``reference`` backend: every
format, every device, the last resort of every op.
"""

from __future__ import annotations

import math

import torch

from kvquant.formats import QuantizedBlock, dequantize, format_spec, is_static_scale, quantize
from kvquant.kernels.backend import (
    STEP_NEW_TOKEN,
    Backend,
    DecodeCall,
    DequantizeCall,
    EncodeCall,
    QuantizeCall,
    RotateCall,
)
from kvquant.kernels.hadamard import rotate_ref

# --------------------------------------------------------------------------------------------- shared checks


def resolve_static(
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    codes: torch.Tensor,
    axis: str,
    static_scale: bool | None,
) -> bool:
    """Whether ``scale`` is a static per-head scale ``[1, H, 1, 1]`` (read) rather than a buffer (written).

    ``static_scale=None`` infers it from the shapes: a ``[1, H, 1, 1]`` scale beside codes with more than
    one row or token. A store of batch 1 and capacity 1 with ``G == D`` is ambiguous; it is taken as a
    per-token buffer unless ``static_scale=True`` says otherwise.
    """
    if static_scale is not None:
        return bool(static_scale)
    if scale is None or zero is not None or not is_static_scale(scale, axis):
        return False
    return codes.shape[0] != 1 or codes.shape[2] != 1


def check_append(x, codes, scale, zero, index, fmt, group_size, axis) -> tuple[int, int]:
    """Validate a quantize-append call; returns ``(group_size, rows_per_block)``."""
    spec = format_spec(fmt)
    if x.dim() != 4 or codes.dim() != 4:
        raise ValueError(
            f"x / codes: expected [B, H, n, D] and [B, H, cap, W], got {tuple(x.shape)}, {tuple(codes.shape)}"
        )
    b, h, n, d = x.shape
    g = d if group_size is None else group_size
    if axis not in ("token", "channel"):
        raise ValueError(f"axis: unknown axis {axis!r}; allowed: token, channel")
    if codes.shape[:2] != (b, h):
        raise ValueError(f"codes: batch/heads {tuple(codes.shape[:2])} do not match x {(b, h)}")
    width = d if spec.code_dtype is None else spec.code_width(d)
    if codes.shape[3] != width:
        raise ValueError(f"codes: last dim {codes.shape[3]} != {width} for {fmt} with head_dim {d}")
    if index < 0 or index + n > codes.shape[2]:
        raise ValueError(
            f"index: tokens [{index}, {index + n}) do not fit a store of capacity {codes.shape[2]}"
        )
    block = 1
    if axis == "channel":
        if group_size is None:
            raise ValueError("group_size: channel-axis quantization needs a group_size (tokens per block)")
        if index % g or n % g:
            raise ValueError(
                f"index / n: channel axis needs both multiples of group_size {g}, got {index}, {n}"
            )
        block = g
    elif d % g:
        raise ValueError(f"group_size: {g} does not divide head_dim {d}")
    if spec.has_scale and scale is None:
        raise ValueError(f"scale: format {fmt} needs a scale buffer")
    if spec.has_zero and zero is None:
        raise ValueError(f"zero: format {fmt} needs a zero-point buffer")
    return g, block


# --------------------------------------------------------------------------------------------- quantize


def quantize_append_ref(
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
    encoder=None,
) -> None:
    """Quantize ``x[B, H, n, D]`` into the store buffers at buffer index ``index``, in place.

    Buffers as :class:`kvquant.store.TokenStore` allocates them: ``codes[B, H, cap, W]``, ``scale`` /
    ``zero`` ``[B, H, cap, D / G]`` (token axis) or ``[B, H, cap / G, D]`` (channel axis; ``index``
    and ``n`` multiples of ``G``). A static per-head ``scale[1, H, 1, 1]`` is read, not written (see
    :func:`resolve_static`). ``none`` copies ``x`` into ``codes``. ``encoder``: the trellis search to
    use (see :func:`kvquant.formats.quantize`; default the torch one).
    """
    g, block = check_append(x, codes, scale, zero, index, fmt, group_size, axis)
    n = x.shape[2]
    if not format_spec(fmt).has_scale:  # pass-through: a copy
        codes[:, :, index : index + n].copy_(x)
        return
    static = resolve_static(scale, zero, codes, axis, static_scale)
    q = quantize(
        x,
        fmt,
        group_size=g,
        axis=axis,
        scale_dtype=scale.dtype,
        static_scale=scale.flatten() if static else None,
        encoder=encoder,
    )
    codes[:, :, index : index + n].copy_(q.codes)
    if static:
        return
    r0, r1 = index // block, (index + n) // block
    scale[:, :, r0:r1].copy_(q.scale)
    if zero is not None:
        zero[:, :, r0:r1].copy_(q.zero)


# --------------------------------------------------------------------------------------------- attention


def _dequant_range(codes, scale, zero, fmt, group, axis, a, b, head_dim) -> torch.Tensor:
    """Dequantize buffer indices ``[a, b)`` (``a``, ``b`` block aligned) -> fp32 ``[B, H, b - a, D]``."""
    blk = 1 if axis == "token" else group
    if scale is not None and not (axis == "token" and is_static_scale(scale, axis)):
        scale = scale[:, :, a // blk : b // blk]
        zero = None if zero is None else zero[:, :, a // blk : b // blk]
    block = QuantizedBlock(codes[:, :, a:b], scale, zero)
    return dequantize(block, fmt, head_dim=head_dim, group_size=group, axis=axis, out_dtype=torch.float32)


def check_attention(q, k_codes, v_codes, start, end, k_axis, k_group) -> None:
    """Shape checks shared by the kernel launcher and the reference."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [B, Hq, D], got shape {tuple(q.shape)}")
    b, hq, _ = q.shape
    if k_codes.shape[:2] != v_codes.shape[:2] or k_codes.shape[0] != b:
        raise ValueError(
            f"k/v codes: batch/heads {tuple(k_codes.shape[:2])}, {tuple(v_codes.shape[:2])} vs q {b}"
        )
    hkv = k_codes.shape[1]
    if hq % hkv:
        raise ValueError(f"q: {hq} query heads are not a multiple of {hkv} KV heads")
    if start.shape != (b,):
        raise ValueError(f"start: expected shape [{b}], got {tuple(start.shape)}")
    if end > min(k_codes.shape[2], v_codes.shape[2]):
        raise ValueError(f"end: {end} exceeds the store capacity {min(k_codes.shape[2], v_codes.shape[2])}")
    if k_axis == "channel" and k_group is None:
        raise ValueError("k_group: channel-axis keys need a group size (tokens per block)")


def quantized_decode_attention_ref(
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
    """One-query-token attention over buffer indices ``[start[b], end)`` of a quantized store.

    ``q[B, Hq, D]`` with ``Hq = Hkv * G_q``; store tensors as :class:`kvquant.store.TokenStore` holds
    them (values always on the token axis; a static scale is ``[1, Hkv, 1, 1]``; format ``none``:
    codes are the raw tensors, scale / zero None). ``scores = scaling * q.k``, then
    ``softcap * tanh(scores / softcap)`` if ``softcap``. Returns ``out[B, Hq, D]`` fp32 (softmax-weighted
    dequantized values) and ``lse[B, Hq]`` fp32 (natural-log log-sum-exp of the scores); a row with
    ``start >= end`` gets ``out = 0``, ``lse = -inf``. ``num_splits`` is ignored (kernel tuning only);
    ``out`` / ``lse`` are optional preallocated outputs, written in place and returned.
    """
    check_attention(q, k_codes, v_codes, start, end, k_axis, k_group)
    b, hq, d = q.shape
    hkv = k_codes.shape[1]
    dev = q.device
    st = start.to(device=dev, dtype=torch.long).clamp(min=0)
    lo = int(st.min()) if b else 0
    res_o = torch.zeros(b, hq, d, dtype=torch.float32, device=dev)
    res_l = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=dev)
    if lo < end:
        kb = k_group if k_axis == "channel" else 1
        a = lo // kb * kb
        e = -(-end // kb) * kb
        k = _dequant_range(k_codes, k_scale, k_zero, k_fmt, k_group, k_axis, a, e, d)[:, :, lo - a : end - a]
        v = _dequant_range(v_codes, v_scale, v_zero, v_fmt, v_group, "token", lo, end, d)
        qf = q.float().view(b, hkv, hq // hkv, d)  # [B, Hkv, Gq, D]
        s = torch.einsum("bhgd,bhtd->bhgt", qf, k) * scaling  # [B, Hkv, Gq, T]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(lo, end, device=dev)
        s = s.masked_fill((pos[None, :] < st[:, None])[:, None, None, :], float("-inf"))
        lse_ = torch.logsumexp(s, dim=-1)  # [B, Hkv, Gq]
        p = torch.exp(s - lse_[..., None]).nan_to_num_(0.0)
        o = torch.einsum("bhgt,bhtd->bhgd", p, v)
        empty = torch.isinf(lse_)[..., None]
        res_o = torch.where(empty, 0.0, o).reshape(b, hq, d)
        res_l = lse_.reshape(b, hq)
    if out is not None:
        out.copy_(res_o)
        res_o = out
    if lse is not None:
        lse.copy_(res_l)
        res_l = lse
    return res_o, res_l


def merge_attention(
    outs: list[torch.Tensor] | tuple[torch.Tensor, ...], lses: list[torch.Tensor] | tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint key sets by log-sum-exp.

    ``outs[i][..., D]`` are softmax-normalized partial outputs, ``lses[i][...]`` their natural-log
    log-sum-exps (``-inf`` for an empty part). Returns ``(out, lse)`` in fp32 as if attention had run
    over the union of the key sets; where every part is empty, ``out = 0`` and ``lse = -inf``.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(
            f"outs / lses: need the same non-zero number of parts, got {len(outs)} and {len(lses)}"
        )
    lse = torch.stack([t.float() for t in lses])  # [P, ...]
    o = torch.stack([t.float() for t in outs])  # [P, ..., D]
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # [P, ...]; exp(-inf) = 0 for empty parts
    total = w.sum(dim=0)
    merged = (w[..., None] * torch.where(w[..., None] > 0, o, 0.0)).sum(dim=0)
    merged = torch.where(
        total[..., None] > 0, merged / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None], 0.0
    )
    out_lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(total, -math.inf))
    return merged, out_lse


def dense_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-query-token attention over full-precision tokens, as a partial to merge.

    ``q[B, Hq, D]``, ``k / v [B, Hkv, n, D]``, ``valid [B, n]`` bool (None: every token counts).
    Returns ``out[B, Hq, D]`` and ``lse[B, Hq]`` in fp32 (a row with no valid token: ``lse = -inf``,
    ``out = 0``).

    Example:
        >>> out, lse = dense_decode_attention_ref(torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8),
        ...                                       torch.randn(1, 2, 5, 8), None, 8**-0.5)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 8]), torch.Size([1, 4]))
    """
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q.float().view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    s = torch.einsum("bhgd,bhnd->bhgn", qg, k.float()) * scaling  # [B, Hkv, G, n]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if valid is not None:
        s = s.masked_fill(~valid.to(s.device)[:, None, None, :n], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G]
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("bhgn,bhnd->bhgd", torch.exp(s - lse_safe[..., None]), v.float())
    return out.reshape(b, hq, d), lse.reshape(b, hq)


# --------------------------------------------------------------------------------------------- append step


class AppendStepRef:
    """The torch twin of a cache layer's decode-step append (``ops.plan_append_step``; C:
    :class:`kvquant.kernels.cpu.step.NativeAppendStep`, the same arguments and results): the
    step's ops one by one, as the cache makes them. Raises the spec's error where a write refuses
    its values (the C step returns the stage instead); returns 5 for non-finite states, as C does.

    Example:
        >>> run = AppendStepRef(tail_k, tail_v, None, None, True, (dst_k, dst_v), None, head_dim=64)
        >>> run(k, v, tail_row=20, leave_row=4, first_index=100, move_from=-1, move_to=-1)
        0
    """

    def __init__(self, tail_k, tail_v, mean, std, rotation: bool, first: tuple, move, *, head_dim: int):
        b, h, _, d = tail_k.shape
        self.scratch = torch.empty(2, b, h, d, dtype=torch.float32)  # [2, B, H, D]
        self._tail, self._stats, self._rotation = (tail_k, tail_v), (mean, std), rotation
        self._first, self._move, self._d = first, move, head_dim

    def __call__(
        self, k, v, tail_row: int, leave_row: int, first_index: int, move_from: int, move_to: int
    ) -> int:
        if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            return 5  # (as the C step: checked first, nothing written)
        tail_k, tail_v = self._tail
        if tail_row >= 0:
            tail_k[:, :, tail_row] = k[:, :, 0]
            tail_v[:, :, tail_row] = v[:, :, 0]
        if leave_row >= 0 or leave_row == STEP_NEW_TOKEN:
            mean, std = self._stats
            if leave_row == STEP_NEW_TOKEN:
                xk, xv = k.float(), v.float()  # [B, H, 1, D]
            else:
                xk, xv = tail_k[:, :, leave_row : leave_row + 1], tail_v[:, :, leave_row : leave_row + 1]
            if mean is not None:
                xk = xk - mean
            if std is not None:
                xk = xk / std
            if self._rotation:
                xk, xv = rotate_ref(xk), rotate_ref(xv)
            self.scratch[0], self.scratch[1] = xk[:, :, 0], xv[:, :, 0]
            for x, (codes, scale, zero, fmt, group, axis, static) in zip((xk, xv), self._first, strict=True):
                quantize_append_ref(x, codes, scale, zero, first_index, fmt, group, axis, static_scale=static)
        if move_from >= 0 and self._move is not None:
            for src, dst in zip(*self._move, strict=True):
                codes, scale, zero, fmt, group, axis = src
                rows = dequantize_ref(
                    codes,
                    scale,
                    zero,
                    move_from,
                    move_from + 1,
                    fmt=fmt,
                    group=group,
                    axis=axis,
                    head_dim=self._d,
                )
                d_codes, d_scale, d_zero, d_fmt, d_group, d_axis, d_static = dst
                quantize_append_ref(
                    rows, d_codes, d_scale, d_zero, move_to, d_fmt, d_group, d_axis, static_scale=d_static
                )
        return 0


# --------------------------------------------------------------------------------------------- backend


class ReferenceBackend(Backend):
    """Plain torch on any device: every format, every layout; the spec the others are tested against."""

    name = "reference"
    devices = frozenset({"cpu", "cuda", "mps", "xpu", "meta"})

    def supports_decode(self, call: DecodeCall) -> str | None:
        return None

    def supports_quantize(self, call: QuantizeCall) -> str | None:
        return None

    def supports_encode(self, call: EncodeCall) -> str | None:
        return None

    def decode_attention(self, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, **kw):
        return quantized_decode_attention_ref(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, **kw)

    def quantize_append(self, x, codes, scale, zero, index, *, fmt, group_size, axis, static_scale) -> bool:
        quantize_append_ref(x, codes, scale, zero, index, fmt, group_size, axis, static_scale=static_scale)
        return True

    def encode(self, y: torch.Tensor, fmt: str) -> torch.Tensor:
        return encode_ref(y, fmt)

    def supports_rotate(self, call: RotateCall) -> str | None:
        return None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_ref(x)

    def supports_dequantize(self, call: DequantizeCall) -> str | None:
        return None

    def dequantize(self, codes, scale, zero, i0, i1, **kw) -> torch.Tensor:
        return dequantize_ref(codes, scale, zero, i0, i1, **kw)


def dequantize_ref(
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
    """Buffer indices ``[i0, i1)`` of a store's buffers (as :class:`kvquant.store.TokenStore` holds
    them; a static scale is ``[1, H, 1, 1]``) dequantized with :func:`kvquant.formats.dequantize`:
    fp32 ``[B, H, i1 - i0, D]``."""
    r = group if axis == "channel" else 1  # tokens per scale row
    a, b = i0 // r * r, -(-i1 // r) * r  # whole scale blocks
    if scale is not None and not is_static_scale(scale, axis):
        scale = scale[:, :, a // r : b // r]
        zero = None if zero is None else zero[:, :, a // r : b // r]
    blk = QuantizedBlock(codes[:, :, a:b], scale, zero)
    x = dequantize(blk, fmt, head_dim=head_dim, group_size=group, axis=axis, out_dtype=torch.float32)
    return x[:, :, i0 - a : i1 - a]


def encode_ref(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes ``[N, D]`` (unpacked) of ``y[N, D]`` given in units of the scale (above the zero point),
    in torch: the nearest level of a codebook, the Viterbi search of a trellis code, a rounded
    integer, an fp8 value."""
    return format_spec(fmt).encode_units(y)


BACKEND = ReferenceBackend()
