"""The registry: one :class:`~kvquant.formats.spec.FormatSpec` object per format name."""

from __future__ import annotations

import torch

from kvquant.formats.families import (
    TRELLIS_QMAX,
    AsymmetricInt,
    Codebook,
    Fp8,
    PassThrough,
    SymmetricInt,
    Trellis,
)
from kvquant.formats.spec import FormatSpec

_SPECS: dict[str, FormatSpec] = {
    s.name: s
    for s in (
        PassThrough("none", 16, float("inf"), None),
        SymmetricInt("int8", 8, 127.0, torch.int8),
        AsymmetricInt("int4", 4, 15.0, torch.uint8),
        AsymmetricInt("int3", 3, 7.0, torch.uint8),
        AsymmetricInt("int2", 2, 3.0, torch.uint8),
        Fp8("fp8_e4m3", 8, 448.0, torch.float8_e4m3fn),
        Fp8("fp8_e5m2", 8, 57344.0, torch.float8_e5m2),
        # qmax: the top Lloyd-Max level (a test checks it against lloyd_max_levels)
        Codebook("nuq4", 4, 2.732590, torch.uint8),
        Codebook("nuq3", 3, 2.151946, torch.uint8),
        Codebook("nuq2", 2, 1.510418, torch.uint8),
        # qmax: the largest |table entry| (a test checks it against the tables)
        Trellis("tcq3", 3, TRELLIS_QMAX[3], torch.uint8),
        Trellis("tcq2", 2, TRELLIS_QMAX[2], torch.uint8),
        Trellis("tcq1", 1, TRELLIS_QMAX[1], torch.uint8),
    )
}
FORMAT_NAMES = tuple(_SPECS)


def format_spec(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of ``name``; ``ValueError`` naming the allowed names otherwise.

    Example:
        >>> spec = format_spec("int4")
        >>> spec.bits, spec.has_zero, spec.code_width(64)
        (4, True, 32)
    """
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"format: unknown format {name!r}; allowed: {', '.join(FORMAT_NAMES)}") from None
