"""The C kernels' calls, tensor side: which formats and head sizes they take, operands described
for ``kvq_decode`` (pointers into the store's own buffers, no copies, no conversions, memoised per
buffer layout), the thread counts, and decode attention (:class:`NativeDecode`,
:func:`decode_attention_native`). The writes into a store are :mod:`kvquant.kernels.cpu.writes`, the
rotation and dequantize :mod:`kvquant.kernels.cpu.rowwise`.

Same operands and results as :func:`kvquant.kernels.chunked.decode_attention_torch` (the torch twin
the tests compare it with).
"""

from __future__ import annotations

import ctypes
import math

import torch

from kvquant.formats import FORMAT_NAMES, format_spec
from kvquant.kernels.cpu.build import FpRows, Operand, library, native_error
from kvquant.kernels.hadamard import rotation_block

MAX_HEAD_DIM = 512


def native_formats_ok(k_fmt: str, v_fmt: str, head_dim: int) -> bool:
    """Whether the kernel reads both formats (every quantized format; not ``none``) at this head
    size (up to ``MAX_HEAD_DIM``)."""
    return k_fmt in DECODE_FORMATS and v_fmt in DECODE_FORMATS and head_dim <= MAX_HEAD_DIM


def elem_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Element strides of dims 0..2, 0 where the dim broadcasts (size 1)."""
    st, sh = t.stride(), t.shape
    return (0 if sh[0] == 1 else st[0], 0 if sh[1] == 1 else st[1], 0 if sh[2] == 1 else st[2])


def _reads(spec) -> bool:
    """kvq_decode reads scaled codes that decode one by one (integers, fp8 via its table, codebooks
    via theirs) or by their state (trellis codes via the state table)."""
    return spec.has_scale and (spec.elementwise or spec.state_table() is not None)


def writer_symbol(spec) -> str | None:
    """The C entry point that quantizes ``spec`` along the token axis: rounded integers
    (``kvq_quantize``), the scale search of a codebook (``kvq_quantize_codebook``), float8 codes
    (``kvq_quantize_fp8``), trellis codes with their scales (``kvq_quantize_trellis``); None where
    none does."""
    if spec.state_bits is not None:
        return "kvq_quantize_trellis"
    if spec.integer:
        return "kvq_quantize"
    if spec.scale_search is not None and spec.elementwise:
        return "kvq_quantize_codebook"
    if spec.code_dtype is not None and spec.code_dtype.is_floating_point and spec.bits == 8:
        return "kvq_quantize_fp8"
    return None


# what kvq_decode reads, what the quantize kernels write and what kvq_trellis_encode searches
DECODE_FORMATS = frozenset(n for n in FORMAT_NAMES if _reads(format_spec(n)))
QUANTIZE_FORMATS = frozenset(n for n in FORMAT_NAMES if writer_symbol(format_spec(n)) is not None)
TRELLIS_FORMATS = frozenset(n for n in FORMAT_NAMES if format_spec(n).state_bits is not None)
SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}  # read
WRITTEN_SCALE_DTYPES = tuple(SCALE_DTYPES)  # the quantize kernels round into each of these


def writes_head(fmt: str, head_dim: int) -> bool:
    """Whether the writer of ``fmt`` takes heads of ``head_dim`` channels: trellis codes need one
    state's codes and whole bytes of packed codes (``check_channels``, ``pack_codes``), else any."""
    spec = format_spec(fmt)
    if spec.state_bits is None:
        return True
    return head_dim * spec.bits >= spec.state_bits and head_dim * spec.bits % 8 == 0


