"""One dispatch per op: ``quantize_append``, ``decode_attention``, ``dequantize``, ``transcode``, ``encode``,
``rotate``.

Each op has one signature, shared by all its backends. A call is described by a small record
(:mod:`kvquant.kernels.backend`: formats, head size, device, scale dtypes), and the first backend
that supports it runs, in the order ``triton`` (CUDA) > ``cpu`` (the C kernels) > ``chunked``
(torch, any device) > ``reference`` (the plain-torch spec). Callers never branch on backends or on
format kinds; :func:`backend_for` says which backend a call would take (benches, tests, reports),
and ``backend=`` forces one (tests; Triton then also runs on CPU under ``TRITON_INTERPRET=1``).
The choosing itself is :mod:`kvquant.kernels.dispatch`; every call goes through the ops here.

Example:
    >>> from kvquant.kernels import ops
    >>> codes = torch.zeros(1, 2, 16, 32, dtype=torch.uint8)             # int4, head_dim 64
    >>> scale, zero = torch.ones(1, 2, 16, 1, dtype=torch.float16), torch.zeros(1, 2, 16, 1, dtype=torch.float16)
    >>> ops.quantize_append(torch.randn(1, 2, 5, 64), codes, scale, zero, 0, fmt="int4", group_size=64)
    >>> out, lse = ops.decode_attention(torch.randn(1, 4, 64), codes, scale, zero, codes, scale, zero,
    ...     k_fmt="int4", v_fmt="int4", k_group=64, v_group=64, k_axis="token",
    ...     start=torch.zeros(1, dtype=torch.long), end=5, scaling=0.125)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 64]), torch.Size([1, 4]))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvquant.kernels.backend import (
    Backend,
    DecodeCall,
    SegmentRead,
    TranscodeCall,
    check_finite,
    raise_deferred,
)
from kvquant.kernels.dispatch import OPS, backend_for, backends, pick, supporting, why_unsupported
from kvquant.kernels.reference import dense_decode_attention_ref, merge_attention

# --------------------------------------------------------------------------------------------- quantize


def quantize_append(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    index: int,
    *,
    fmt: str,
    group_size: int | None,
    axis: str = "token",
    static_scale: bool = False,
    backend: str | None = None,
) -> None:
    """Quantize ``x[B, H, n, D]`` (any float dtype) into a store's buffers at buffer index ``index``.

    Buffers: ``codes [B, H, cap, W]``; ``scale`` / ``zero`` ``[B, H, cap, D / G]`` (token axis) or
    ``[B, H, cap / G, D]`` (channel axis; ``index`` and ``n`` multiples of ``G``); with
    ``static_scale=True`` ``scale`` is a ``[1, H, 1, 1]`` per-head scale that is read, not written.
    Codes, scales and zero points are bit-identical to :func:`kvquant.formats.quantize` on every
    backend.

    Bad values (NaN / Inf in ``x``, a scale the scale dtype cannot hold) raise the spec's
    ``ValueError`` and leave nothing the caller counts as written, except on CUDA: there the Triton
    kernel writes without looking and a device-side flag records the fault without a host sync;
    :func:`raise_deferred` raises it at the next point that syncs anyway (the cache calls it there).

    Example:
        >>> x = torch.randn(1, 2, 4, 64)
        >>> codes = torch.empty(1, 2, 8, 64, dtype=torch.int8)
        >>> scale = torch.empty(1, 2, 8, 1, dtype=torch.float16)
        >>> quantize_append(x, codes, scale, None, 0, fmt="int8", group_size=64)
    """
    if x.dim() != 4:
        raise ValueError(f"x: expected [B, H, n, D], got shape {tuple(x.shape)}")
    d = x.shape[-1]
    g = d if group_size is None else group_size
    call = (fmt, d, x.device.type, g, axis, None if scale is None else scale.dtype, bool(static_scale))
    kw = dict(fmt=fmt, group_size=group_size, axis=axis, static_scale=bool(static_scale))
    for b in pick("quantize_append", call, backend):
        if b.quantize_append(x, codes, scale, zero, index, **kw):
            return
    # every backend refused these values: the reference raises the spec's error
    from kvquant.kernels.reference import BACKEND as reference

    reference.quantize_append(x, codes, scale, zero, index, **kw)


def plan_quantize_append(
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    *,
    fmt: str,
    group_size: int | None,
    head_dim: int,
    axis: str = "token",
    static_scale: bool = False,
    backend: str | None = None,
) -> Callable[[torch.Tensor, int], None]:
    """:func:`quantize_append` into buffers that stay put, planned once for many calls (a store's
    appends): returns ``run(x, index)``, the effect of :func:`quantize_append` of ``x [B, H, n,
    head_dim]`` at ``index`` (same codes, same errors). The backend is picked here; one that plans
    (``Backend.plan_quantize``: the C kernels, which describe the buffers once) writes each call
    directly and hands values it refuses to :func:`quantize_append`, which raises the spec's error.

    Example:
        >>> run = plan_quantize_append(codes, scale, None, fmt="int8", group_size=64, head_dim=64)
        >>> run(torch.randn(1, 2, 1, 64), 3)
    """
    g = head_dim if group_size is None else group_size
    sdt = None if scale is None else scale.dtype
    call = (fmt, head_dim, codes.device.type, g, axis, sdt, bool(static_scale))
    kw = dict(fmt=fmt, group_size=group_size, axis=axis, static_scale=bool(static_scale))
    b = next(pick("quantize_append", call, backend), None)
    write = None if b is None else b.plan_quantize(codes, scale, zero, **kw)

    def run(x: torch.Tensor, index: int) -> None:
        if write is None or x.dim() != 4 or x.shape[-1] != head_dim or not write(x, index):
            quantize_append(x, codes, scale, zero, index, **kw, backend=backend)  # (refused: the error)

    return run


# --------------------------------------------------------------------------------------------- decode


def _reads_segments(b: Backend, extra: tuple[SegmentRead, ...], d: int, device: str, forced: bool) -> bool:
    """Whether backend ``b`` reads every segment of ``extra`` in the same call as the main one."""
    if not b.takes_segments:
        return False
    if forced:
        return all(
            why_unsupported(b, "decode_attention", DecodeCall(*s.call_fields(d, device)), True) is None
            for s in extra
        )
    return all(b in supporting("decode_attention", s.call_fields(d, device)) for s in extra)


def _decode_fields(k_fmt, v_fmt, d, device, k_axis, k_group, v_group, k_scale, v_scale, fp) -> tuple:
    """The fields of the :class:`DecodeCall` of a decode over these buffers, in order."""
    k_sdt = None if k_scale is None else k_scale.dtype
    v_sdt = None if v_scale is None else v_scale.dtype
    return (k_fmt, v_fmt, d, device, k_axis, k_group, v_group, k_sdt, v_sdt, fp)


def decode_attention(
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
    fp_k: torch.Tensor | None = None,
    fp_v: torch.Tensor | None = None,
    fp_valid: torch.Tensor | None = None,
    extra: tuple[SegmentRead, ...] = (),
    rotation: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-query-token attention over buffer indices ``[start[b], end)`` of a quantized store, plus
    full-precision tokens and more quantized segments in the same softmax.

    Args:
        q: ``[B, Hq, D]``, ``Hq`` a multiple of the store's ``Hkv``.
        k_codes ... v_zero: the store's buffers (codes ``[B, Hkv, cap, W]``; scales per token
            ``[B, Hkv, cap, D / G]``, per channel ``[B, Hkv, cap / G, D]`` or static ``[1, Hkv, 1, 1]``).
        start: int64 ``[B]`` first valid buffer index per row; ``end``: exclusive end for every row.
        fp_k / fp_v: ``[B, Hkv, n, D]`` full-precision tokens (sinks, the residual tail, the new
            token), ``fp_valid [B, n]`` bool (None: all valid). A backend that cannot take them
            (Triton, chunked, reference) gets the store alone; their dense partial is merged here
            by log-sum-exp. The C backend takes them in the same kernel call.
        extra: more quantized segments (:class:`SegmentRead`; the recent window), attended in the
            same softmax: in the same kernel call by a backend that reads them all (C), else each
            through its own dispatch and merged here by log-sum-exp.
        rotation: the stores (main and ``extra``) hold Hadamard-rotated vectors (:func:`rotate`; the
            key transform's rotation) while ``q``, the fp tokens and the output are in the model's
            space: the C backend rotates them in its kernel call, for the others the op rotates
            ``q`` and the fp tokens in and the output back. The lse is that of the same scores.

    Returns:
        ``out [B, Hq, D]`` fp32 and ``lse [B, Hq]`` fp32 (natural log; nothing to attend:
        ``out = 0``, ``lse = -inf``).
    """
    fp = fp_k is not None and fp_k.shape[2] > 0
    call = _decode_fields(
        k_fmt, v_fmt, q.shape[-1], q.device.type, k_axis, k_group, v_group, k_scale, v_scale, fp
    )
    b = next(pick("decode_attention", call, backend))
    kw = dict(
        k_fmt=k_fmt,
        v_fmt=v_fmt,
        k_group=k_group,
        v_group=v_group,
        k_axis=k_axis,
        start=start,
        end=end,
        scaling=scaling,
        softcap=softcap,
    )
    tensors = (q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    one_call = not extra or _reads_segments(b, extra, q.shape[-1], q.device.type, forced=backend is not None)
    if rotation:
        _check_rotation(q.shape[-1])
    if rotation and not (b.takes_rotation and one_call):
        fp_r = dict(fp_k=rotate(fp_k.float()), fp_v=rotate(fp_v.float())) if fp else {}
        kw_r = dict(kw, fp_valid=fp_valid, extra=extra, backend=backend)
        out, lse = decode_attention(rotate(q.float()), *tensors[1:], **kw_r, **fp_r)
        return rotate(out), lse
    if rotation:
        kw["rotation"] = True
    if extra:
        if one_call:
            fp_kw = dict(fp_k=fp_k, fp_v=fp_v, fp_valid=fp_valid) if fp else {}
            return b.decode_attention(*tensors, **kw, **fp_kw, extra=extra)
        parts = [decode_attention(*tensors, **kw, fp_k=fp_k, fp_v=fp_v, fp_valid=fp_valid, backend=backend)]
        for s in extra:
            s_kw = dict(kw, **s.call_kwargs())
            parts.append(decode_attention(q, *s.tensors(), **s_kw, backend=backend))
        return merge_attention([o for o, _ in parts], [lse for _, lse in parts])
    if fp and b.takes_fp_tokens:
        return b.decode_attention(*tensors, **kw, fp_k=fp_k, fp_v=fp_v, fp_valid=fp_valid)
    out, lse = b.decode_attention(*tensors, **kw)
    if not fp:
        return out, lse
    f_out, f_lse = dense_decode_attention_ref(q, fp_k, fp_v, fp_valid, scaling, softcap)
    return merge_attention([out, f_out], [lse, f_lse])


def plan_decode_attention(
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
    head_dim: int,
    scaling: float,
    softcap: float | None = None,
    fp_tokens: bool = False,
    extra: tuple[SegmentRead, ...] = (),
    rotation: bool = False,
    backend: str | None = None,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`decode_attention` over buffers that stay put, planned once for many calls (a cache's
    decode steps): returns ``run(q, start, end, *, fp_k=None, fp_v=None, fp_valid=None,
    extra_bounds=())``, the result of :func:`decode_attention` with these arguments, where
    ``extra_bounds`` gives each ``extra`` segment's ``(start, end)`` for the call (those in
    ``extra`` are ignored) and ``fp_tokens`` says whether calls pass full-precision tokens.

    The backend is picked here, as :func:`decode_attention` would pick it; one that plans
    (``Backend.plan_decode``: the C kernels, which describe the buffers once) runs each call
    directly, otherwise each call goes through :func:`decode_attention`.

    Example:
        >>> run = plan_decode_attention(*k_parts, *v_parts, k_fmt="int4", v_fmt="int4", k_group=64,
        ...     v_group=64, k_axis="token", head_dim=64, scaling=0.125)
        >>> out, lse = run(q, start, end)                       # q [B, Hq, D]; start [B] int64
    """
    if rotation:
        _check_rotation(head_dim)
    tensors = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    kw = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, k_axis=k_axis)
    device = k_codes.device.type
    call = _decode_fields(
        k_fmt, v_fmt, head_dim, device, k_axis, k_group, v_group, k_scale, v_scale, fp_tokens
    )
    b = next(pick("decode_attention", call, backend), None)
    run = None
    if (
        b is not None
        and (not extra or _reads_segments(b, extra, head_dim, device, forced=backend is not None))
        and (b.takes_rotation or not rotation)
        and (b.takes_fp_tokens or not fp_tokens)
    ):  # b answers every call in one piece: it may plan it
        run = b.plan_decode(
            *tensors,
            **kw,
            head_dim=head_dim,
            scaling=scaling,
            softcap=softcap,
            extra=extra,
            rotation=rotation,
        )
    if run is not None:
        return run

    def run(q, start, end, *, fp_k=None, fp_v=None, fp_valid=None, extra_bounds=()):
        segments = tuple(replace(x, start=s, end=e) for x, (s, e) in zip(extra, extra_bounds, strict=True))
        return decode_attention(
            q, *tensors, **kw, start=start, end=end, scaling=scaling, softcap=softcap, fp_k=fp_k,
            fp_v=fp_v, fp_valid=fp_valid, extra=segments, rotation=rotation, backend=backend,
        )  # fmt: skip

    return run


# --------------------------------------------------------------------------------------------- dequantize


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    i0: int,
    i1: int,
    *,
    fmt: str,
    group: int,
    axis: str = "token",
    head_dim: int,
    backend: str | None = None,
) -> torch.Tensor:
    """Buffer indices ``[i0, i1)`` of a store's buffers (``codes[B, H, cap, W]``, ``scale`` /
    ``zero`` as :class:`kvquant.store.TokenStore` holds them) dequantized: fp32 ``[B, H, i1 - i0, D]``,
    the values of :func:`kvquant.formats.dequantize` bit for bit on every backend. What a tier reads
    when its oldest tokens move on to the next tier (and the dequantizing attention path).

    Example:
        >>> codes = torch.zeros(1, 2, 16, 32, dtype=torch.uint8)             # int4, head_dim 64
        >>> scale, zero = torch.ones(1, 2, 16, 1, dtype=torch.float16), torch.zeros(1, 2, 16, 1, dtype=torch.float16)
        >>> dequantize(codes, scale, zero, 3, 7, fmt="int4", group=64, head_dim=64).shape
        torch.Size([1, 2, 4, 64])
    """
    if not (0 <= i0 <= i1 and (i1 == i0 or i1 <= codes.shape[2])):  # an empty range may lie anywhere
        raise ValueError(f"i0, i1: need 0 <= i0 <= i1 <= {codes.shape[2]} (the buffer), got {i0}, {i1}")
    sdt = None if scale is None else scale.dtype
    fields = (fmt, head_dim, codes.device.type, axis, sdt)
    kw = dict(fmt=fmt, group=group, axis=axis, head_dim=head_dim)
    return next(pick("dequantize", fields, backend)).dequantize(codes, scale, zero, i0, i1, **kw)


def transcode(
    src: tuple,
    i0: int,
    i1: int,
    dst: tuple,
    index: int,
    *,
    via: torch.dtype,
    head_dim: int,
    backend: str | None = None,
) -> None:
    """Move a store's buffer indices ``[i0, i1)`` into another store at ``index``: what a tier's
    oldest tokens cost when they age into the next (the recent window into the main store).

    ``src = (codes, scale, zero, fmt, group, axis)`` as :func:`dequantize` takes them; ``dst =
    (codes, scale, zero, fmt, group_size, axis, static_scale)`` as :func:`quantize_append` takes
    them. The result is exactly ``quantize_append(dequantize(src, i0, i1).to(via), *dst, index)``,
    the torch twin, bit for bit: one C call on CPU; elsewhere those two ops, each on its own
    backend. Values the destination refuses raise its spec's ``ValueError``, as there.

    Example:
        >>> src = (codes4, scale4, zero4, "int4", 64, "token")   # an int4 store, head_dim 64
        >>> dst = (codes2, scale2, zero2, "int2", 64, "token", False)
        >>> transcode(src, 3, 4, dst, 10, via=torch.float32, head_dim=64)
    """
    codes, scale, zero, fmt, group, axis = src
    d_codes, d_scale, d_zero, d_fmt, d_group, d_axis, d_static = dst
    if not (0 <= i0 <= i1 <= codes.shape[2]):
        raise ValueError(f"i0, i1: need 0 <= i0 <= i1 <= {codes.shape[2]} (the buffer), got {i0}, {i1}")
    if i1 == i0:
        return
    sdt = None if scale is None else scale.dtype
    dsdt = None if d_scale is None else d_scale.dtype
    fields = (fmt, d_fmt, head_dim, codes.device.type, axis, sdt, d_axis, dsdt, bool(d_static))
    if backend is None:
        movers = pick("transcode", fields, None)
    else:  # forced: its own transcode where it has one, else its dequantize and quantize_append
        call = TranscodeCall(*fields)
        movers = [
            b
            for b in backends()
            if b.name == backend
            and why_unsupported(b, "transcode", call, True) is None
            and b.available() is None
        ]
    for b in movers:
        if b.transcode(src, i0, i1, dst, index, via=via, head_dim=head_dim):
            return
    rows = dequantize(
        codes, scale, zero, i0, i1, fmt=fmt, group=group, axis=axis, head_dim=head_dim, backend=backend
    )
    quantize_append(
        rows.to(via), d_codes, d_scale, d_zero, index, fmt=d_fmt, group_size=d_group, axis=d_axis,
        static_scale=d_static, backend=backend,
    )  # fmt: skip


def plan_transcode(
    src: tuple, dst: tuple, *, via: torch.dtype, head_dim: int, backend: str | None = None
) -> Callable[[int, int, int], None]:
    """:func:`transcode` between buffers that stay put, planned once for many calls (the recent
    window's oldest tokens into the main store, step after step): returns ``run(i0, i1, index)``,
    the effect of :func:`transcode` of ``src``'s indices ``[i0, i1)`` into ``dst`` at ``index``. A
    backend that plans (``Backend.plan_transcode``: the C kernels) moves each call directly and
    hands what it refuses to :func:`transcode` (the destination spec's error), else each call goes
    through :func:`transcode`.

    Example:
        >>> run = plan_transcode(src, dst, via=torch.float32, head_dim=64)   # as transcode takes them
        >>> run(3, 4, 10)
    """
    codes, scale, _, fmt, _, axis = src
    d_scale, d_fmt, d_axis, d_static = dst[1], dst[3], dst[5], dst[6]
    move = None
    if backend is None:
        fields = (
            fmt,
            d_fmt,
            head_dim,
            codes.device.type,
            axis,
            None if scale is None else scale.dtype,
            d_axis,
            None if d_scale is None else d_scale.dtype,
            bool(d_static),
        )
        b = next(pick("transcode", fields, None), None)
        move = None if b is None else b.plan_transcode(src, dst, via=via, head_dim=head_dim)

    def run(i0: int, i1: int, index: int) -> None:
        if move is None or not (0 <= i0 < i1 <= codes.shape[2]) or not move(i0, i1, index):
            transcode(src, i0, i1, dst, index, via=via, head_dim=head_dim, backend=backend)

    return run


# --------------------------------------------------------------------------------------------- encode


def encode(y: torch.Tensor, fmt: str, *, backend: str | None = None) -> torch.Tensor:
    """Codes ``[N, D]`` (uint8, one per element, unpacked) of ``y[N, D]`` in units of the scale: the
    nearest level of a codebook, the Viterbi search of a trellis code. C on CPU where built, torch
    otherwise: the same codes.

    Example:
        >>> encode(torch.randn(3, 64), "tcq2").shape
        torch.Size([3, 64])
    """
    if y.dim() != 2:
        raise ValueError(f"y: expected [N, D], got shape {tuple(y.shape)}")
    return next(pick("encode", (fmt, y.shape[-1], y.device.type), backend)).encode(y, fmt)


# --------------------------------------------------------------------------------------------- rotate


def _check_rotation(d: int) -> None:
    if d <= 0 or (d % 2 and d != 1):
        raise ValueError(f"rotation: Hadamard rotation needs an even head_dim, got {d}")


def rotate(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``x[..., D] @ H`` for fp32 ``x``: ``H`` the normalized ``[D, D]`` Walsh-Hadamard matrix
    (orthogonal and symmetric, so the rotation is its own inverse; ``D`` even: block-diagonal in
    blocks of the largest power of two dividing ``D``, see ``reference.rotation_block``). A new fp32
    tensor. C on CPU (one thread for a decode step's few rows, bit for bit the reference's fast
    transform), torch elsewhere.

    Example:
        >>> x = torch.randn(2, 3, 64)
        >>> torch.allclose(rotate(rotate(x)), x, atol=1e-5)
        True
    """
    d = x.shape[-1] if x.dim() else 0
    _check_rotation(d)
    if x.dtype != torch.float32:
        raise ValueError(f"x: rotate takes float32, got {x.dtype}")
    return next(pick("rotate", (d, x.device.type), backend)).rotate(x)


def rotate_pair(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key transform's stored space of keys and values at once: ``(rotate((k - mean) / std),
    rotate(v))`` for fp32 ``k, v [B, H, n, D]`` of one shape, ``mean`` / ``std`` ``[B, H, 1, D]``
    fp32 (None: skipped). Equals those torch ops and :func:`rotate` on the stacked pair on every
    backend; C on CPU does it in one call (a decode step's token leaving the tail).

    Example:
        >>> k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
        >>> ks, vs = rotate_pair(k, v, mean=k.mean(2, keepdim=True))
        >>> torch.allclose(vs, rotate(v))
        True
    """
    d = k.shape[-1] if k.dim() else 0
    _check_rotation(d)
    if k.dtype != torch.float32 or v.dtype != torch.float32 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"k, v: rotate_pair takes float32 [B, H, n, D] of one shape, got {tuple(k.shape)} {k.dtype} "
            f"and {tuple(v.shape)} {v.dtype}"
        )
    return next(pick("rotate_pair", (d, k.device.type), backend)).rotate_pair(k, v, mean, std)


__all__ = [
    "OPS",
    "backend_for",
    "backends",
    "check_finite",
    "decode_attention",
    "dequantize",
    "encode",
    "plan_decode_attention",
    "plan_quantize_append",
    "plan_transcode",
    "quantize_append",
    "SegmentRead",
    "raise_deferred",
    "rotate",
    "rotate_pair",
    "transcode",
]
