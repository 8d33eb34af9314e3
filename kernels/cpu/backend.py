"""The C kernels as the ``cpu`` backend of :mod:`kvquant.kernels.ops`."""

from __future__ import annotations

import torch

from kvquant.formats import format_spec
from kvquant.formats.trellis import TRELLIS_STATE_BITS, TWO_PASS_FROM, trellis_table
from kvquant.kernels.backend import (
    Backend,
    DecodeCall,
    DequantizeCall,
    EncodeCall,
    QuantizeCall,
    RotateCall,
    TranscodeCall,
)
from kvquant.kernels.cpu.binding import (
    DECODE_FORMATS,
    MAX_HEAD_DIM,
    QUANTIZE_FORMATS,
    SCALE_DTYPES,
    TRELLIS_FORMATS,
    WRITTEN_SCALE_DTYPES,
    NativeDecode,
    decode_attention_native,
    writes_head,
)
from kvquant.kernels.cpu.build import native_available, native_error
from kvquant.kernels.cpu.rowwise import (
    dequantize_native,
    rotate_native,
    rotate_pair_native,
)
from kvquant.kernels.cpu.step import NativeAppendStep
from kvquant.kernels.cpu.writes import (
    NativeTranscode,
    NativeWrite,
    quantize_into,
    transcode_native,
    trellis_encode_native,
)


class CpuBackend(Backend):
    """The C kernels on CPU: decode of every quantized format (codes read one by one or, trellis,
    by their state; not ``none``) up to ``MAX_HEAD_DIM``, full-precision tokens in the same call;
    quantize of the integer, codebook, fp8 and trellis formats on the token axis with computed
    scales (the integer formats also on the channel axis: KIVI's keys); the trellis search; the
    Hadamard rotation; dequantizing a store's rows (tokens moving between tiers)."""

    name = "cpu"
    devices = frozenset({"cpu"})
    takes_fp_tokens = True
    takes_segments = True
    takes_rotation = True
    takes_fp_segments = True
    takes_smoothing = True

    def available(self) -> str | None:
        return None if native_available() else f"C kernels unavailable: {native_error()}"

    def supports_decode(self, call: DecodeCall) -> str | None:
        if not set(call.formats) <= DECODE_FORMATS:
            return f"reads {', '.join(sorted(DECODE_FORMATS))}"
        if call.head_dim > MAX_HEAD_DIM:
            return f"head_dim up to {MAX_HEAD_DIM}"
        if not set(call.scale_dtypes) <= set(SCALE_DTYPES):
            return "scales in fp32 / fp16 / bf16 / fp8_e4m3"
        return None

    def supports_quantize(self, call: QuantizeCall) -> str | None:
        if call.fmt not in QUANTIZE_FORMATS:
            return f"writes {', '.join(sorted(QUANTIZE_FORMATS))}"
        if call.static_scale or not (call.axis == "token" or format_spec(call.fmt).integer):
            return "computed scales along the token axis (an integer format: also the channel axis)"
        if call.scale_dtype not in WRITTEN_SCALE_DTYPES:
            return "scales in fp32 / fp16 / bf16 / fp8_e4m3"
        if not writes_head(call.fmt, call.head_dim):
            return "trellis codes: a head of at least one state, in whole bytes"
        return None

    def supports_encode(self, call: EncodeCall) -> str | None:
        if call.fmt not in TRELLIS_FORMATS:
            return f"searches {', '.join(sorted(TRELLIS_FORMATS))}"
        spec = format_spec(call.fmt)
        if call.head_dim * spec.bits < spec.state_bits:
            return "a head of at least one state"
        return None

    def supports_dequantize(self, call: DequantizeCall) -> str | None:
        if call.fmt not in DECODE_FORMATS:
            return f"reads {', '.join(sorted(DECODE_FORMATS))}"
        if call.head_dim > MAX_HEAD_DIM:
            return f"head_dim up to {MAX_HEAD_DIM}"
        if call.scale_dtype not in SCALE_DTYPES:
            return "scales in fp32 / fp16 / bf16 / fp8_e4m3"
        return None

    def supports_transcode(self, call: TranscodeCall) -> str | None:
        if call.dst_axis != "token":
            return "into a store along the token axis"
        read, write = call.parts()
        return self.supports_dequantize(read) or self.supports_quantize(write)

    def supports_rotate(self, call: RotateCall) -> str | None:
        return None  # ops checks the head size (a power of two) for every backend

    def decode_attention(self, *tensors, **kw):
        return decode_attention_native(*tensors, **kw)

    def plan_decode(self, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, **kw) -> NativeDecode:
        return NativeDecode((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), **kw)

    def quantize_append(self, x, codes, scale, zero, index, *, fmt, group_size, axis, static_scale) -> bool:
        return quantize_into(x, codes, scale, zero, index, fmt, group_size if axis == "channel" else 1)

    def plan_quantize(self, codes, scale, zero, *, fmt, group_size, axis, static_scale) -> NativeWrite:
        return NativeWrite(codes, scale, zero, fmt, group_size if axis == "channel" else 1)

    def encode(self, y: torch.Tensor, fmt: str) -> torch.Tensor:
        return search(y, format_spec(fmt).bits)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_native(x)

    def rotate_pair(self, k, v, mean, std):
        return rotate_pair_native(k, v, mean, std)

    def dequantize(self, codes, scale, zero, i0, i1, **kw) -> torch.Tensor:
        return dequantize_native(codes, scale, zero, i0, i1, **kw)

    def transcode(self, src, i0, i1, dst, index, *, via, head_dim) -> bool:
        return transcode_native(src, i0, i1, dst[:4], index, via=via, head_dim=head_dim)

    def plan_transcode(self, src, dst, *, via, head_dim) -> NativeTranscode:
        return NativeTranscode(src, dst[:4], via=via, head_dim=head_dim)

    def plan_append_step(self, tail, stats, rotation, first, move, *, head_dim) -> NativeAppendStep | None:
        tail_k, tail_v = tail
        dense = (tail_k, tail_v, *(t for t in stats if t is not None))
        if any(t.dtype != torch.float32 or t.is_cuda for t in dense) or tail_k.stride() != tail_v.stride():
            return None  # (fp32 rows on the host: what the step copies and transforms in place)
        if any(t is not None and not t.is_contiguous() for t in stats) or tail_k.stride(-1) != 1:
            return None
        if any(dst[5] != "token" or dst[6] for dst in first + (() if move is None else move[1])):
            return None
        return NativeAppendStep(*tail, *stats, rotation, first, move, head_dim=head_dim)


def search(y: torch.Tensor, bits: int) -> torch.Tensor:
    """The trellis search in C: codes ``[N, D]`` (uint8) of ``y[N, D]`` (CPU), those of
    :func:`kvquant.formats.trellis.trellis_encode`; an ``Encoder`` for :func:`kvquant.formats.quantize`."""
    codes = trellis_encode_native(y, bits, TRELLIS_STATE_BITS[bits], trellis_table(bits), TWO_PASS_FROM)
    if codes is None:  # (not built: ops never picks this backend then)
        raise RuntimeError(f"C trellis search unavailable: {native_error()}")
    return codes


BACKEND = CpuBackend()