def _operand(codes, scale, zero, fmt, group, axis, keep) -> Operand:
    """Describe one operand: pointers into the store's own buffers (no slice, no conversion; the
    kernel reads fp16 / bf16 scales itself). Tensors used go to ``keep``."""
    spec = format_spec(fmt)
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    keep.append(codes)
    sb, sh, st = elem_strides(codes)  # 1-byte codes: element strides are byte strides
    lut = spec.lut() if spec.elementwise else spec.state_table()
    op = Operand(codes.data_ptr(), sb, sh, st)
    op.bits, op.is_signed, op.n_groups, op.group = spec.bits, int(spec.signed), 1, 1
    op.state_codes = spec.state_codes
    op.fp8 = spec.triton_read().fp8  # 1 e4m3fn, 2 e5m2: the AVX2 path widens them through fp16
    op.lut = None if lut is None else lut.data_ptr()
    if scale is None:
        return op
    static = scale.shape[0] == 1 and scale.shape[2] == 1 and scale.shape[3] == 1
    if axis == "channel" and not static:
        op.channel_axis, op.group = 1, group
    else:
        op.n_groups = scale.shape[-1]
    op.scale_dtype = SCALE_DTYPES[scale.dtype]
    for name, t in (("scale", scale), ("zero", zero)):
        if t is None:
            continue
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            t = t.contiguous()
        keep.append(t)
        sb, sh, st = elem_strides(t)
        setattr(op, name, t.data_ptr())
        setattr(op, f"{name}_sb", sb)
        setattr(op, f"{name}_sh", sh)
        setattr(op, f"{name}_st", st)
    return op


_OPERANDS: dict[tuple, Operand] = {}  # described operands by buffer address and layout (see below)
_OPERANDS_MAX = 512


def _in_place(t: torch.Tensor | None) -> bool:
    """Whether :func:`_operand` points into ``t`` itself (no contiguous copy)."""
    return t is None or t.stride(-1) == 1 or t.shape[-1] == 1


def cached_operand(codes, scale, zero, fmt, group, axis, keep) -> Operand:
    """:func:`_operand` from token 0, memoised: a cache hands the kernel the same store buffers step
    after step (they change only when the store grows, moves or is reordered). The struct is a pure
    function of the key (format, and each buffer's address, shape, strides and dtype; the tables
    are the format's own, built once), so an entry stays right even if a freed buffer's address is
    reused by another of the same layout. Buffers that need a contiguous copy are not memoised."""
    key = (fmt, group, axis, buffer_layout(codes), buffer_layout(scale), buffer_layout(zero))
    op = _OPERANDS.get(key)
    if op is None:
        if not (_in_place(codes) and _in_place(scale) and _in_place(zero)):  # (a function of the key)
            return _operand(codes, scale, zero, fmt, group, axis, keep)
        op = remember(_OPERANDS, key, _operand(codes, scale, zero, fmt, group, axis, []))
    return op


def remember(table: dict, key: tuple, value):
    """Keep ``value`` under ``key`` in a memo of described buffers (emptied when it holds
    ``_OPERANDS_MAX``: stale entries are harmless, only memory); returns ``value``."""
    if len(table) >= _OPERANDS_MAX:
        table.clear()
    table[key] = value
    return value


def buffer_layout(t: torch.Tensor | None) -> tuple | None:
    """A buffer's address, shape, strides and dtype: what a described operand or write depends on."""
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)


# below this many (row, head, token) triples a second thread costs more than it saves
THREAD_MIN_WORK = 4096


def work_threads(work: int) -> int:
    """Threads for a call: torch's intra-op thread count for big enough work, else one."""
    return max(1, torch.get_num_threads()) if work >= THREAD_MIN_WORK else 1


def search_threads(rows: int) -> int:
    """Threads for the trellis search of ``rows`` head vectors: one costs a long decode's worth per
    row, so threads as soon as there are rows to share."""
    return min(max(1, torch.get_num_threads()), max(rows, 1))


def write_threads(fmt: str, rows: int) -> int:
    """Threads for quantizing ``rows`` head vectors into ``fmt`` (trellis: :func:`search_threads`)."""
    return search_threads(rows) if fmt in TRELLIS_FORMATS else work_threads(rows * 16)


