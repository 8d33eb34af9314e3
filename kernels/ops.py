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
    STEP_NEW_TOKEN,
    Backend,
    DecodeCall,
    SegmentRead,
    check_finite,
    raise_deferred,
)
from kvquant.kernels.dispatch import OPS, backend_for, backends, pick, supporting, why_unsupported
from kvquant.kernels.reference import dense_decode_attention_ref, merge_attention
from kvquant.kernels.store_ops import (
    dequantize,
    encode,
    plan_append_step,
    plan_quantize_append,
    plan_transcode,
    quantize_append,
    transcode,
)

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


def _fp_len(fp: torch.Tensor | tuple) -> int:
    """Tokens in ``fp`` (``[B, H, n, D]``, or a tuple of such segments)."""
    return fp.shape[2] if isinstance(fp, torch.Tensor) else sum(x.shape[2] for x in fp)


def join_segments(fp: torch.Tensor | tuple | None) -> torch.Tensor | None:
    """Full-precision tokens given as segments ``[B, H, n_i, D]`` as one ``[B, H, n, D]`` tensor: the
    only non-empty segment as it is, else their concatenation (a tensor, or None, as it is)."""
    if fp is None or isinstance(fp, torch.Tensor):
        return fp
    full = [x for x in fp if x.shape[2]]
    return full[0] if len(full) == 1 else torch.cat(fp, 2)


def _smoothed(q, fp_k, fp_v, smoothing) -> tuple:
    """``q [B, Hq, D]`` and the fp tokens in the stores' smoothed space (``smoothing``: ``(mean,
    std | None)`` ``[B, Hkv, 1, D]``): ``q * std`` (each KV head's for its query heads) and ``(fp_k -
    mean) / std``, the fp segments joined; what a backend without ``takes_smoothing`` is given."""
    mean, std = smoothing
    if std is not None:
        b, hq, d = q.shape
        q = (q.float().reshape(b, std.shape[1], -1, d) * std).reshape(b, hq, d)  # std [B, Hkv, 1, D]
    fp_k, fp_v = join_segments(fp_k), join_segments(fp_v)
    if fp_k is not None and fp_k.shape[2]:
        fp_k = fp_k.float() - mean
        if std is not None:
            fp_k = fp_k / std
    return q, fp_k, fp_v


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
    smoothing: tuple[torch.Tensor, torch.Tensor | None] | None = None,
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
            token), or tuples of such segments (``n`` their total; the C backend reads them in
            place, for the others the op joins them), ``fp_valid [B, n]`` bool (None: all valid).
            A backend that cannot take them (chunked, reference) gets the store alone; their dense
            partial is merged here by log-sum-exp. The C and Triton backends take them in the
            same call.
        extra: more quantized segments (:class:`SegmentRead`; the recent window), attended in the
            same softmax: in the same kernel call by a backend that reads them all (C), else each
            through its own dispatch and merged here by log-sum-exp.
        rotation: the stores (main and ``extra``) hold Hadamard-rotated vectors (:func:`rotate`; the
            key transform's rotation) while ``q``, the fp tokens and the output are in the model's
            space: the C backend rotates them in its kernel call, for the others the op rotates
            ``q`` and the fp tokens in and the output back. The lse is that of the same scores.
        smoothing: ``(mean, std | None)``, fp32 ``[B, Hkv, 1, D]``: the stores (main and ``extra``)
            hold keys ``(k - mean) / std`` (the key transform's smoothing) while ``q`` and the fp
            tokens are the model's own. The C backend folds it in its kernel call (``q`` times
            ``std``, the fp keys smoothed); for the others the op does it first. The lse is that of
            the scores ``q . (k - mean)`` (the key transform's ``shift_lse`` makes it the model's).

    Returns:
        ``out [B, Hq, D]`` fp32 and ``lse [B, Hq]`` fp32 (natural log; nothing to attend:
        ``out = 0``, ``lse = -inf``).
    """
    fp = fp_k is not None and _fp_len(fp_k) > 0
    call = _decode_fields(
        k_fmt, v_fmt, q.shape[-1], q.device.type, k_axis, k_group, v_group, k_scale, v_scale, fp
    )
    b = next(pick("decode_attention", call, backend))
    one_call = not extra or _reads_segments(b, extra, q.shape[-1], q.device.type, forced=backend is not None)
    if smoothing is not None and not (b.takes_smoothing and one_call):
        q, fp_k, fp_v = _smoothed(q, fp_k, fp_v, smoothing)
        smoothing = None
    if isinstance(fp_k, tuple) and not (b.takes_fp_segments and one_call):
        fp_k, fp_v = join_segments(fp_k), join_segments(fp_v)
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
    if rotation:
        _check_rotation(q.shape[-1])
    if rotation and not (b.takes_rotation and one_call):
        fp_r = dict(fp_k=rotate(fp_k.float()), fp_v=rotate(fp_v.float())) if fp else {}
        kw_r = dict(kw, fp_valid=fp_valid, extra=extra, backend=backend)
        out, lse = decode_attention(rotate(q.float()), *tensors[1:], **kw_r, **fp_r)
        return rotate(out), lse
    if rotation:
        kw["rotation"] = True
    if smoothing is not None:
        kw["smoothing"] = smoothing
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
    extra_bounds=(), smoothing=None)``, the result of :func:`decode_attention` with these arguments, where
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

    def run(q, start, end, *, fp_k=None, fp_v=None, fp_valid=None, extra_bounds=(), smoothing=None):
        segments = tuple(replace(x, start=s, end=e) for x, (s, e) in zip(extra, extra_bounds, strict=True))
        return decode_attention(
            q, *tensors, **kw, start=start, end=end, scaling=scaling, softcap=softcap, fp_k=fp_k,
            fp_v=fp_v, fp_valid=fp_valid, extra=segments, rotation=rotation, smoothing=smoothing,
            backend=backend,
        )  # fmt: skip

    return run


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
    "join_segments",
    "plan_append_step",
    "plan_decode_attention",
    "plan_quantize_append",
    "plan_transcode",
    "quantize_append",
    "SegmentRead",
    "STEP_NEW_TOKEN",
    "raise_deferred",
    "rotate",
    "rotate_pair",
    "transcode",
]
