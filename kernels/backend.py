"""What a backend of the kernel ops is: the calls it may be asked, and how it says what it supports.

An op (:mod:`kvquant.kernels.ops`) describes each call by one small frozen record (formats, head
size, device, scale dtypes, ...; no tensors), asks every backend in order whether it supports that
record, and runs the first that does. A backend declares its support in one place: the device types
it runs on (``devices``) and one ``supports_<op>`` method per op that returns ``None`` when it runs
the call and otherwise a short reason (shown when a caller forces a backend that cannot run it).

Every backend implements each op it supports with the op's one signature (see ``ops``):

- ``decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, k_fmt, v_fmt, k_group,
  v_group, k_axis, start, end, scaling, softcap, fp_k, fp_v, fp_valid, extra, rotation) -> (out,
  lse)``; a backend with ``takes_fp_tokens = False`` is never handed ``fp_k``, one with
  ``takes_segments = False`` never ``extra`` (the op reads those apart and merges them itself), one
  with ``takes_rotation = False`` never ``rotation`` (the op rotates around it), one with
  ``takes_fp_segments = False`` ``fp_k`` / ``fp_v`` as one tensor each (the op joins segments), one
  with ``takes_smoothing = False`` never ``smoothing`` (the op folds it into the query and fp keys);
- ``quantize_append(x, codes, scale, zero, index, *, fmt, group_size, axis, static_scale) -> bool``
  (False: refused these values, nothing counted written; the next backend runs, the reference
  raises the spec's error);
- ``encode(y, fmt) -> codes``;
- ``rotate(x) -> x @ H`` (fp32 in and out, ``D`` even; ``H`` the normalized Hadamard matrix, block-diagonal
  in blocks of the largest power of two dividing ``D``); ``rotate_pair(k, v, mean, std)`` (the key
  transform of keys and values; the base class composes it from ``rotate``);
- ``dequantize(codes, scale, zero, i0, i1, *, fmt, group, axis, head_dim) -> x`` (fp32
  ``[B, H, i1 - i0, D]``: buffer indices ``[i0, i1)`` of a store);
- ``transcode(src, i0, i1, dst, index, *, via, head_dim) -> bool`` (``src``: a store's codes,
  scale, zero, fmt, group, axis; ``dst``: codes, scale, zero, fmt, group_size, axis, static_scale;
  the rows ``dequantize`` gives, rounded through ``via``, written as ``quantize_append`` would;
  False: refused, as there). Optional: where a backend has none, ``ops`` runs the two ops.

Example:
    >>> call = DecodeCall.of("int4", "int4", head_dim=64, device="cpu")
    >>> call.formats
    ('int4', 'int4')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeCall:
    """One ``decode_attention`` call, described: what a backend needs to know to accept it."""

    k_fmt: str
    v_fmt: str
    head_dim: int
    device: str  # device type: "cpu", "cuda", ...
    k_axis: str = "token"
    k_group: int | None = None
    v_group: int | None = None
    k_scale_dtype: torch.dtype | None = None  # None: no scale (pass-through)
    v_scale_dtype: torch.dtype | None = None
    fp_tokens: bool = False  # full-precision tokens join the softmax

    @property
    def formats(self) -> tuple[str, str]:
        return self.k_fmt, self.v_fmt

    @property
    def scale_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(t for t in (self.k_scale_dtype, self.v_scale_dtype) if t is not None)

    @classmethod
    def of(cls, k_fmt: str, v_fmt: str, *, head_dim: int, device: str = "cpu", **kw) -> DecodeCall:
        return cls(k_fmt, v_fmt, head_dim, str(device), **kw)


@dataclass(frozen=True)
class SegmentRead:
    """One more quantized segment for ``ops.decode_attention(extra=...)`` (e.g. the recent window):
    its K / V buffers as a store holds them, what they hold, and the buffer range ``[start[b], end)``
    to attend."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    v_codes: torch.Tensor
    v_scale: torch.Tensor | None
    v_zero: torch.Tensor | None
    k_fmt: str
    v_fmt: str
    k_group: int | None
    v_group: int | None
    k_axis: str
    start: torch.Tensor  # int64 [B]
    end: int

    def tensors(self) -> tuple:
        return self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero

    def call_kwargs(self) -> dict:
        """What ``ops.decode_attention`` takes about this segment besides its tensors."""
        return dict(
            k_fmt=self.k_fmt,
            v_fmt=self.v_fmt,
            k_group=self.k_group,
            v_group=self.v_group,
            k_axis=self.k_axis,
            start=self.start,
            end=self.end,
        )

    def call_fields(self, head_dim: int, device: str) -> tuple:
        """The fields of the :class:`DecodeCall` that reads this segment alone."""
        k_sdt = None if self.k_scale is None else self.k_scale.dtype
        v_sdt = None if self.v_scale is None else self.v_scale.dtype
        return (
            self.k_fmt,
            self.v_fmt,
            head_dim,
            device,
            self.k_axis,
            self.k_group,
            self.v_group,
            k_sdt,
            v_sdt,
            False,
        )


