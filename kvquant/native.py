"""Moved to :mod:`kvquant.kernels.cpu` (the C kernels are a backend of :mod:`kvquant.kernels.ops`)."""

# shim: removed once the cache calls kernels.ops
from kvquant.kernels.cpu import (  # noqa: F401
    MAX_HEAD_DIM,
    decode_attention_native,
    native_available,
    native_error,
    native_formats_ok,
    native_quantizes,
    quantize_into_store,
    trellis_encode_native,
)