class NativeDecode:
    """``kvq_decode`` over fixed operands: the store's buffers (and the ``extra`` segments') described
    once, so that a cache reading the same buffers step after step pays only for what changes (the
    query, the ranges, the full-precision tokens). Arguments as :func:`decode_attention_native`
    takes them, less the per-call ones; ``head_dim``: ``D``.

    Example:
        >>> run = NativeDecode(k_parts, v_parts, k_fmt="int4", v_fmt="int4", k_group=64, v_group=64,
        ...     k_axis="token", head_dim=64, scaling=0.125)
        >>> out, lse = run(q, start, end)                       # q [B, Hq, D]; start [B] int64
    """

    def __init__(
        self,
        k_parts: tuple,
        v_parts: tuple,
        *,
        k_fmt: str,
        v_fmt: str,
        k_group: int,
        v_group: int,
        k_axis: str,
        head_dim: int,
        scaling: float,
        softcap: float | None = None,
        extra: tuple = (),
        rotation: bool = False,
    ):
        lib = library()
        if lib is None:
            raise RuntimeError(f"native CPU decode kernel unavailable: {native_error()}")
        for kf, vf in [(k_fmt, v_fmt)] + [(x.k_fmt, x.v_fmt) for x in extra]:
            if not native_formats_ok(kf, vf, head_dim):
                raise ValueError(
                    f"k_fmt / v_fmt / head_dim: the native kernel reads quantized formats at head_dim <= "
                    f"{MAX_HEAD_DIM}, got {kf!r} / {vf!r} at {head_dim}"
                )
        self._fn, self._d, self._hkv = lib.kvq_decode, head_dim, k_parts[0].shape[1]
        # the described buffers (and any contiguous copy) stay alive with the plan: it holds pointers
        self._keep: list = [*k_parts, *v_parts, *(t for x in extra for t in x.tensors())]
        self._k = cached_operand(*k_parts, k_fmt, k_group, k_axis, self._keep)
        self._v = cached_operand(*v_parts, v_fmt, v_group, "token", self._keep)
        self._n_x = n_x = len(extra)
        self._xk = self._xv = self._ends = None
        if extra:  # more segments (kernels.backend.SegmentRead), read in the same softmax
            ks = [cached_operand(*x.tensors()[:3], x.k_fmt, x.k_group, x.k_axis, self._keep) for x in extra]
            vs = [cached_operand(*x.tensors()[3:], x.v_fmt, x.v_group, "token", self._keep) for x in extra]
            self._xk, self._xv = (Operand * n_x)(*ks), (Operand * n_x)(*vs)
            self._ends = (ctypes.c_int64 * n_x)()
        self._scaling, self._softcap = float(scaling), 0.0 if softcap is None else float(softcap)
        self._rotation = 1.0 / math.sqrt(rotation_block(head_dim)) if rotation else 0.0
        self._fp: dict[int, tuple] = {}  # segments -> (FpRows, its Operand and length arrays)

    def __call__(
        self,
        q: torch.Tensor,
        start: torch.Tensor,
        end: int,
        *,
        fp_k: torch.Tensor | None = None,
        fp_v: torch.Tensor | None = None,
        fp_valid: torch.Tensor | None = None,
        extra_bounds: tuple = (),
        smoothing: tuple | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, D], lse [B, Hq])`` fp32; ``extra_bounds``: ``(start [B], end)`` of each
        ``extra`` segment, in order; ``fp_k`` / ``fp_v``: one tensor or a tuple of segments (read in
        place); ``smoothing``: ``(mean, std | None)``, as :func:`decode_attention_native` takes it."""
        b, hq, d = q.shape
        if d != self._d or hq % self._hkv:
            raise ValueError(
                f"q: expected [B, Hq, {self._d}], Hq a multiple of {self._hkv}, got {tuple(q.shape)}"
            )
        qf = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()  # [B, Hkv, G, D]
        if out is None:
            out = torch.empty(b, hq, d, dtype=torch.float32)
        else:
            _check_out("out", out, (b, hq, d))
        if lse is None:
            lse = torch.empty(b, hq, dtype=torch.float32)
        else:
            _check_out("lse", lse, (b, hq))
        if b == 0:
            return out, lse
        if start.dtype != torch.int64 or not start.is_contiguous():
            start = start.to(torch.int64).contiguous()  # the kernel skips each row's tokens before start[b]
        fp, keep = None, None
        if fp_k is not None or smoothing is not None:
            fp, keep = self._fp_rows(fp_k, fp_v, fp_valid, smoothing, b)  # (kept alive here)
        xstart = xend = starts = None
        if self._n_x:
            s0 = extra_bounds[0][0]
            if self._n_x == 1 and s0.dtype == torch.int64 and s0.is_contiguous() and s0.numel() == b:
                starts = s0  # (the usual case: one recent window, its starts as the layer keeps them)
            else:
                starts = torch.cat([s.to(torch.int64).reshape(b) for s, _ in extra_bounds])  # [n_x * B]
            for i, (_, e) in enumerate(extra_bounds):
                self._ends[i] = e
            xstart, xend = starts.data_ptr(), ctypes.addressof(self._ends)
        rc = self._fn(
            qf.data_ptr(), b, self._hkv, hq // self._hkv, d, ctypes.byref(self._k), ctypes.byref(self._v),
            start.data_ptr(), end, self._scaling, self._softcap, out.data_ptr(), lse.data_ptr(),
            work_threads(b * self._hkv * end) if threads is None else threads,
            fp, self._xk, self._xv, xstart, xend, self._n_x, self._rotation,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("native CPU decode kernel: out of memory")
        return out, lse

    def _fp_rows(self, fp_k, fp_v, valid, smoothing, b: int):
        """The ``kvq_fp`` of one call: the fp segments (empty ones left out) pointed at in place, the
        mask and the statistics; returns it (by reference) and the tensors it points into."""
        if isinstance(fp_k, torch.Tensor):
            fp_k, fp_v = (fp_k,), (fp_v,)
        elif fp_k is None:
            fp_k = fp_v = ()
        if len(fp_k) != len(fp_v):
            raise ValueError(f"fp_k / fp_v: {len(fp_k)} key segments but {len(fp_v)} value segments")
        n_seg = len(fp_k)
        if n_seg not in self._fp:
            size = max(n_seg, 1)
            ks = (Operand * size)(*(Operand(bits=32, n_groups=1, group=1) for _ in range(size)))
            vs = (Operand * size)(*(Operand(bits=32, n_groups=1, group=1) for _ in range(size)))
            lens = (ctypes.c_int64 * size)()
            self._fp[n_seg] = (FpRows(ks, vs, lens, n_seg), ks, vs, lens)
        rows, ks, vs, lens = self._fp[n_seg]
        keep, n, shape = [], 0, (b, self._hkv, self._d)
        for i in range(n_seg):  # (an empty segment is pointed at too: it reads no row)
            k, n_k = _point_rows(fp_k[i], ks[i], shape)
            v, n_v = _point_rows(fp_v[i], vs[i], shape)
            if n_k != n_v:
                raise ValueError(f"fp_k / fp_v: segment {i} has {n_k} keys but {n_v} values")
            keep += (k, v)
            lens[i] = n_k
            n += n_k
        rows.n, rows.valid = n, None
        if valid is not None and n:
            if tuple(valid.shape) != (b, n):
                raise ValueError(f"fp_valid: expected [B, n] = [{b}, {n}], got {tuple(valid.shape)}")
            valid = valid.to(torch.uint8).contiguous()
            keep.append(valid)
            rows.valid = valid.data_ptr()
        rows.mean = rows.std = None
        if smoothing is not None:
            mean, std = smoothing
            rows.mean = _stat_ptr(mean, "mean", shape, keep)
            rows.std = None if std is None else _stat_ptr(std, "std", shape, keep)
        return ctypes.byref(rows), keep


def _check_out(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous float32 tensor of shape {shape}, got {tuple(t.shape)} {t.dtype}"
        )


def _point_rows(x: torch.Tensor, op: Operand, shape: tuple) -> tuple[torch.Tensor, int]:
    """Point ``op`` at full-precision rows ``x [B, Hkv, n, D]`` (``(B, Hkv, D) = shape``) as 32-bit
    codes (byte strides, no scales); returns the fp32 tensor it points into (keep it alive for the
    call) and ``n``."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.dim() != 4:
        raise ValueError(f"fp_k / fp_v: expected segments [B, Hkv, n, D], got {tuple(x.shape)}")
    b, h, n, d = x.shape
    if (b, h, d) != shape:
        raise ValueError(
            f"fp_k / fp_v: expected segments [B, Hkv, n, D] = [{shape[0]}, {shape[1]}, n, {shape[2]}], "
            f"got {tuple(x.shape)}"
        )
    sb, sh, st, sd = x.stride()
    if sd != 1:
        x = x.contiguous()
        sb, sh, st, sd = x.stride()
    op.codes = x.data_ptr()
    op.code_sb = 0 if b == 1 else 4 * sb  # (0 where the dim broadcasts, as elem_strides)
    op.code_sh = 0 if h == 1 else 4 * sh
    op.code_st = 0 if n == 1 else 4 * st
    return x, n