@dataclass(frozen=True)
class QuantizeCall:
    """One ``quantize_append`` call, described."""

    fmt: str
    head_dim: int
    device: str
    group_size: int
    axis: str = "token"
    scale_dtype: torch.dtype | None = None  # None: no scale buffer (pass-through)
    static_scale: bool = False


@dataclass(frozen=True)
class DequantizeCall:
    """One ``dequantize`` call, described."""

    fmt: str
    head_dim: int
    device: str
    axis: str = "token"
    scale_dtype: torch.dtype | None = None  # None: no scale (pass-through)


@dataclass(frozen=True)
class TranscodeCall:
    """One ``transcode`` call (a store's rows into another store), described."""

    src_fmt: str
    dst_fmt: str
    head_dim: int
    device: str
    src_axis: str = "token"
    src_scale_dtype: torch.dtype | None = None
    dst_axis: str = "token"
    dst_scale_dtype: torch.dtype | None = None
    dst_static_scale: bool = False

    def parts(self) -> tuple[DequantizeCall, QuantizeCall]:
        """The ``dequantize`` and ``quantize_append`` calls it stands for."""
        d = self.head_dim
        read = DequantizeCall(self.src_fmt, d, self.device, self.src_axis, self.src_scale_dtype)
        write = QuantizeCall(
            self.dst_fmt, d, self.device, d, self.dst_axis, self.dst_scale_dtype, self.dst_static_scale
        )
        return read, write


@dataclass(frozen=True)
class RotateCall:
    """One ``rotate`` call, described."""

    head_dim: int
    device: str


@dataclass(frozen=True)
class EncodeCall:
    """One ``encode`` call, described."""

    fmt: str
    head_dim: int
    device: str


class Backend:
    """Base of the backends: supports nothing until a subclass says otherwise.

    ``devices``: device types it runs on (``ops`` checks them); ``interpretable``: runs on CPU tensors
    under Triton's interpreter when a caller forces it (tests), never when ``ops`` picks freely;
    ``takes_fp_tokens``: ``decode_attention`` attends full-precision tokens in the same softmax itself;
    ``takes_segments``: ``decode_attention`` also reads more quantized segments (``extra``) in it;
    ``takes_rotation``: ``decode_attention`` rotates the query and the fp tokens into the stores'
    space and the output back itself (``rotation=True``); ``takes_fp_segments``: ``decode_attention``
    reads ``fp_k`` / ``fp_v`` given as tuples of segments in place; ``takes_smoothing``: it folds the
    key smoothing (``smoothing=(mean, std)``) into the query and the fp keys itself.
    """

    name = "backend"
    devices: frozenset[str] = frozenset()
    interpretable = False
    takes_fp_tokens = False
    takes_segments = False
    takes_rotation = False
    takes_fp_segments = False
    takes_smoothing = False

    def available(self) -> str | None:
        """None when the backend can run at all (built, importable), else why not."""
        return None

    def supports_decode(self, call: DecodeCall) -> str | None:
        return f"{self.name} has no decode_attention"

    def supports_quantize(self, call: QuantizeCall) -> str | None:
        return f"{self.name} has no quantize_append"

    def supports_encode(self, call: EncodeCall) -> str | None:
        return f"{self.name} has no encode"

    def supports_rotate(self, call: RotateCall) -> str | None:
        return f"{self.name} has no rotate"

    def supports_dequantize(self, call: DequantizeCall) -> str | None:
        return f"{self.name} has no dequantize"

    def supports_transcode(self, call: TranscodeCall) -> str | None:
        return f"{self.name} has no transcode"

    def rotate_pair(self, k: torch.Tensor, v: torch.Tensor, mean, std) -> tuple[torch.Tensor, torch.Tensor]:
        """``ops.rotate_pair`` from this backend's ``rotate`` (a backend may do it in one call)."""
        if mean is not None:
            k = k - mean
        if std is not None:
            k = k / std
        kv = self.rotate(torch.stack((k, v)))  # [2, B, H, n, D]
        return kv[0], kv[1]

    def plan_decode(self, *tensors, **kw):
        """Optional: ``decode_attention`` over fixed buffers described once (``ops.plan_decode_attention``
        asks only a backend that answers such calls in one piece): a callable
        ``run(q, start, end, *, fp_k, fp_v, fp_valid, extra_bounds)``, or None (no plan: each call
        goes through ``ops.decode_attention``)."""
        return None

    def plan_quantize(self, codes, scale, zero, **kw):
        """Optional: ``quantize_append`` into fixed buffers described once (``ops.plan_quantize_append``):
        a callable ``run(x, index) -> bool`` as ``quantize_append`` answers, or None (no plan)."""
        return None

    def plan_transcode(self, src, dst, **kw):
        """Optional: ``transcode`` between fixed buffers described once (``ops.plan_transcode``):
        a callable ``run(i0, i1, index) -> bool`` as ``transcode`` answers, or None (no plan)."""
        return None

    def plan_append_step(self, tail, stats, rotation, first, move, *, head_dim):
        """Optional: a cache layer's decode-step append in one call (``ops.plan_append_step``, asked
        only of the backend that writes the first tier and moves into the main store): a callable
        ``run(k, v, tail_row, leave_row, first_index, move_from, move_to) -> int`` with a
        ``scratch`` tensor, as :class:`kvquant.kernels.cpu.step.NativeAppendStep` answers, or None
        (no plan: the cache makes the step's ops one by one)."""
        return None

    def __repr__(self) -> str:
        return f"<kvquant kernels backend {self.name!r}>"


