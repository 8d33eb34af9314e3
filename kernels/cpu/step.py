"""A cache layer's decode-step append in one C call (``kvq_append_step``): the C side of
:func:`kvquant.kernels.ops.plan_append_step`.

One token per row enters the full-precision tail; the token leaving the tail is put into the stored
space (smoothing statistics, Hadamard rotation) and written into the first quantized tier; the token
leaving a recent window is transcoded into the main store. Each of those is the C call the cache
would make one op at a time (``kvq_rotate_pair``'s operations, ``kvq_write``, ``kvq_transcode``), in
the same order, so the buffers end with the same bits.

Example:
    >>> run = NativeAppendStep(tail_k, tail_v, None, None, True, (dst_k, dst_v), None, head_dim=64)
    >>> run(k, v, tail_row=20, leave_row=4, first_index=100, move_from=-1, move_to=-1)
    0
"""

from __future__ import annotations

import ctypes

import torch

from kvquant.kernels.cpu.binding import cached_operand, elem_strides, write_threads
from kvquant.kernels.cpu.build import Step, library
from kvquant.kernels.cpu.rowwise import hadamard_norm
from kvquant.kernels.cpu.writes import cached_writer


class NativeAppendStep:
    """The append of one decode step over fixed buffers, described once.

    Args:
        tail_k, tail_v: the tail's buffers ``[B, H, cap, D]`` fp32, one layout.
        mean, std: the key smoothing statistics ``[B, H, 1, D]`` fp32, or None.
        rotation: whether the stored space is Hadamard-rotated.
        first: ``(dst_k, dst_v)``, the tier the tail's oldest token enters, each ``(codes, scale,
            zero, fmt, group_size, axis, static_scale)`` as ``ops.plan_transcode`` takes a destination.
        move: None, or ``((src_k, src_v), (dst_k, dst_v))``: the first tier's operands (``(codes,
            scale, zero, fmt, group, axis)``) and the main store's destinations, for the token that
            leaves a recent window.
        head_dim: ``D``.

    ``run(k, v, tail_row, leave_row, first_index, move_from, move_to)``: ``k, v [B, H, 1, D]``
    fp32; ``leave_row`` ``STEP_NEW_TOKEN`` (-2): ``k, v`` themselves leave (a layer with no tail);
    any other row or index < 0 skips its stage. Returns 0; 5 when ``k`` or ``v`` holds a NaN or an
    Inf (checked first, nothing written); or the stage whose write refused its values (1, 2: the
    first tier's keys, values; 3, 4: the move's), the stages before it done. ``scratch``
    ``[2, B, H, D]``: the leaving token in the stored space, after a call that wrote it.
    """

    def __init__(self, tail_k, tail_v, mean, std, rotation: bool, first: tuple, move, *, head_dim: int):
        b, h, _, d = tail_k.shape
        self.scratch = torch.empty(2, b, h, d, dtype=torch.float32)  # [2, B, H, D]
        self._keep: list = [tail_k, tail_v, mean, std, *(t for dst in first for t in dst[:3])]
        s = Step()
        s.tail_k, s.tail_v = tail_k.data_ptr(), tail_v.data_ptr()
        s.tsb, s.tsh, s.tst = elem_strides(tail_k)
        s.B, s.H, s.D = b, h, d
        s.mean = None if mean is None else mean.data_ptr()
        s.std = None if std is None else std.data_ptr()
        s.rot_scale = hadamard_norm(d) if rotation else 0.0
        s.scratch = self.scratch.data_ptr()
        self._writers = [cached_writer(*dst[:4]) for dst in first]  # (the structs stay alive here)
        s.first_k, s.first_v = (ctypes.pointer(w) for w in self._writers)
        s.first_threads = max(write_threads(dst[3], b * h) for dst in first)
        if move is not None:
            (src_k, src_v), (dst_k, dst_v) = move
            self._keep += [t for x in (src_k, src_v, dst_k, dst_v) for t in x[:3]]
            self._ops = [cached_operand(*src[:6], self._keep) for src in (src_k, src_v)]
            self._writers += [cached_writer(*dst[:4]) for dst in (dst_k, dst_v)]
            s.move_src_k, s.move_src_v = (ctypes.pointer(o) for o in self._ops)
            s.move_dst_k, s.move_dst_v = (ctypes.pointer(w) for w in self._writers[2:])
            s.move_threads = max(write_threads(dst[3], b * h) for dst in (dst_k, dst_v))
        self._step, self._fn = s, library().kvq_append_step

    def __call__(
        self, k: torch.Tensor, v: torch.Tensor, tail_row: int, leave_row: int, first_index: int,
        move_from: int, move_to: int,
    ) -> int:  # fmt: skip
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        rc = self._fn(
            ctypes.byref(self._step), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
            v.stride(1), tail_row, leave_row, first_index, move_from, move_to,
        )  # fmt: skip
        if rc < 0:
            raise MemoryError("native CPU append step: out of memory")
        return rc
