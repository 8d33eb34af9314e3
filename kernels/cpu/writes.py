"""The C kernels' writes into a store's buffers, tensor side: quantize-on-append (``kvq_quantize``,
the writers described once per buffer layout), transcode between two stores (``kvq_transcode``) and
the trellis search (``kvq_trellis_encode``). Operands as :mod:`kvquant.kernels.cpu.binding` describes
them; the results equal :func:`kvquant.formats.quantize` (bit-exact) and the torch trellis search.

Example:
    >>> codes = torch.empty(1, 2, 8, 32, dtype=torch.uint8)               # nuq4, head_dim 64
    >>> scale = torch.empty(1, 2, 8, 1, dtype=torch.float16)
    >>> quantize_into(torch.randn(1, 2, 3, 64), codes, scale, None, 0, "nuq4")
    True
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvquant.formats import format_spec
from kvquant.formats.trellis import TWO_PASS_FROM
from kvquant.kernels.cpu.binding import (
    QUANTIZE_FORMATS,
    SCALE_DTYPES,
    WRITTEN_SCALE_DTYPES,
    buffer_layout,
    cached_operand,
    elem_strides,
    remember,
    search_threads,
    write_threads,
    writer_symbol,
    writes_head,
)
from kvquant.kernels.cpu.build import Writer, library


def native_quantizes(store, x: torch.Tensor) -> bool:
    """Whether :func:`quantize_into_store` applies: CPU, a format of ``QUANTIZE_FORMATS`` with
    computed scales along the token axis (an integer format also along the channel axis), a scale
    dtype the kernels write, and the kernels built."""
    return (
        not x.is_cuda
        and (store.axis == "token" or (store.axis == "channel" and format_spec(store.fmt).integer))
        and store.static_scale is None
        and store.fmt in QUANTIZE_FORMATS
        and writes_head(store.fmt, x.shape[-1])
        and store.scale_dtype in WRITTEN_SCALE_DTYPES
        and library() is not None
    )


def quantize_into_store(store, index: int, x: torch.Tensor) -> bool:
    """Quantize ``x [B, H, n, D]`` into ``store`` (a :class:`kvquant.store.TokenStore`) at buffer
    index ``index``, in place, with the C twin of :func:`kvquant.formats.quantize` (bit-exact).

    Returns False, writing nothing the store counts, where the kernel does not apply (see
    :func:`native_quantizes`) or the input is one the spec refuses; the caller then takes the torch
    path, which raises the spec's error for such inputs.
    """
    if not native_quantizes(store, x):
        return False
    return quantize_into(x, store.codes, store.scale, store.zero, index, store.fmt, store.block)


@functools.cache
def _codebook_tables(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A codebook's levels (padded to 16 entries) and its scale search grid, fp32, built once."""
    spec = format_spec(fmt)
    return spec.lut(), torch.tensor(spec.scale_search, dtype=torch.float32)


_WRITER_KINDS = {
    "kvq_quantize": 0,
    "kvq_quantize_codebook": 1,
    "kvq_quantize_fp8": 2,
    "kvq_quantize_trellis": 3,
}
_WRITERS: dict[tuple, Writer] = {}  # described writes by buffer address and layout (see cached_writer)


def _writer_of(codes, scale, zero, fmt: str, block: int = 1) -> Writer:
    """Describe the writes into one store's buffers (at token 0): pointers, strides and the
    format's constants and tables (built once per format, kept alive by their caches); ``block``:
    tokens per scale row (an integer format's channel-axis keys), else 1."""
    spec = format_spec(fmt)
    w = Writer(codes.data_ptr(), *elem_strides(codes))
    w.block = block
    w.scale = scale.data_ptr()
    w.zero = None if zero is None else zero.data_ptr()
    w.ssb, w.ssh, w.sst = elem_strides(scale)
    w.kind = _WRITER_KINDS[writer_symbol(spec)]
    w.scale_dtype, w.n_groups = SCALE_DTYPES[scale.dtype], scale.shape[-1]
    w.bits, w.is_signed = spec.bits, int(spec.signed)
    if w.kind == 1:
        levels, grid = _codebook_tables(fmt)
        w.levels, w.grid, w.n_grid, w.qmax = levels.data_ptr(), grid.data_ptr(), grid.numel(), spec.qmax
    elif w.kind == 2:
        w.mant, w.bias, w.qmax = spec.mantissa_bits, spec.exponent_bias, spec.qmax
    elif w.kind == 3:
        w.state_bits, w.table, w.two_pass_from = spec.state_bits, spec.state_table().data_ptr(), TWO_PASS_FROM
    return w


def cached_writer(codes, scale, zero, fmt: str, block: int = 1) -> Writer:
    """:func:`_writer_of`, memoised as :func:`cached_operand` is: a pure function of the format, the
    block and each buffer's address, shape, strides and dtype (a store writes into the same buffers
    step after step)."""
    key = (fmt, block, buffer_layout(codes), buffer_layout(scale), buffer_layout(zero))
    w = _WRITERS.get(key)
    return w if w is not None else remember(_WRITERS, key, _writer_of(codes, scale, zero, fmt, block))


