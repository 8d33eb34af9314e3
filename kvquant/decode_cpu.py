"""Moved to :mod:`kvquant.kernels.chunked` (the ``chunked`` backend of :mod:`kvquant.kernels.ops`)."""

# shim: removed once the cache calls kernels.ops
from kvquant.kernels.chunked import decode_attention_torch  # noqa: F401