STEP_NEW_TOKEN = -2  # a decode-step append's ``leave_row`` when the new token itself leaves (no tail)

# --------------------------------------------------------------------------------------------- deferred errors

NONFINITE_INPUT = "input: key/value states contain NaN or Inf; refusing to quantize them"
SCALE_OVERFLOW = (
    "scale_dtype: the scale dtype cannot hold the scale/zero point of these values; "
    "use scale_dtype 'float32' or 'bfloat16'"
)
DEFERRED_ERRORS = {2: NONFINITE_INPUT, 1: SCALE_OVERFLOW}  # a flag's code -> its error; the higher code wins
_flags: dict[torch.device, torch.Tensor] = {}  # device -> its deferred-error flag


def deferred_flag(device: torch.device | str) -> torch.Tensor:
    """The device's deferred-error flag: an int32 ``[1]`` tensor there, 0 while nothing is flagged,
    else the highest code of :data:`DEFERRED_ERRORS` seen since :func:`raise_deferred` last raised it.
    Kernels raise it in place (the Triton quantize kernel: an atomic max), so a check costs no launch
    and no host sync of its own."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    flag = _flags.get(dev)
    if flag is None:
        flag = _flags[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return flag


def check_finite(*xs: torch.Tensor) -> None:
    """States entering a cache must be finite: ``ValueError`` (:data:`NONFINITE_INPUT`) at once on
    CPU; on CUDA the device's :func:`deferred_flag`, raised by :func:`raise_deferred` (no host sync
    per call; a few small launches: each tensor's largest magnitude, NaN propagating, compared with
    its dtype's largest finite value).

    On CPU the sums come first (a NaN or Inf anywhere makes a sum non-finite; one reduction per
    tensor), and only a non-finite sum (or a finite-valued one that overflowed) is looked at closely."""
    if not xs[0].is_cuda:
        total = 0.0
        for x in xs:
            total += float(x.sum() if x.dtype == torch.float32 else x.sum(dtype=torch.float32))
        if math.isfinite(total):
            return
        if not all(bool(torch.isfinite(x).all()) for x in xs):
            raise ValueError(NONFINITE_INPUT)
        return
    worst = None
    for x in xs:
        m = torch.linalg.vector_norm(x, float("inf"))  # [] max |x| (NaN if any)
        worst = m if worst is None else torch.maximum(worst, m)
    deferred_flag(xs[0].device).masked_fill_(worst.le(torch.finfo(worst.dtype).max).logical_not_(), 2)


def raise_deferred(device: torch.device | str | None = None) -> None:
    """Raise the ``ValueError`` of a deferred check (one host sync per device that has a flag), then
    clear the flag.

    ``device``: only that device's flag (default: every device with one).
    """
    want = None if device is None else torch.device(device)
    for dev, flag in list(_flags.items()):
        if want is not None and (dev.type != want.type or want.index not in (None, dev.index)):
            continue
        code = int(flag)
        if code:
            flag.zero_()
            raise ValueError(
                DEFERRED_ERRORS[code] + " (seen by an earlier quantize_append on " + str(dev) + ")"
            )