class NativeWrite:
    """:func:`quantize_into` for fixed buffers: the writer described once (``codes``, ``scale``,
    ``zero`` as :func:`quantize_into` takes them), each call passes ``x`` and ``index``: ``run(x,
    index) -> bool`` (False: the spec refuses these values, nothing counted written). ``block``:
    tokens per scale row, as :func:`quantize_into` takes it.

    Example:
        >>> run = NativeWrite(codes, scale, None, "nuq4")
        >>> run(torch.randn(1, 2, 1, 64), 5)
        True
    """

    def __init__(self, codes, scale, zero, fmt: str, block: int = 1):
        self._w = cached_writer(codes, scale, zero, fmt, block)
        self._keep = (codes, scale, zero)  # the buffers written stay alive with the plan
        self._fn, self._fmt, self._block = library().kvq_write, fmt, block

    def __call__(self, x: torch.Tensor, index: int) -> bool:
        g = self._block
        if g > 1 and (index % g or x.shape[2] % g):
            raise ValueError(
                f"index / n: channel axis needs both multiples of group_size {g}, got {index}, {x.shape[2]}"
            )
        xf = x.float()
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        b, h, n, d = xf.shape
        rc = self._fn(
            ctypes.byref(self._w),
            xf.data_ptr(),
            b,
            h,
            n,
            d,
            *elem_strides(xf),
            index,
            write_threads(self._fmt, b * h * n),
        )
        if rc < 0:
            raise MemoryError("native CPU quantize kernel: out of memory")
        return rc == 0


def quantize_into(x, codes, scale, zero, index: int, fmt: str, block: int = 1) -> bool:
    """``x [B, H, n, D]`` into the buffers ``codes [B, H, cap, W]``, ``scale`` / ``zero
    [B, H, cap, D / G]`` at buffer index ``index`` (a format of ``QUANTIZE_FORMATS``, token axis,
    fp32 / fp16 / bf16 / fp8 e4m3 scales, CPU, the kernels built, a head :func:`writes_head`
    takes): the integer formats, the codebooks' scale search, fp8 and the trellis codes with their
    scales, bit-identical to :func:`kvquant.formats.quantize` (sums of squares in torch's order;
    where torch's square root lands an ulp off, a scale an ulp off: see ``quantize_cpu.c``). An
    integer format also along the channel axis (KIVI's keys): ``block`` = G tokens per scale row,
    ``scale`` / ``zero [B, H, cap / G, D]``, ``index`` and ``n`` multiples of G. False where the
    spec refuses the values (NaN / Inf, a scale the dtype cannot hold): nothing counted written.

    Example:
        >>> codes = torch.empty(1, 2, 8, 32, dtype=torch.uint8)               # nuq4, head_dim 64
        >>> scale = torch.empty(1, 2, 8, 1, dtype=torch.float16)
        >>> quantize_into(torch.randn(1, 2, 3, 64), codes, scale, None, 0, "nuq4")
        True
    """
    if block > 1 and not format_spec(fmt).integer:
        raise ValueError(f"fmt: the C kernels quantize {fmt} along the token axis only")
    return NativeWrite(codes, scale, zero, fmt, block)(x, index)


_VIA = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the dtypes a transcode rounds through


class NativeTranscode:
    """:func:`transcode_native` between fixed buffers: source operand and destination writer
    described once (``src`` / ``dst`` as :func:`transcode_native` takes them), each call passes the
    range: ``run(i0, i1, index) -> bool`` (False: refused, nothing counted written).

    Example:
        >>> run = NativeTranscode(src, dst, via=torch.float32, head_dim=64)
        >>> run(3, 4, 10)
        True
    """

    def __init__(self, src: tuple, dst: tuple, *, via: torch.dtype, head_dim: int):
        codes, scale, zero, fmt, group, axis = src
        self._keep: list = [
            codes,
            scale,
            zero,
            *dst[:3],
        ]  # (the buffers read and written stay alive with the plan)
        self._op = cached_operand(codes, scale, zero, fmt, group, axis, self._keep)
        self._w = cached_writer(*dst)
        self._fn, self._b, self._h = library().kvq_transcode, codes.shape[0], codes.shape[1]
        self._d, self._via, self._dst_fmt = head_dim, _VIA[via], dst[3]

    def __call__(self, i0: int, i1: int, index: int) -> bool:
        b, h, n = self._b, self._h, i1 - i0
        rc = self._fn(
            ctypes.byref(self._op), b, h, i0, n, self._d, ctypes.byref(self._w), index, self._via,
            write_threads(self._dst_fmt, b * h * n),
        )  # fmt: skip
        if rc < 0:
            raise MemoryError("native CPU transcode: out of memory")
        return rc == 0


def transcode_native(src, i0: int, i1: int, dst, index: int, *, via: torch.dtype, head_dim: int) -> bool:
    """Buffer indices ``[i0, i1)`` of ``src`` (codes, scale, zero, fmt, group, axis as
    :func:`dequantize_native` takes them) dequantized, rounded through ``via`` and quantized into
    ``dst`` (codes, scale, zero, fmt as :func:`quantize_into` takes them) at ``index``: one C call,
    the results of :func:`dequantize_native` ``.to(via)`` then :func:`quantize_into`. False where
    the destination's spec refuses the values (nothing counted written)."""
    return NativeTranscode(src, dst, via=via, head_dim=head_dim)(i0, i1, index)


def trellis_encode_native(
    y: torch.Tensor, bits: int, state_bits: int, table: torch.Tensor, two_pass_from: int
):
    """Codes ``[N, D]`` (uint8) of :func:`kvquant.trellis.trellis_encode` for CPU ``y[N, D]``, from the C
    twin (the same codes), or None where it does not apply (not on CPU, or no kernel built)."""
    lib = library()
    if y.is_cuda or lib is None:
        return None
    yc = y.float().contiguous()
    tc = table.float().contiguous()
    n, d = yc.shape
    codes = torch.empty(n, d, dtype=torch.uint8)
    rc = lib.kvq_trellis_encode(
        yc.data_ptr(),
        n,
        d,
        tc.data_ptr(),
        bits,
        state_bits,
        two_pass_from,
        codes.data_ptr(),
        search_threads(n),
    )
    if rc < 0:
        raise MemoryError("native CPU trellis encoder: out of memory")
    return codes
