"""``FormatSpec``: what one format is made of, and the helpers every family shares.

A format is one small subclass (see :mod:`kvquant.formats.families`) that answers, as data and
methods, every question code used to ask by comparing kinds: does it have scales, zero points,
packed codes, a static scale; how a grouped block becomes codes + scales; what a code means before
scaling; how far an element may move; how many bytes a token costs; and what the kernels need (C:
bits, signedness, a code -> level table; Triton: its constexprs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvquant.formats.packing import unpack_codes

AXES = ("token", "channel")
SCALE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3": torch.float8_e4m3fn,
}
# encoder(y[N, D] in units of the scale, bits) -> codes[N, D] uint8: the search of a trellis code
Encoder = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True, eq=False)
class TritonRead:
    """What the Triton decode kernel needs to read one format's codes (its constexprs and a table).

    ``bits``: bits per stored code (16: pass-through, the raw tensor); ``fp8``: 0, 1 e4m3fn, 2 e5m2
    (decoded from the byte); ``lut``: 0 the code is the value, 1 the value is ``table[code]``, 2 it
    is ``table[state]`` with the state formed from ``state_codes`` codes (the channel's and those of
    the channels before it, circularly); ``exact_f16``: every value is exact in fp16 (the kernel
    folds scales out of fp16 dot products; table values, not exact, enter them as two fp16 halves); ``table``: fp32 ``[n]`` levels where ``lut`` > 0.

    Example:
        >>> from kvquant.formats import format_spec
        >>> r = format_spec("tcq2").triton_read()
        >>> r.bits, r.lut, r.state_codes, r.table.numel()
        (2, 2, 4, 256)
    """

    bits: int
    fp8: int = 0
    lut: int = 0
    state_codes: int = 1
    exact_f16: bool = True
    table: torch.Tensor | None = field(default=None, repr=False)


@functools.cache
def _lloyd_max(bits: int) -> tuple[float, ...]:
    n = 2**bits
    phi = lambda t: math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    levels = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(2000):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels[:-1], levels[1:], strict=True)] + [math.inf]
        new = []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            pa = 0.0 if a == -math.inf else phi(a)
            pb = 0.0 if b == math.inf else phi(b)
            new.append((pa - pb) / (cdf(b) - cdf(a)))
        done = max(abs(x - y) for x, y in zip(new, levels, strict=True)) < 1e-12
        levels = new
        if done:
            break
    return tuple(levels)


_LEVELS: dict[int, torch.Tensor] = {}


def lloyd_max_levels(bits: int) -> torch.Tensor:
    """The ``2**bits`` Lloyd-Max levels of a standard normal (MSE-optimal scalar quantizer), fp32.

    Computed by Lloyd's iteration on the exact normal density (thresholds at midpoints, levels at
    the conditional means), to convergence in float64. 2 bits: ``±0.4528, ±1.5104``.

    Example:
        >>> [round(v, 4) for v in lloyd_max_levels(2).tolist()]
        [-1.5104, -0.4528, 0.4528, 1.5104]
    """
    if bits not in _LEVELS:
        _LEVELS[bits] = torch.tensor(_lloyd_max(bits), dtype=torch.float32)
    return _LEVELS[bits]


# --------------------------------------------------------------------------------------------- grouping


def group_view(x: torch.Tensor, group_size: int, axis: str) -> tuple[torch.Tensor, int]:
    """View ``x[B, H, T, D]`` so that one scale group is one slice along the returned dim."""
    b, h, t, d = x.shape
    if axis == "token":
        if d % group_size:
            raise ValueError(f"group_size: {group_size} does not divide head_dim {d}")
        return x.reshape(b, h, t, d // group_size, group_size), -1  # [B, H, T, D/G, G]
    if axis == "channel":
        if t % group_size:
            raise ValueError(
                f"channel-axis quantization needs T ({t}) to be a multiple of group_size {group_size}"
            )
        return x.reshape(b, h, t // group_size, group_size, d), -2  # [B, H, T/G, G, D]
    raise ValueError(f"axis: unknown axis {axis!r}; allowed: {', '.join(AXES)}")


def check_finite(x: torch.Tensor, *stats: torch.Tensor, scale_dtype: torch.dtype) -> None:
    """``ValueError`` unless every statistic (scales, zero points) is finite: NaN / Inf in ``x``,
    else a scale ``scale_dtype`` cannot hold. One host sync."""
    ok = torch.stack([torch.isfinite(s.float()).all() for s in stats]).all()
    if bool(ok):
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError("input: key/value states contain NaN or Inf; refusing to quantize them")
    raise ValueError(
        f"scale_dtype: {scale_dtype} cannot hold the scale/zero point of these values "
        f"(|x| up to {x.abs().max().item():.3g}); use scale_dtype 'float32' or 'bfloat16'"
    )


# --------------------------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class FormatSpec:
    """What one format is made of (a subclass per family; the registry holds one object per name).

    ``qmax`` is the largest code magnitude (integers), the largest finite value (fp8) or the
    largest level (codebooks and trellis tables, in units of the scale). ``kind`` names the family
    (``passthrough``, ``int_sym``, ``int_asym``, ``float``, ``codebook``, ``trellis``) for reports;
    code asks the attributes and methods below instead.
    """

    name: str
    bits: int
    qmax: float
    code_dtype: torch.dtype | None  # None: the input's own dtype (pass-through)

    kind: ClassVar[str] = ""
    has_scale: ClassVar[bool] = True
    has_zero: ClassVar[bool] = False
    packed: ClassVar[bool] = False  # codes are bit-packed integers (``unpack_codes`` reads them)
    token_axis_only: ClassVar[bool] = False  # scales only along the token axis
    takes_static_scale: ClassVar[bool] = False  # codes may share one calibrated scale per head
    integer: ClassVar[bool] = False  # codes are rounded multiples of the scale (above a zero point)
    signed: ClassVar[bool] = False  # codes are signed integers
    elementwise: ClassVar[bool] = True  # a code decodes to its level alone (trellis: with neighbours)
    state_bits: ClassVar[int | None] = None  # trellis state bits L: codes searched jointly
    scale_search: ClassVar[tuple[float, ...] | None] = None  # multiples of the RMS tried as scales

    # ------------------------------------------------------------------------------------ layout

    @property
    def per_byte(self) -> int:
        """Codes per stored byte (1 for 8-bit formats; 3-bit codes do not fill whole bytes)."""
        return 8 // self.bits if self.bits < 8 else 1

    @property
    def planar(self) -> bool:
        """Packed as whole bit fields per byte (2 / 4 bits): channel slices unpack with one shift
        and mask each (3-bit codes are two planes of different widths)."""
        return self.packed and 8 % self.bits == 0

    @property
    def levels(self) -> torch.Tensor:
        """Codebook levels ``[2**bits]`` (ascending, fp32) of a ``codebook`` format."""
        return lloyd_max_levels(self.bits)

    def code_width(self, head_dim: int) -> int:
        """Stored elements per head vector along the last dim of ``codes``."""
        if self.bits >= 8:
            return head_dim
        return head_dim * self.bits // 8

    def bytes_per_token(
        self,
        head_dim: int,
        group_size: int,
        axis: str,
        scale_itemsize: int,
        static: bool = False,
        fp_itemsize: int = 2,
    ) -> float:
        """Bytes per token and head of codes + scales (+ zero points), scales amortized: the one
        formula behind bits per element, plan and memory reports.

        Example:
            >>> from kvquant.formats import format_spec
            >>> format_spec("int4").bytes_per_token(64, 64, "token", 2)   # 32 B codes + fp16 scale, zero
            36.0
        """
        if not self.has_scale:
            return float(head_dim * fp_itemsize)
        codes = self.code_width(head_dim)
        if static:
            return float(codes)
        per_scale = scale_itemsize * (2 if self.has_zero else 1)
        if axis == "channel":  # one row of D scales per block of group_size tokens
            return codes + head_dim * per_scale / group_size
        return float(codes + (head_dim // group_size) * per_scale)

    def bits_per_element(self, head_dim: int, group_size: int, axis: str, scale_itemsize: int, **kw) -> float:
        """:meth:`bytes_per_token` in bits per cached element."""
        return self.bytes_per_token(head_dim, group_size, axis, scale_itemsize, **kw) * 8 / head_dim

    # ------------------------------------------------------------------------------------ kernels

    def lut(self) -> torch.Tensor | None:
        """fp32 table code -> level where a kernel needs one (fp8: 256 entries, codebooks: levels
        padded to 16); None where the code is the level."""
        return None

    @property
    def state_codes(self) -> int:
        """Codes that form one state, the current one and those before it (trellis: ``state_bits /
        bits``, read circularly over the head); 0 where a code decodes alone."""
        return 0 if self.state_bits is None else self.state_bits // self.bits

    def state_table(self) -> torch.Tensor | None:
        """fp32 table state -> level (``[2**state_bits]``) of a trellis format; None elsewhere."""
        return None

    def triton_constants(self) -> tuple[int, int, float, int, int] | None:
        """``(KIND, BITS, QMAX, MANT, BIAS)`` constexprs of the Triton kernels (KIND 0 pass-through,
        1 signed int, 2 int with zero point, 3 fp8); None where they do not read this format."""
        return None

    def triton_read(self) -> TritonRead | None:
        """What the Triton decode kernel needs to read this format; None where it does not."""
        return None

    def triton_write(self) -> tuple[int, int, float, int, int] | None:
        """``(KIND, BITS, QMAX, MANT, BIAS)`` constexprs of the Triton quantize kernel (the kinds of
        :meth:`triton_constants`, plus 4: nearest codebook level with the scale search of
        :meth:`encode_groups`); None where the kernel does not write this format."""
        return self.triton_constants()

    # ------------------------------------------------------------------------------------ numerics

    def encode_groups(
        self, x: torch.Tensor, xg: torch.Tensor, red: int, scale_dtype: torch.dtype, encoder: Encoder | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Codes (unpacked, grouped like ``xg``), scale and zero point (keepdim along ``red``) of
        the groups ``xg`` of ``x[B, H, T, D]`` (fp32); ``ValueError`` for values it refuses."""
        raise NotImplementedError

    def encode_units(self, y: torch.Tensor) -> torch.Tensor:
        """Codes (unpacked) of ``y`` given in units of the scale (and above the zero point)."""
        raise ValueError(f"fmt: {self.name} has no codes to search")

    def levels_of(self, codes: torch.Tensor) -> torch.Tensor:
        """Unpacked codes ``[..., D]`` -> their values before scaling, fp32 ``[..., D]``."""
        return codes.float()

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """Stored codes ``[..., W]`` -> one code per element ``[..., D]``."""
        return unpack_codes(codes, self.bits) if self.packed else codes

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Stored codes ``[..., W]`` -> fp32 values before scaling ``[..., D]``."""
        return self.levels_of(self.unpack(codes))

    def check_bounded(self) -> None:
        """``ValueError`` where the format has no per-element error bound."""

    def element_bound(self, xf: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Bound on ``|dequantize(quantize(x)) - x|`` per element, for ``x`` (fp32) and its scale
        ``s`` broadcast per element (the fp32 slack of the round trip included)."""
        raise NotImplementedError
