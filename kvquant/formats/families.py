"""One small class per family of formats; each answers what the kind branches used to ask.

``PassThrough`` (``none``), ``SymmetricInt`` (``int8``), ``AsymmetricInt`` (``int4/3/2``), ``Fp8``
(``fp8_e4m3/e5m2``), ``Codebook`` (``nuq4/3/2``), ``Trellis`` (``tcq3/2``). A new format is a new
class here (or a new instance of one) plus one line in :mod:`kvquant.formats.registry`.
"""

from __future__ import annotations

import math

import torch

from kvquant.formats.rounding import div_rn, round_nearest_positive, round_to_dtype, sqrt_rn
from kvquant.formats.spec import Encoder, FormatSpec, TritonRead, check_finite
from kvquant.formats.trellis import (
    TRELLIS_STATE_BITS,
    check_channels,
    trellis_decode,
    trellis_encode,
    trellis_table,
)
from kvquant.formats.trellis_tables import TABLES

# codebook formats try these multiples of the group's RMS as its scale and keep the best one
CODEBOOK_SCALE_GRID = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2)
TRELLIS_QMAX = {bits: max(abs(v) for v in table) for bits, table in TABLES.items()}


def _slack(xf: torch.Tensor) -> torch.Tensor:
    """fp32 slack of a round trip: 1e-6 relative."""
    return 1e-6 * xf.abs() + 1e-30


class PassThrough(FormatSpec):
    """``none``: the tensor itself, in its own dtype, no scales."""

    kind = "passthrough"
    has_scale = False
    takes_static_scale = True  # (needs none: accepted and ignored)

    def triton_constants(self):
        return 0, 16, 0.0, 0, 0

    def triton_read(self):
        return TritonRead(16)

    def element_bound(self, xf, s):
        return torch.zeros_like(xf, dtype=torch.float32)


class _AbsMaxScaled(FormatSpec):
    """Symmetric formats: one scale per group, ``max|x| / qmax`` rounded up; codes ``x / scale``."""

    takes_static_scale = True

    def encode_groups(self, x, xg, red, scale_dtype, encoder):
        amax = xg.abs().amax(dim=red, keepdim=True)
        raw = div_rn(amax, self.qmax)
        scale = round_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), scale_dtype, +1)
        check_finite(x, scale, scale_dtype=scale_dtype)
        return self.encode_units(xg / scale.float()), scale, None


class SymmetricInt(_AbsMaxScaled):
    """``code = round(x / s)`` in ``[-qmax, qmax]``, stored as ``torch.int8``."""

    kind = "int_sym"
    integer = True
    signed = True

    def triton_constants(self):
        return 1, self.bits, float(self.qmax), 0, 0

    def triton_read(self):
        return TritonRead(self.bits)

    def encode_units(self, y):
        return torch.round(y.clamp(-self.qmax, self.qmax)).to(torch.int8)

    def element_bound(self, xf, s):
        return s * 0.5 * (1 + 1e-6) + _slack(xf)


class AsymmetricInt(FormatSpec):
    """``code = round((x - m) / s)`` in ``[0, qmax]``: zero point ``m`` (the group's min, rounded
    down) and scale (the range over ``qmax``, rounded up); codes packed."""

    kind = "int_asym"
    has_zero = True
    packed = True
    integer = True

    def triton_constants(self):
        return (2, self.bits, float(self.qmax), 0, 0) if self.planar else None

    def triton_read(self):
        return TritonRead(self.bits)  # 3 bits: two planes, each loaded row by row and unpacked

    def triton_write(self):
        return 2, self.bits, float(self.qmax), 0, 0

    def encode_groups(self, x, xg, red, scale_dtype, encoder):
        mn = xg.amin(dim=red, keepdim=True)
        mx = xg.amax(dim=red, keepdim=True)
        zero = round_to_dtype(mn, scale_dtype, -1)
        raw = div_rn(mx - zero.float(), self.qmax)
        scale = round_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), scale_dtype, +1)
        check_finite(x, scale, zero, scale_dtype=scale_dtype)
        return self.encode_units((xg - zero.float()) / scale.float()), scale, zero

    def encode_units(self, y):
        return torch.round(y).clamp_(0, self.qmax).to(torch.uint8)

    def element_bound(self, xf, s):
        return s * 0.5 * (1 + 1e-6) + _slack(xf)


