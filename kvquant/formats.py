"""The numeric spec of kvquant's KV formats, in plain torch.

This module knows nothing about transformers or Triton: it turns a block of head vectors
``x[B, H, T, D]`` into codes + scales (+ zero points) and back. The Triton kernels in
``kvquant.kernels`` follow exactly this spec and are tested against it.

Formats
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
``tcq3`` / ``tcq2``  trellis codes (:mod:`kvquant.trellis`): 3 / 2 bits per channel like ``nuq3`` /
              ``nuq2``, but a channel's level is read from a table at the state formed by its code
              and the codes of the channels before it (circularly); the codes of a head vector
              are picked together by the Viterbi algorithm, for the least squared error. One
              scale per group: the group's RMS for the search, then stretched so the group keeps
              its norm (rounded to nearest). About 33% / 42% less squared error (2 / 3 bits) than
              the Lloyd-Max levels on Gaussian-like rotated heads; no per-element bound (errors
              are traded between channels).
``fp8_e4m3``  scaled, ``code = fp8(x / s)`` with ``s = amax / 448``
``fp8_e5m2``  scaled, ``code = fp8(x / s)`` with ``s = amax / 57344``

Scale granularity (``axis``)
---------------------------
``token``    one scale per (token, head, group of ``G`` channels): scales ``[B, H, T, D // G]``.
             ``G == D`` is the default "per-head" scale.
``channel``  keys only (KIVI): one scale per (channel, block of ``G`` tokens): scales
             ``[B, H, T // G, D]``; ``T`` must be a multiple of ``G``.

Packing (planar, kernel friendly): for int4 byte ``j`` of a head vector holds channel ``j`` in
its low nibble and channel ``j + D/2`` in its high nibble; for int2 byte ``j`` holds channels
``j, j + D/4, j + D/2, j + 3D/4`` from the low to the high bit pair. A kernel unpacks a byte row
into contiguous channel slices with one shift and mask each. 3-bit codes are two planes: the low
two bits packed like int2 (``D/4`` bytes), then the high bit packed eight per byte (``D/8`` bytes).

Scales and zero points are stored in ``scale_dtype`` (fp16 by default; ``float8_e4m3`` halves
their cost, 8 bits per group, at a step of up to 12.5%: meant for codebook scales, which the
codes are re-picked for, not for integer zero points). They are rounded
*outward* when stored (scale up, zero point ``m`` down) and the codes are computed from the stored
values, so every element stays within half a quantization step of its input: no clipping. A zero
range gets scale 1 (an all-zero vector round-trips exactly; codebooks, whose levels hold no zero,
store scale 0 for an all-zero group); a scale the dtype cannot hold, or a NaN/Inf input, raises
``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvquant.trellis import trellis_decode, trellis_encode
from kvquant.trellis_tables import TABLES

FORMAT_NAMES = (
    "none",
    "int8",
    "int4",
    "int3",
    "int2",
    "fp8_e4m3",
    "fp8_e5m2",
    "nuq4",
    "nuq3",
    "nuq2",
    "tcq3",
    "tcq2",
)
AXES = ("token", "channel")
# codebook formats try these multiples of the group's RMS as its scale and keep the best one
CODEBOOK_SCALE_GRID = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2)
TRELLIS_QMAX = {bits: max(abs(v) for v in table) for bits, table in TABLES.items()}
SCALE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class FormatSpec:
    """What one format is made of.

    ``kind`` is one of ``passthrough``, ``int_sym``, ``int_asym``, ``float``, ``codebook``, ``trellis``;
    ``qmax`` is the largest code magnitude (integers), the largest finite value (fp8) or the
    largest level (codebooks and trellis tables, in units of the scale).
    """

    name: str
    bits: int
    kind: str
    qmax: float
    code_dtype: torch.dtype | None  # None: the input's own dtype (pass-through)

    @property
    def has_scale(self) -> bool:  # TEMPORARY (lead's branch)
        return self.kind != "passthrough"

    def bytes_per_token(
        self, head_dim, group_size, axis, scale_itemsize, static=False, fp_itemsize=2
    ):  # TEMP
        if self.kind == "passthrough":
            return float(head_dim * fp_itemsize)
        codes = self.code_width(head_dim)
        if static:
            return float(codes)
        per_scale = scale_itemsize * (2 if self.has_zero else 1)
        if axis == "channel":
            return codes + head_dim * per_scale / group_size
        return codes + (head_dim // group_size) * per_scale

    @property
    def has_zero(self) -> bool:
        return self.kind == "int_asym"

    @property
    def per_byte(self) -> int:
        """Codes per stored byte (1 for 8-bit formats; 3-bit codes do not fill whole bytes)."""
        return 8 // self.bits if self.bits < 8 else 1

    @property
    def packed(self) -> bool:
        """Whether codes are bit-packed integers (``unpack_codes`` reads them)."""
        return self.kind in ("int_asym", "codebook", "trellis")

    @property
    def token_axis_only(self) -> bool:
        """Whether scales can only run along the token axis (codebooks and trellis codes)."""
        return self.kind in ("codebook", "trellis")

    @property
    def takes_static_scale(self) -> bool:
        """Whether codes can share one calibrated scale per head (int8, fp8; ``none`` needs none)."""
        return self.kind in ("passthrough", "int_sym", "float")

    @property
    def levels(self) -> torch.Tensor:
        """Codebook levels ``[2**bits]`` (ascending, fp32) of a ``codebook`` format."""
        return lloyd_max_levels(self.bits)

    def code_width(self, head_dim: int) -> int:
        """Stored elements per head vector along the last dim of ``codes``."""
        if self.bits >= 8:
            return head_dim
        return head_dim * self.bits // 8


_SPECS = {
    "none": FormatSpec("none", 16, "passthrough", float("inf"), None),
    "int8": FormatSpec("int8", 8, "int_sym", 127.0, torch.int8),
    "int4": FormatSpec("int4", 4, "int_asym", 15.0, torch.uint8),
    "int3": FormatSpec("int3", 3, "int_asym", 7.0, torch.uint8),
    "int2": FormatSpec("int2", 2, "int_asym", 3.0, torch.uint8),
    "fp8_e4m3": FormatSpec("fp8_e4m3", 8, "float", 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": FormatSpec("fp8_e5m2", 8, "float", 57344.0, torch.float8_e5m2),
    # qmax: the top Lloyd-Max level (a test checks it against lloyd_max_levels)
    "nuq4": FormatSpec("nuq4", 4, "codebook", 2.732590, torch.uint8),
    "nuq3": FormatSpec("nuq3", 3, "codebook", 2.151946, torch.uint8),
    "nuq2": FormatSpec("nuq2", 2, "codebook", 1.510418, torch.uint8),
    # qmax: the largest |table entry| (a test checks it against the tables)
    "tcq3": FormatSpec("tcq3", 3, "trellis", TRELLIS_QMAX[3], torch.uint8),
    "tcq2": FormatSpec("tcq2", 2, "trellis", TRELLIS_QMAX[2], torch.uint8),
}
_LEVELS: dict[int, torch.Tensor] = {}


def lloyd_max_levels(bits: int) -> torch.Tensor:
    """The ``2**bits`` Lloyd-Max levels of a standard normal (MSE-optimal scalar quantizer), fp32.

    Computed by Lloyd's iteration on the exact normal density (thresholds at midpoints, levels at
    the conditional means), to convergence in float64. 2 bits: ``±0.4528, ±1.5104``.
    """
    if bits not in _LEVELS:
        n = 2**bits
        phi = lambda t: math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
        cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
        levels = [-3 + 6 * (i + 0.5) / n for i in range(n)]
        for _ in range(2000):
            edges = (
                [-math.inf] + [(a + b) / 2 for a, b in zip(levels[:-1], levels[1:], strict=True)] + [math.inf]
            )
            new = []
            for a, b in zip(edges[:-1], edges[1:], strict=True):
                pa = 0.0 if a == -math.inf else phi(a)
                pb = 0.0 if b == math.inf else phi(b)
                new.append((pa - pb) / (cdf(b) - cdf(a)))
            done = max(abs(x - y) for x, y in zip(new, levels, strict=True)) < 1e-12
            levels = new
            if done:
                break
        _LEVELS[bits] = torch.tensor(levels, dtype=torch.float32)
    return _LEVELS[bits]


def format_spec(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of ``name``; ``ValueError`` naming the allowed names otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"format: unknown format {name!r}; allowed: {', '.join(FORMAT_NAMES)}") from None


@dataclass
class QuantizedBlock:
    """Codes and scales of a block of head vectors, as :func:`quantize` returns them.

    codes: ``[B, H, T, code_width]``; scale / zero: ``[B, H, T, D // G]`` (token axis) or
    ``[B, H, T // G, D]`` (channel axis); ``zero`` is None for symmetric / float formats, both are
    None for ``none``.
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None


# --------------------------------------------------------------------------------------------- rounding


_FP8_GRIDS: dict[torch.dtype, torch.Tensor] = {}


def _fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8-bit float dtype, ascending, as fp32 ``[n]``."""
    if dtype not in _FP8_GRIDS:
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        grid = torch.unique(v[torch.isfinite(v)])  # sorted; -0 and +0 merge
        _FP8_GRIDS[dtype] = torch.where(grid == 0, torch.zeros_like(grid), grid)  # as +0
    return _FP8_GRIDS[dtype]


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype, direction: int) -> torch.Tensor:
    """Cast fp32 ``x`` to ``dtype`` rounding up (``direction=+1``) or down (``-1``), not to nearest.

    Underflow rounds up to the smallest subnormal instead of 0; overflow gives ``inf`` (NaN for
    ``float8_e4m3fn``, which holds no infinity, where a plain cast would saturate silently).
    """
    if dtype.itemsize == 1:  # 8-bit floats: the nearest grid value on the asked side
        grid = _fp8_grid(dtype).to(x.device)
        xf = x.float().contiguous()
        if direction > 0:
            i = torch.searchsorted(grid, xf)
            out = i >= grid.numel()
        else:
            i = torch.searchsorted(grid, xf, right=True) - 1
            out = i < 0
        y = grid[i.clamp(0, grid.numel() - 1)]
        return torch.where(out | torch.isnan(xf), torch.full_like(y, float("nan")), y).to(dtype)
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    yf = y.float()
    wrong = yf < x if direction > 0 else yf > x
    toward = torch.full_like(y, float("inf") if direction > 0 else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, toward), y)


# --------------------------------------------------------------------------------------------- packing


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., D]`` (uint8, values < 2**bits) into ``[..., D * bits // 8]`` bytes.

    Planar layout: the ``k``-th bit field of byte ``j`` holds channel ``j + k * D * bits // 8``.
    """
    if bits == 8:
        return codes
    if bits == 3:  # two planes: low bit pairs like int2, then the high bits eight per byte
        return torch.cat([pack_codes(codes & 3, 2), pack_codes(codes >> 2, 1)], dim=-1)
    per_byte = 8 // bits
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"head_dim: {d} is not a multiple of {per_byte} (needed to pack {bits}-bit codes)")
    parts = codes.view(*codes.shape[:-1], per_byte, d // per_byte)  # [..., per_byte, D/per_byte]
    packed = torch.zeros_like(parts[..., 0, :])
    for k in range(per_byte):
        packed |= parts[..., k, :] << (k * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes ``[..., W]`` -> uint8 codes ``[..., W * 8 // bits]``.

    Works on 32-bit words where the layout allows (one shift and mask unpacks four bytes at once:
    torch's uint8 shifts are not vectorized on CPU), else byte by byte.
    """
    if bits == 8:
        return packed
    if bits == 3:
        w = packed.shape[-1] // 3  # D / 8
        return unpack_codes(packed[..., : 2 * w], 2) | (unpack_codes(packed[..., 2 * w :], 1) << 2)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    if packed.shape[-1] % 4 == 0 and packed.stride(-1) == 1 and packed.storage_offset() % 4 == 0:
        try:
            words = packed.view(torch.int32)  # [..., W / 4]
        except RuntimeError:
            words = None
        if words is not None:
            word_mask = int.from_bytes(bytes([mask]) * 4, "little")
            parts = [((words >> (k * bits)) & word_mask).view(torch.uint8) for k in range(per_byte)]
            return torch.cat(parts, dim=-1)
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------------------- grouping


def _group_view(x: torch.Tensor, group_size: int, axis: str) -> tuple[torch.Tensor, int]:
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


def is_static_scale(scale: torch.Tensor, axis: str) -> bool:
    """Whether ``scale`` is a static per-head scale ``[1, H, 1, 1]`` rather than a per-token one."""
    return axis == "token" and scale.shape[0] == 1 and scale.shape[2] == 1 and scale.shape[3] == 1


def _ungroup(xg: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return xg.reshape(shape)


def _check_finite(x: torch.Tensor, *stats: torch.Tensor, scale_dtype: torch.dtype) -> None:
    ok = torch.stack([torch.isfinite(s.float()).all() for s in stats]).all()
    if bool(ok):
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError("input: key/value states contain NaN or Inf; refusing to quantize them")
    raise ValueError(
        f"scale_dtype: {scale_dtype} cannot hold the scale/zero point of these values "
        f"(|x| up to {x.abs().max().item():.3g}); use scale_dtype 'float32' or 'bfloat16'"
    )


# --------------------------------------------------------------------------------------------- quantize


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    group_size: int | None = None,
    axis: str = "token",
    scale_dtype: torch.dtype = torch.float16,
    static_scale: torch.Tensor | None = None,
) -> QuantizedBlock:
    """Quantize head vectors ``x[B, H, T, D]`` into ``fmt``.

    Args:
        group_size: channels per scale (token axis) or tokens per block (channel axis); ``None``
            means the whole head (token axis only).
        static_scale: ``[H]`` per-head scales (int8 / fp8 only) used instead of computing them;
            values beyond the representable range are clipped. The returned ``scale`` is then
            ``static_scale`` viewed as ``[1, H, 1, 1]``.

    Example:
        >>> x = torch.randn(1, 2, 5, 64)
        >>> q = quantize(x, "int4")
        >>> q.codes.shape, q.scale.shape
        (torch.Size([1, 2, 5, 32]), torch.Size([1, 2, 5, 1]))
        >>> (dequantize(q, "int4", head_dim=64) - x).abs().max() <= q.scale.float().max() / 2 + 1e-6
        tensor(True)
    """
    spec = format_spec(fmt)
    if x.dim() != 4:
        raise ValueError(f"x: expected [B, H, T, D], got shape {tuple(x.shape)}")
    if spec.kind == "passthrough":
        return QuantizedBlock(x, None, None)
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if axis == "channel" and group_size is None:
        raise ValueError("group_size: channel-axis quantization needs a group_size (tokens per block)")
    xf = x.float()

    if static_scale is not None:
        if not spec.takes_static_scale:
            raise ValueError(f"static_scale: only int8 and fp8 formats take static scales, not {fmt}")
        scale = static_scale.to(scale_dtype).view(1, -1, 1, 1)
        _check_finite(x, xf.abs().amax(), scale_dtype=scale_dtype)
        codes = _encode_symmetric(xf, scale.float(), spec)
        return QuantizedBlock(codes, scale, None)

    if spec.token_axis_only and axis != "token":
        raise ValueError(f"axis: {spec.kind} format {fmt} takes scales along the token axis only")
    xg, red = _group_view(xf, g, axis)
    if spec.kind == "trellis":
        q, scale = _encode_trellis(xg, spec, scale_dtype)
        _check_finite(x, scale, scale_dtype=scale_dtype)
        return QuantizedBlock(pack_codes(q.view(x.shape), spec.bits), scale.squeeze(red), None)
    if spec.kind == "codebook":
        q, scale = _encode_codebook(xg, red, spec, scale_dtype)
        _check_finite(x, scale, scale_dtype=scale_dtype)
        codes = pack_codes(_ungroup(q, x.shape), spec.bits)
        return QuantizedBlock(codes, scale.squeeze(red), None)
    if spec.kind == "int_asym":
        mn = xg.amin(dim=red, keepdim=True)
        mx = xg.amax(dim=red, keepdim=True)
        zero = round_to_dtype(mn, scale_dtype, -1)
        raw = (mx - zero.float()) / spec.qmax
        scale = round_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), scale_dtype, +1)
        _check_finite(x, scale, zero, scale_dtype=scale_dtype)
        q = torch.round((xg - zero.float()) / scale.float()).clamp_(0, spec.qmax).to(torch.uint8)
        codes = pack_codes(_ungroup(q, x.shape), spec.bits)
        return QuantizedBlock(codes, scale.squeeze(red), zero.squeeze(red))

    amax = xg.abs().amax(dim=red, keepdim=True)
    raw = amax / spec.qmax
    scale = round_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), scale_dtype, +1)
    _check_finite(x, scale, scale_dtype=scale_dtype)
    codes = _encode_symmetric(xg, scale.float(), spec)
    return QuantizedBlock(_ungroup(codes, x.shape), scale.squeeze(red), None)


def _encode_codebook(
    xg: torch.Tensor, red: int, spec: FormatSpec, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-level codes and the stored scale of each group.

    Of the candidate scales ``RMS * CODEBOOK_SCALE_GRID`` and ``max|x| / top level`` (which makes a
    constant vector round trip) take the one with the smallest squared error, stretch it so the
    dequantized group has the norm of the input, and encode with that scale.
    """
    xg = xg.contiguous()
    levels = spec.levels.to(xg.device)
    edges = (levels[1:] + levels[:-1]) / 2
    rms = xg.square().mean(dim=red, keepdim=True).sqrt()
    rms = torch.where(rms == 0, torch.ones_like(rms), rms)
    amax = xg.abs().amax(dim=red, keepdim=True)
    fit_max = torch.where(amax == 0, torch.ones_like(amax), amax / spec.qmax)  # largest |x| on the top level
    candidates = [rms * factor for factor in CODEBOOK_SCALE_GRID] + [fit_max]
    best_q = best_s = best_err = None
    for raw in candidates:
        s = round_to_dtype(raw, scale_dtype, +1)
        q = torch.bucketize(xg / s.float(), edges)
        err = (levels[q] * s.float() - xg).square().sum(dim=red, keepdim=True)
        if best_q is None:
            best_q, best_s, best_err = q, s, err
            continue
        better = err < best_err
        best_q = torch.where(better, q, best_q)
        best_s = torch.where(better, s, best_s)
        best_err = torch.minimum(err, best_err)
    # Nearest levels shrink a vector (each level is the mean of its cell), which would shrink every
    # attention score; rescale so that the group keeps its norm, then re-pick the nearest levels
    # for the scale actually stored (the error bound is about that scale).
    norm_x = xg.square().sum(dim=red, keepdim=True).sqrt()
    norm_q = (levels[best_q] * best_s.float()).square().sum(dim=red, keepdim=True).sqrt()
    keep = norm_q > 0
    raw = torch.where(keep, best_s.float() * norm_x / torch.where(keep, norm_q, torch.ones_like(norm_q)), rms)
    best_s = round_to_dtype(raw, scale_dtype, +1)
    best_q = torch.bucketize(xg / best_s.float(), edges)
    # the levels hold no zero: an all-zero group stores scale 0 (dequantizes to exact zeros; the
    # stored scale is never a divisor, quantization divided by the nonzero candidates above)
    best_s = torch.where(amax == 0, torch.zeros_like(best_s), best_s)
    return best_q.to(torch.uint8), best_s


def _encode_trellis(
    xg: torch.Tensor, spec: FormatSpec, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trellis codes ``[B, H, T, D]`` (uint8) and the stored scale ``[B, H, T, D/G, 1]`` of groups
    ``xg[B, H, T, D/G, G]``: the path is searched for ``x / RMS`` (each group's RMS, rounded up),
    then each group's scale is stretched so that the dequantized group keeps the input's norm (to the
    nearest value of the scale dtype)."""
    rms = xg.square().mean(dim=-1, keepdim=True).sqrt()
    amax = xg.abs().amax(dim=-1, keepdim=True)
    search = round_to_dtype(torch.where(rms == 0, torch.ones_like(rms), rms), scale_dtype, +1).float()
    _check_finite(xg, search, scale_dtype=scale_dtype)
    d = xg.shape[-1] * xg.shape[-2]
    y = (xg / search).reshape(-1, d)  # [N, D]: whole head vectors, in units of each group's scale
    codes = trellis_encode(y, spec.bits)  # [N, D]
    levels = trellis_decode(codes, spec.bits).view(xg.shape)
    norm_x = xg.square().sum(dim=-1, keepdim=True).sqrt()
    norm_l = levels.square().sum(dim=-1, keepdim=True).sqrt()
    keep = norm_l > 0
    raw = torch.where(keep, norm_x / torch.where(keep, norm_l, torch.ones_like(norm_l)), search)
    # to the nearest value of the scale dtype (no bound to keep; rounding up would inflate norms by
    # up to a step: 12.5% with 8-bit scales), never down to 0, overflow still NaN / inf
    up, down = round_to_dtype(raw, scale_dtype, +1), round_to_dtype(raw, scale_dtype, -1)
    use_down = (down.float() > 0) & (raw - down.float() < up.float() - raw)
    scale = torch.where(use_down, down, up)
    scale = torch.where(amax == 0, torch.zeros_like(scale), scale)  # an all-zero group: exact zeros
    return codes.view(xg.shape[:-2] + (d,)), scale


def _encode_symmetric(x: torch.Tensor, scale: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    y = (x / scale).clamp_(-spec.qmax, spec.qmax)
    if spec.kind == "int_sym":
        return torch.round(y).to(torch.int8)
    return y.to(spec.code_dtype)


# --------------------------------------------------------------------------------------------- dequantize


def dequantize(
    block: QuantizedBlock,
    fmt: str,
    *,
    head_dim: int,
    group_size: int | None = None,
    axis: str = "token",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild ``[B, H, T, D]`` from a :class:`QuantizedBlock` (the inverse of :func:`quantize`)."""
    spec = format_spec(fmt)
    if spec.kind == "passthrough":
        return block.codes.to(out_dtype)
    if spec.kind == "codebook":
        q = spec.levels.to(block.codes.device)[unpack_codes(block.codes, spec.bits).long()]
    elif spec.kind == "trellis":
        q = trellis_decode(unpack_codes(block.codes, spec.bits), spec.bits)
    elif spec.kind == "int_asym":
        q = unpack_codes(block.codes, spec.bits).float()
    else:
        q = block.codes.float()
    b, h, t, _ = q.shape
    g = head_dim if group_size is None else group_size
    scale = block.scale.float()
    if is_static_scale(scale, axis):  # [1, H, 1, 1]: one scale per head for every token
        scale, g = scale.expand(b, h, t, 1), head_dim
    qg, red = _group_view(q, g, axis)
    x = qg * scale.unsqueeze(red)
    if block.zero is not None:
        x = x + block.zero.float().unsqueeze(red)
    return _ungroup(x, q.shape).to(out_dtype)


def error_bound(
    block: QuantizedBlock, fmt: str, x: torch.Tensor, *, group_size=None, axis="token"
) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` implied by the format, ``[B, H, T, D]``.

    Integers: half a step (``scale / 2``). Codebooks: half the widest gap between levels, or the
    distance beyond the outermost level, times the scale. fp8: half an ulp of the scaled value (relative
    ``2**-(mantissa+1)``, or half the smallest subnormal step near zero), times the scale.
    A small fp32 slack (1e-6 relative) covers the arithmetic of the round trip itself. Trellis codes
    have none (``ValueError``): they trade errors between channels for the least total error.
    """
    spec = format_spec(fmt)
    if spec.kind == "passthrough":
        return torch.zeros_like(x, dtype=torch.float32)
    if spec.kind == "trellis":
        raise ValueError(
            f"fmt: {fmt} has no per-element error bound (the trellis trades errors between channels)"
        )
    d = x.shape[-1]
    g = d if group_size is None else group_size
    scale = block.scale.float()
    if is_static_scale(scale, axis):
        scale, g = scale.expand(x.shape[0], -1, x.shape[2], 1), d
    ones = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    sg, red = _group_view(ones, g, axis)
    s = _ungroup(sg * scale.unsqueeze(red), x.shape)
    xf = x.float()
    slack = 1e-6 * xf.abs() + 1e-30
    if spec.kind in ("int_sym", "int_asym"):
        return s * 0.5 * (1 + 1e-6) + slack
    if spec.kind == "codebook":  # half the widest gap inside the levels; beyond them, the overshoot
        lv = spec.levels.to(x.device)
        half_gap = float((lv[1:] - lv[:-1]).max()) / 2
        over = (xf.abs() / s - float(lv[-1])).clamp_min(0)
        return torch.maximum(over, torch.full_like(over, half_gap)) * s * (1 + 1e-6) + slack
    mant, min_sub = (3, 2.0**-9) if fmt == "fp8_e4m3" else (2, 2.0**-16)
    scaled = xf.abs() / s
    half_ulp = torch.maximum(scaled * 2.0 ** -(mant + 1), torch.full_like(scaled, min_sub / 2))
    return half_ulp * s * (1 + 1e-6) + slack
