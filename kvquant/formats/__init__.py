"""The numeric spec of kvquant's KV formats, in plain torch: one :class:`FormatSpec` object per format.

This package knows nothing about transformers, Triton or C and imports nothing else of kvquant: it
turns a block of head vectors ``x[B, H, T, D]`` into codes + scales (+ zero points) and back. The
kernels (``kvquant.kernels``) follow exactly this spec and are tested against it.

Formats (:func:`format_spec` returns the object; its family class in :mod:`.families`)
-------
``none``      pass-through: the tensor itself, in its own dtype (no scales)
``int8``      symmetric, ``code = round(x / s)`` in ``[-127, 127]``, stored as ``torch.int8``
``int4``      asymmetric, ``code = round((x - m) / s)`` in ``[0, 15]``, two codes per byte
``int3``      asymmetric, ``code = round((x - m) / s)`` in ``[0, 7]``, 3 bits per code (bit planes)
``int2``      asymmetric, ``code = round((x - m) / s)`` in ``[0, 3]``, four codes per byte
``nuq4`` / ``nuq3`` / ``nuq2``  non-uniform: the index of the nearest of the 16 / 8 / 4 Lloyd-Max
              levels of a standard normal, times one scale per group (no zero point): of the
              multiples ``CODEBOOK_SCALE_GRID`` of the group's RMS and ``max|x| / top level``, the
              one with the least squared error, stretched so the group keeps its norm (nearest
              levels alone shrink vectors, hence attention scores).
              Matched to head vectors made Gaussian-like by the Hadamard rotation (TurboQuant,
              KVQuant's nuq); codes packed like the integers of the same width.
``tcq3`` / ``tcq2`` / ``tcq1``  trellis codes (:mod:`kvquant.formats.trellis`): 3 / 2 / 1 bits per
              channel (``nuq3`` / ``nuq2`` / the sign), but a channel's level is read from a table at the state formed by
              its code and the codes of the channels before it (circularly); the codes of a head
              vector are picked together by the Viterbi algorithm, for the least squared error. One
              scale per group: the group's RMS for the search, then stretched so the group keeps
              its norm (rounded to nearest). No per-element bound (errors are traded between
              channels).
``fp8_e4m3``  scaled, ``code = fp8(x / s)`` with ``s = amax / 448``
``fp8_e5m2``  scaled, ``code = fp8(x / s)`` with ``s = amax / 57344``

Scale granularity (``axis``)
---------------------------
``token``    one scale per (token, head, group of ``G`` channels): scales ``[B, H, T, D // G]``.
             ``G == D`` is the default "per-head" scale.
``channel``  keys only (KIVI): one scale per (channel, block of ``G`` tokens): scales
             ``[B, H, T // G, D]``; ``T`` must be a multiple of ``G``.

Packing: planar (:mod:`.packing`), one shift and mask per channel slice.

Scales and zero points are stored in ``scale_dtype`` (fp16 by default; ``float8_e4m3`` halves
their cost, 8 bits per group, at a step of up to 12.5%: meant for codebook scales, which the
codes are re-picked for, not for integer zero points). They are rounded
*outward* when stored (scale up, zero point ``m`` down) and the codes are computed from the stored
values, so every element stays within half a quantization step of its input: no clipping. A zero
range gets scale 1 (an all-zero vector round-trips exactly; codebooks, whose levels hold no zero,
store scale 0 for an all-zero group); a scale the dtype cannot hold, or a NaN/Inf input, raises
``ValueError``.

Example:
    >>> x = torch.randn(1, 2, 5, 64)                      # [B, H, T, D]
    >>> q = quantize(x, "nuq4", group_size=32)
    >>> q.codes.shape, q.scale.shape
    (torch.Size([1, 2, 5, 32]), torch.Size([1, 2, 5, 2]))
    >>> format_spec("nuq4").bytes_per_token(64, 32, "token", 2)
    36.0
"""

from kvquant.formats.codec import QuantizedBlock, dequantize, error_bound, is_static_scale, quantize
from kvquant.formats.families import CODEBOOK_SCALE_GRID, TRELLIS_QMAX
from kvquant.formats.packing import pack_codes, unpack_codes
from kvquant.formats.registry import FORMAT_NAMES, format_spec
from kvquant.formats.rounding import round_to_dtype
from kvquant.formats.spec import AXES, SCALE_DTYPES, Encoder, FormatSpec, TritonRead, lloyd_max_levels

__all__ = [
    "AXES",
    "CODEBOOK_SCALE_GRID",
    "FORMAT_NAMES",
    "SCALE_DTYPES",
    "TRELLIS_QMAX",
    "Encoder",
    "FormatSpec",
    "QuantizedBlock",
    "TritonRead",
    "dequantize",
    "error_bound",
    "format_spec",
    "is_static_scale",
    "lloyd_max_levels",
    "pack_codes",
    "quantize",
    "round_to_dtype",
    "unpack_codes",
]