class Fp8(_AbsMaxScaled):
    """``code = fp8(x / s)`` with ``s = max|x| / qmax`` (the dtype's largest finite value)."""

    kind = "float"

    @property
    def mantissa_bits(self) -> int:
        return round(-math.log2(torch.finfo(self.code_dtype).eps))

    @property
    def exponent_bias(self) -> int:
        return round(1 - math.log2(torch.finfo(self.code_dtype).tiny))

    def triton_constants(self):
        return 3, self.bits, float(self.qmax), self.mantissa_bits, self.exponent_bias

    def triton_read(self):
        return TritonRead(self.bits, fp8=1 if self.mantissa_bits == 3 else 2)

    def lut(self):
        return _lut(self)

    def encode_units(self, y):
        return y.clamp(-self.qmax, self.qmax).to(self.code_dtype)

    def element_bound(self, xf, s):
        """Half an ulp of the scaled value (relative ``2**-(mantissa+1)``, or half the smallest
        subnormal step near zero), times the scale."""
        fi = torch.finfo(self.code_dtype)
        min_sub = fi.tiny * fi.eps
        scaled = xf.abs() / s
        half_ulp = torch.maximum(
            scaled * 2.0 ** -(self.mantissa_bits + 1), torch.full_like(scaled, min_sub / 2)
        )
        return half_ulp * s * (1 + 1e-6) + _slack(xf)


class Codebook(FormatSpec):
    """The index of the nearest Lloyd-Max level of a standard normal, times one scale per group (no
    zero point); codes packed like the integers of the same width."""

    kind = "codebook"
    packed = True
    token_axis_only = True
    scale_search = CODEBOOK_SCALE_GRID

    def lut(self):
        return _lut(self)

    def triton_read(self):
        return TritonRead(self.bits, lut=1, exact_f16=False, table=_lut(self))

    def triton_write(self):
        return 4, self.bits, float(self.qmax), 0, 0

    def levels_of(self, codes):
        return self.levels.to(codes.device)[codes.long()]

    def encode_units(self, y):
        levels = self.levels.to(y.device)
        return torch.bucketize(y.float(), (levels[1:] + levels[:-1]) / 2).to(torch.uint8)

    def encode_groups(self, x, xg, red, scale_dtype, encoder):
        """Of the candidate scales ``RMS * CODEBOOK_SCALE_GRID`` and ``max|x| / top level`` (which
        makes a constant vector round trip) take the one with the smallest squared error, stretch it
        so the dequantized group has the norm of the input, and encode with that scale."""
        xg = xg.contiguous()
        levels = self.levels.to(xg.device)
        edges = (levels[1:] + levels[:-1]) / 2
        rms = sqrt_rn(xg.square().mean(dim=red, keepdim=True))
        rms = torch.where(rms == 0, torch.ones_like(rms), rms)
        amax = xg.abs().amax(dim=red, keepdim=True)
        fit_max = torch.where(
            amax == 0, torch.ones_like(amax), div_rn(amax, self.qmax)
        )  # largest |x| on the top level
        candidates = [rms * factor for factor in self.scale_search] + [fit_max]
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
        norm_x = sqrt_rn(xg.square().sum(dim=red, keepdim=True))
        norm_q = sqrt_rn((levels[best_q] * best_s.float()).square().sum(dim=red, keepdim=True))
        keep = norm_q > 0
        raw = torch.where(
            keep, best_s.float() * norm_x / torch.where(keep, norm_q, torch.ones_like(norm_q)), rms
        )
        best_s = round_to_dtype(raw, scale_dtype, +1)
        best_q = torch.bucketize(xg / best_s.float(), edges)
        # the levels hold no zero: an all-zero group stores scale 0 (dequantizes to exact zeros; the
        # stored scale is never a divisor, quantization divided by the nonzero candidates above)
        best_s = torch.where(amax == 0, torch.zeros_like(best_s), best_s)
        check_finite(x, best_s, scale_dtype=scale_dtype)
        return best_q.to(torch.uint8), best_s, None

    def element_bound(self, xf, s):
        """Half the widest gap between levels, or the distance beyond the outermost level, times the scale."""
        lv = self.levels.to(xf.device)
        half_gap = float((lv[1:] - lv[:-1]).max()) / 2
        over = (xf.abs() / s - float(lv[-1])).clamp_min(0)
        return torch.maximum(over, torch.full_like(over, half_gap)) * s * (1 + 1e-6) + _slack(xf)


