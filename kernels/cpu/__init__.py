"""The C kernels on CPU (``decode_cpu.c``): decode attention, quantize-on-append, the trellis search.

``build`` compiles and loads the library at first use, ``binding`` describes tensors to it and calls
the decode (``writes``: quantize, transcode, trellis search; ``rowwise``: rotation, dequantize), ``backend``
offers it to :mod:`kvquant.kernels.ops` as the ``cpu`` backend. Public here: whether it is built
(:func:`native_available`, :func:`native_error`) and its calls.

Example:
    >>> from kvquant.kernels.cpu import native_available, native_error
    >>> native_available() or native_error()
    True
"""

from kvquant.kernels.cpu.binding import (
    MAX_HEAD_DIM,
    decode_attention_native,
    native_formats_ok,
)
from kvquant.kernels.cpu.build import native_available, native_error
from kvquant.kernels.cpu.writes import (
    native_quantizes,
    quantize_into,
    quantize_into_store,
    trellis_encode_native,
)

__all__ = [
    "MAX_HEAD_DIM",
    "decode_attention_native",
    "native_available",
    "native_error",
    "native_formats_ok",
    "native_quantizes",
    "quantize_into",
    "quantize_into_store",
    "trellis_encode_native",
]
