"""The Triton kernels as a backend of :mod:`kvquant.kernels.ops` (CUDA; the interpreter when forced).

Decode reads every format with a :class:`~kvquant.formats.TritonRead` (all of them: integers
including int3's two planes, fp8, the codebooks and the trellis codes through their level tables)
at power-of-two head sizes from 16 on, with fp32 / fp16 / bf16 / float8_e4m3 scales. Quantize writes
the formats with Triton quantize constexprs (``FormatSpec.triton_write``: integers, fp8, the
codebooks with their scale search in the kernel; head size and group size powers of two), the codes
and scales of :func:`kvquant.formats.quantize` (bit for bit, except codebook scales in fp32, whose
RMS is summed in another order: equal squared error, see ``quantize.py``); the trellis codes
take the spec's scales (device torch) around the Triton Viterbi kernel (``encode``, :mod:`.trellis`).
Dequantize reads what decode reads, bit for bit (:mod:`.dequantize`); ``transcode`` (a recent
window's oldest tokens into the main store) is then that kernel and the quantize kernel. What it
supports is derived from the format specs, never from names. NaN / Inf inputs and
scales the dtype cannot hold do not stop the quantize kernel: it raises the device's
:func:`kvquant.kernels.backend.deferred_flag` in place, raised as ``ValueError`` at the next
:func:`kvquant.kernels.ops.raise_deferred` (no launch and no host sync of its own); under the
interpreter at once.
"""

from __future__ import annotations

import torch

from kvquant.formats import FORMAT_NAMES, format_spec
from kvquant.kernels.backend import (
    Backend,
    DecodeCall,
    DequantizeCall,
    EncodeCall,
    QuantizeCall,
    deferred_flag,
    raise_deferred,
)

try:
    import triton  # noqa: F401

    _IMPORT_ERROR = None
except ImportError as err:  # pragma: no cover - triton is a linux dependency
    _IMPORT_ERROR = str(err)

# what the kernels read (every format with a TritonRead) and write (with Triton quantize constexprs;
# the trellis codes: the spec's scales around the Triton search), derived from the specs
FORMATS = frozenset(n for n in FORMAT_NAMES if format_spec(n).triton_read() is not None)
WRITE_FORMATS = frozenset(n for n in FORMAT_NAMES if format_spec(n).triton_write() is not None)
SEARCH_FORMATS = frozenset(n for n in FORMAT_NAMES if format_spec(n).state_bits is not None)  # Viterbi kernel
SCALE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn})


def _pow2(n: int | None) -> bool:
    return n is not None and n > 0 and n & (n - 1) == 0


class TritonBackend(Backend):
    name = "triton"
    devices = frozenset({"cuda"})
    interpretable = True
    takes_fp_tokens = True  # (each segment one launch of the split kernel, one merge: no torch ops)
    takes_segments = True

    def available(self) -> str | None:
        return None if _IMPORT_ERROR is None else f"triton not importable: {_IMPORT_ERROR}"

    def supports_decode(self, call: DecodeCall) -> str | None:
        if not set(call.formats) <= FORMATS:
            return f"reads {', '.join(sorted(FORMATS))}"
        if not (_pow2(call.head_dim) and call.head_dim >= 16):
            return "head_dim a power of two >= 16"
        if not set(call.scale_dtypes) <= SCALE_DTYPES:
            return "scales in fp32 / fp16 / bf16 / fp8_e4m3"
        return None

    def supports_quantize(self, call: QuantizeCall) -> str | None:
        if call.fmt in SEARCH_FORMATS:  # the spec's scales (device torch) around the Viterbi kernel
            return self.supports_encode(EncodeCall(call.fmt, call.head_dim, call.device))
        if call.fmt not in WRITE_FORMATS:
            return f"writes {', '.join(sorted(WRITE_FORMATS | SEARCH_FORMATS))}"
        if not (_pow2(call.head_dim) and _pow2(call.group_size)):
            return "head_dim and group_size powers of two"
        if call.scale_dtype is not None and call.scale_dtype not in SCALE_DTYPES:
            return "scales in fp32 / fp16 / bf16 / fp8_e4m3"
        spec = format_spec(call.fmt)
        if spec.token_axis_only and call.axis != "token":
            return "scales along the token axis"
        if call.static_scale and not spec.takes_static_scale:
            return "static scales of int8 / fp8"
        return None

    def supports_dequantize(self, call: DequantizeCall) -> str | None:
        if call.fmt not in FORMATS or call.scale_dtype is None:
            return f"reads {', '.join(sorted(FORMATS - {'none'}))}"
        if not (_pow2(call.head_dim) and call.head_dim >= 16):
            return "head_dim a power of two >= 16"
        if call.scale_dtype not in SCALE_DTYPES:
            return "scales in fp32 / fp16 / bf16 / fp8_e4m3"
        return None

    def dequantize(self, codes, scale, zero, i0, i1, **kw) -> torch.Tensor:
        from kvquant.kernels.triton.dequantize import dequantize

        return dequantize(codes, scale, zero, i0, i1, **kw)

    def supports_encode(self, call: EncodeCall) -> str | None:
        if call.fmt not in SEARCH_FORMATS:
            return f"searches {', '.join(sorted(SEARCH_FORMATS))}"
        spec = format_spec(call.fmt)
        if call.head_dim * spec.bits < spec.state_bits:
            return "a head of at least one state"
        return None

    def encode(self, y: torch.Tensor, fmt: str) -> torch.Tensor:
        from kvquant.kernels.triton.trellis import trellis_encode_triton

        return trellis_encode_triton(y, format_spec(fmt).bits)

    def decode_attention(self, *tensors, **kw):
        from kvquant.kernels.triton.decode_attention import quantized_decode_attention

        return quantized_decode_attention(*tensors, **kw)

    def quantize_append(self, x, codes, scale, zero, index, *, fmt, group_size, axis, static_scale) -> bool:
        from kvquant.kernels.triton.quantize import quantize_append

        flag = deferred_flag(x.device)
        quantize_append(
            x, codes, scale, zero, index, fmt, group_size, axis, static_scale=static_scale, flag=flag
        )
        if not x.is_cuda:  # the interpreter: raise at once, as the other CPU backends do
            raise_deferred(x.device)
        return True


BACKEND = TritonBackend()