class Trellis(FormatSpec):
    """Tail-biting trellis codes (:mod:`kvquant.formats.trellis`): a channel's level is read from a
    table at the state formed by its code and the codes before it; the codes of a head vector are
    searched together (Viterbi). One scale per group (no zero point); no per-element bound."""

    kind = "trellis"
    packed = True
    token_axis_only = True
    elementwise = False

    @property
    def state_bits(self) -> int:
        return TRELLIS_STATE_BITS[self.bits]

    def levels_of(self, codes):
        return trellis_decode(codes, self.bits)

    def triton_read(self):
        return TritonRead(
            self.bits, lut=2, state_codes=self.state_codes, exact_f16=False, table=self.state_table()
        )

    def state_table(self):
        return trellis_table(self.bits)

    def element_bound(self, xf, s):
        self.check_bounded()

    def encode_units(self, y):
        return trellis_encode(y, self.bits)

    def encode_groups(self, x, xg, red, scale_dtype, encoder: Encoder | None):
        """Codes ``[B, H, T, D]`` (uint8) and the stored scale ``[B, H, T, D/G, 1]`` of groups
        ``xg[B, H, T, D/G, G]``: the path is searched (``encoder``, default the torch search) for
        ``x / RMS`` (each group's RMS, rounded up), then each group's scale is stretched so that the
        dequantized group keeps the input's norm (to the nearest value of the scale dtype)."""
        rms = sqrt_rn(xg.square().mean(dim=-1, keepdim=True))
        amax = xg.abs().amax(dim=-1, keepdim=True)
        search = round_to_dtype(torch.where(rms == 0, torch.ones_like(rms), rms), scale_dtype, +1).float()
        check_finite(xg, search, scale_dtype=scale_dtype)
        d = xg.shape[-1] * xg.shape[-2]
        check_channels(d, self.bits)
        y = (xg / search).reshape(-1, d)  # [N, D]: whole head vectors, in units of each group's scale
        codes = (encoder or trellis_encode)(y, self.bits)  # [N, D]
        levels = trellis_decode(codes, self.bits).view(xg.shape)
        norm_x = sqrt_rn(xg.square().sum(dim=-1, keepdim=True))
        norm_l = sqrt_rn(levels.square().sum(dim=-1, keepdim=True))
        keep = norm_l > 0
        raw = torch.where(keep, norm_x / torch.where(keep, norm_l, torch.ones_like(norm_l)), search)
        # to the nearest value of the scale dtype (no bound to keep; rounding up would inflate norms by
        # up to a step: 12.5% with 8-bit scales), never down to 0, overflow still NaN / inf
        scale = round_nearest_positive(raw, scale_dtype)
        scale = torch.where(amax == 0, torch.zeros_like(scale), scale)  # an all-zero group: exact zeros
        check_finite(x, scale, scale_dtype=scale_dtype)
        return codes.view(xg.shape[:-2] + (d,)), scale, None

    def check_bounded(self):
        raise ValueError(
            f"fmt: {self.name} has no per-element error bound (the trellis trades errors between channels)"
        )


_LUTS: dict[str, torch.Tensor] = {}


def _lut(spec: FormatSpec) -> torch.Tensor:
    """fp32 code -> level table, built once: fp8 all 256 bytes, codebooks padded to 16 entries (a
    kernel loads one 16-lane vector)."""
    if spec.name not in _LUTS:
        if spec.code_dtype.is_floating_point:
            table = torch.arange(256, dtype=torch.uint8).view(spec.code_dtype).float()
        else:
            levels = spec.levels.float()
            table = torch.cat([levels, levels.new_zeros(16 - levels.numel())])
        _LUTS[spec.name] = table.contiguous()
    return _LUTS[spec.name]
