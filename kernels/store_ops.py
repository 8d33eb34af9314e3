"""The ops on a store's buffers, each one dispatch (:mod:`kvquant.kernels.dispatch`): write
(``quantize_append``, ``plan_quantize_append``), read back (``dequantize``), move between stores
(``transcode``, ``plan_transcode``), and ``encode`` (the codes of values in units of the scale).
:mod:`kvquant.kernels.ops` re-exports them; callers use ``ops``.

Example:
    >>> codes = torch.empty(1, 2, 8, 64, dtype=torch.int8)
    >>> scale = torch.empty(1, 2, 8, 1, dtype=torch.float16)
    >>> quantize_append(torch.randn(1, 2, 4, 64), codes, scale, None, 0, fmt="int8", group_size=64)
    >>> dequantize(codes, scale, None, 0, 4, fmt="int8", group=64, head_dim=64).shape
    torch.Size([1, 2, 4, 64])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvquant.kernels.backend import NONFINITE_INPUT, TranscodeCall
from kvquant.kernels.dispatch import backends, pick, why_unsupported

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


# --------------------------------------------------------------------------------------------- append step


def plan_append_step(
    tail: tuple[torch.Tensor, torch.Tensor],
    stats: tuple[torch.Tensor | None, torch.Tensor | None],
    rotation: bool,
    first: tuple[tuple, tuple],
    move: tuple[tuple, tuple] | None = None,
    *,
    head_dim: int,
    backend: str | None = None,
) -> Callable[..., None] | None:
    """A cache layer's decode-step append over buffers that stay put, in one call where a backend
    plans it (``Backend.plan_append_step``: the C kernels), else None (the caller makes the step's
    ops one by one). Asked of the backend that writes the first tier and (with ``move``) transcodes
    into the main store; the torch twin is :class:`kvquant.kernels.reference.AppendStepRef`.

    ``tail = (tail_k, tail_v)`` ``[B, H, cap, D]``; ``stats = (mean, std)`` ``[B, H, 1, D]`` or
    None each (the key smoothing); ``rotation``: the stored space is Hadamard-rotated; ``first =
    (dst_k, dst_v)`` as :func:`transcode` takes a destination (the tier the tail's oldest token
    enters); ``move = ((src_k, src_v), (dst_k, dst_v))``: a recent window's operands as
    :func:`transcode` takes a source, and the main store's destinations.

    Returns ``run(k, v, tail_row, leave_row, first_index, move_from, move_to)``: ``k, v [B, H, 1,
    D]`` copied into tail row ``tail_row``; tail row ``leave_row`` (or, with ``leave_row``
    :data:`~kvquant.kernels.backend.STEP_NEW_TOKEN`, ``k, v`` themselves: a layer with no tail)
    put into the stored space (``(k - mean) / std``, then the rotation) and written at
    ``first_index``; the first tier's index ``move_from`` transcoded (through fp32) into the main
    store at ``move_to``. Any other negative row or index skips its stage. The buffers end as those
    ops leave them; values a write refuses get that op's own error; non-finite ``k`` / ``v`` raise ``ValueError`` (``NONFINITE_INPUT``) before
    anything is written.

    Example:
        >>> run = plan_append_step((tail_k, tail_v), (mean, std), True, (dst_k, dst_v), head_dim=64)
        >>> run(k, v, 20, 4, 100, -1, -1)                  # one decode step, no recent window
        >>> run(k, v, -1, ops.STEP_NEW_TOKEN, 101, -1, -1) # a layer with no tail: k, v stored at once
    """
    device = tail[0].device.type

    def sdt(t: torch.Tensor | None) -> torch.dtype | None:
        return None if t is None else t.dtype

    picked = {
        next(
            pick("quantize_append", (d[3], head_dim, device, d[4], d[5], sdt(d[1]), bool(d[6])), backend),
            None,
        )
        for d in first
    }
    for src, dst in zip(*(move or ((), ())), strict=True):
        fields = (src[3], dst[3], head_dim, device, src[5], sdt(src[1]), dst[5], sdt(dst[1]), bool(dst[6]))
        picked.add(next(pick("transcode", fields, backend), None))
    if len(picked) != 1 or None in picked:
        return None
    step = picked.pop().plan_append_step(tail, stats, rotation, first, move, head_dim=head_dim)
    if step is None:
        return None

    def rest(stage: int, first_index: int, move_from: int, move_to: int) -> None:
        """Stages ``stage`` .. 4 through the ops, one by one (a write refused its values in ``step``:
        the op raises the spec's error for them, or writes what the backends it picks accept)."""
        for s in range(stage, 5):
            if s <= 2:
                codes, scale, zero, fmt, group, axis, static = first[s - 1]
                x = step.scratch[s - 1][:, :, None]  # [B, H, 1, D]
                quantize_append(
                    x, codes, scale, zero, first_index, fmt=fmt, group_size=group, axis=axis,
                    static_scale=static, backend=backend,
                )  # fmt: skip
            elif move is not None and move_from >= 0:
                src, dst = move[0][s - 3], move[1][s - 3]
                transcode(
                    src, move_from, move_from + 1, dst, move_to, via=torch.float32, head_dim=head_dim,
                    backend=backend,
                )  # fmt: skip

    def run(k, v, tail_row: int, leave_row: int, first_index: int, move_from: int, move_to: int) -> None:
        stage = step(k, v, tail_row, leave_row, first_index, move_from, move_to)
        if stage == 5:
            raise ValueError(NONFINITE_INPUT)
        if stage:
            rest(stage, first_index, move_from, move_to)

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