def _stat_ptr(t: torch.Tensor, name: str, shape: tuple, keep: list) -> int:
    """The address of smoothing statistic ``t [B, Hkv, 1, D]`` as fp32 contiguous (kept in ``keep``)."""
    b, h, d = shape
    if t.shape != (b, h, 1, d):
        raise ValueError(
            f"smoothing: expected {name} [B, Hkv, 1, D] = [{b}, {h}, 1, {d}], got {tuple(t.shape)}"
        )
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.float().contiguous()
    keep.append(t)
    return t.data_ptr()


def decode_attention_native(
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
    threads: int | None = None,
    fp_k: torch.Tensor | None = None,
    fp_v: torch.Tensor | None = None,
    fp_valid: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    extra: tuple = (),
    rotation: bool = False,
    smoothing: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvquant.kernels.chunked.decode_attention_torch` in C (CPU tensors; see there for shapes):
    one :class:`NativeDecode` call.

    ``fp_k / fp_v [B, Hkv, n, D]`` (or tuples of segments ``[B, Hkv, n_i, D]``, read in place, ``n``
    their total) with ``fp_valid [B, n]`` (bool; None: all valid): full-precision tokens (sinks,
    residual, the new token) attended in the same softmax where valid, so the result is the whole
    attention and needs no merge. ``smoothing``: ``(mean, std | None)`` ``[B, Hkv, 1, D]``: the stores
    hold keys ``(k - mean) / std`` while ``q`` and the fp tokens are unsmoothed (the kernel multiplies
    ``q`` by ``std`` and smooths the fp keys; the lse is that of the scores ``q . (k - mean)``). ``threads``: split-KV threads (default: torch's thread count once the work is big enough);
    ``out [B, Hq, D]`` / ``lse [B, Hq]``: fp32 contiguous buffers to write into (default: new).
    ``extra``: more segments (:class:`kvquant.kernels.backend.SegmentRead`) in the same softmax;
    ``rotation``: the stores hold Hadamard-rotated vectors, ``q``, the fp tokens and ``out`` do not
    (the kernel rotates them in and the output back).
    Raises ``RuntimeError`` when the kernel is unavailable (check :func:`native_available`) and
    ``ValueError`` for a format it does not read.

    Example:
        >>> out, lse = decode_attention_native(q, *k_parts, *v_parts, k_fmt="int4", v_fmt="int4",
        ...     k_group=64, v_group=64, k_axis="token", start=torch.zeros(1, dtype=torch.long),
        ...     end=k_parts[0].shape[2], scaling=0.125)
    """
    run = NativeDecode(
        (k_codes, k_scale, k_zero),
        (v_codes, v_scale, v_zero),
        k_fmt=k_fmt,
        v_fmt=v_fmt,
        k_group=k_group,
        v_group=v_group,
        k_axis=k_axis,
        head_dim=q.shape[-1],
        scaling=scaling,
        softcap=softcap,
        extra=extra,
        rotation=rotation,
    )
    bounds = tuple((s.start, s.end) for s in extra)
    return run(
        q,
        start,
        end,
        fp_k=fp_k,
        fp_v=fp_v,
        fp_valid=fp_valid,
        extra_bounds=bounds,
        smoothing=smoothing,
        out=out,
        lse=lse,
        threads=threads,
    )
