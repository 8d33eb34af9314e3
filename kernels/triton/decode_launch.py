"""How one segment of a decode call becomes a launch of the split kernel: each of K / V's scale mode
(see :mod:`kvquant.kernels.triton.decode_attention`), the tile size and pipeline stages, the
constexprs and the runtime arguments in the kernel's order.

:class:`Segment` is one segment of a call (buffers, formats, rows' ranges, an optional token mask);
``Segment.prepare(q, ...)`` checks it and returns its :class:`Launch`. :func:`split_launch` does the
same for one store without launching (offline builds: :mod:`kvquant.tools.kernel_resources`).

Example:
    >>> launch = split_launch(q, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), k_fmt="int4",
    ...     v_fmt="int4", k_group=128, v_group=128, k_axis="token", start=start, end=t)
    >>> launch.consts["BT"], launch.consts["K_MODE"]                        # q [B, Hq, 128]
    (64, 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kvquant.formats import format_spec, is_static_scale
from kvquant.kernels.reference import check_attention
from kvquant.kernels.triton._common import INTERPRET, as_bytes, is_pow2, level_table
from kvquant.kernels.triton.decode_kernels import decode_attention_split_kernel


def kernel_operand(codes, scale, zero, fmt, group, axis, d):
    """``(read, mode, scale, zero, has_scale, has_zero)`` of one of K / V for the kernel; ``read``: the
    format's :class:`~kvquant.formats.TritonRead`."""
    spec = format_spec(fmt)
    read = spec.triton_read()
    if read is None:
        raise ValueError(f"fmt: the Triton kernels do not read {fmt}")
    if not spec.has_scale:  # pass-through
        if codes.shape[-1] != d:
            raise ValueError(
                f"codes: format none needs raw [B, H, cap, {d}] tensors, got {tuple(codes.shape)}"
            )
        mode = 0 if codes.dtype == torch.float16 else 2  # fp16 is exact in the fp16 dot
        return read, mode, None, None, False, False
    if codes.shape[-1] != spec.code_width(d):
        raise ValueError(f"codes: last dim {codes.shape[-1]} != {spec.code_width(d)} for {fmt}, head_dim {d}")
    if scale is None:
        raise ValueError(f"scale: format {fmt} needs scales")
    if spec.has_zero and zero is None:
        raise ValueError(f"zero: format {fmt} needs zero points")
    b, h, cap, _ = codes.shape
    if axis == "token" and is_static_scale(scale, axis):  # [1, H, 1, 1] -> stride-0 view [B, H, cap, 1]
        if zero is not None:
            raise ValueError("zero: a static per-head scale takes no zero points")
        return read, 0 if read.exact_f16 or read.lut else 2, scale.expand(b, h, cap, 1), None, True, False
    cols = d if axis == "channel" else d // group
    rows = -(-cap // group) if axis == "channel" else cap
    for name, t in (("scale", scale), ("zero", zero if spec.has_zero else None)):
        if t is not None and (t.shape[:2] != (b, h) or t.shape[3] != cols or t.shape[2] < rows):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} does not fit codes {tuple(codes.shape)} ({axis} axis, G={group})"
            )
    if axis == "channel":
        mode = 1 if read.exact_f16 else 2
    elif not (read.exact_f16 or read.lut):
        mode = 2
    elif group == d:
        mode = 0  # table values: two fp16 halves
    else:  # one dot per channel group (tl.dot wants >= 16 along its inner dimension)
        mode = 3 if group >= 16 and d % group == 0 else 2
    return read, mode, scale, zero if spec.has_zero else None, True, spec.has_zero


def tile_tokens(
    d: int,
    k_mode: int,
    v_mode: int,
    k_axis: str,
    k_group: int,
    block_t: int | None = None,
    tables: bool = False,
) -> tuple[int, int]:
    """Tokens per tile (a power of two >= 16) and the key mode (channel fold needs BT | G).

    Sized so that sm_90 builds (8 warps) do not spill (``python -m kvquant.tools.kernel_resources``):
    64 tokens with folded scales up to head_dim 128, and up to 256 for codes read without a table
    (``tables``: codebooks, trellis codes); else 32 (also when a tile is dequantized to fp32: mode 2,
    tf32x3 dots). ``block_t`` overrides it.
    """
    wide = d <= 128 or (d <= 256 and not tables)
    bt = block_t or (64 if wide and 2 not in (k_mode, v_mode) else 32)
    if bt < 16 or not is_pow2(bt):
        raise ValueError(f"block_t: a power of two >= 16, got {bt}")
    if k_axis == "channel" and k_mode == 1:
        while bt > 16 and k_group % bt:
            bt //= 2
        if k_group % bt:
            k_mode = 2  # odd / small blocks: dequantize with per-element scale rows instead
    return bt, k_mode


def pipeline_stages(k_read, v_read) -> int | None:
    """Software-pipelining stages: 1 where K or V is read through a table (codebooks, trellis codes),
    else Triton's default (``None``). With Triton's default the table formats' kernels hold several
    pipelined fp32 tiles in shared memory (one program per SM) and ran slower on an H200; one 3-bit
    trellis build also gave wrong outputs there with the default and right ones with 1 stage. The
    measurements are in docs/measured.md ("First GPU runs")."""
    return 1 if k_read.lut or v_read.lut else None


def strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if t is None else tuple(t.stride())


@dataclass
class Segment:
    """One segment of a decode call: K / V buffers, what they hold, the rows' ranges ``[start[b], end)``
    and a token mask ``valid [B, end]`` (None: all)."""

    tensors: tuple
    k_fmt: str
    v_fmt: str
    k_group: int | None
    v_group: int | None
    k_axis: str
    start: torch.Tensor
    end: int
    valid: torch.Tensor | None = None
    dense: bool = False  # full-precision tokens (the torch fallback attends them densely)

    def prepare(self, q: torch.Tensor, *, block_t, num_warps, num_stages) -> Launch:
        """The kernel arguments of this segment (checked) as a :class:`Launch`."""
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = self.tensors
        check_attention(q, k_codes, v_codes, self.start, self.end, self.k_axis, self.k_group)
        d = q.shape[2]
        kg = d if self.k_group is None else (min(self.k_group, d) if self.k_axis == "token" else self.k_group)
        vg = d if self.v_group is None else min(self.v_group, d)
        if self.k_axis == "token" and d % kg or d % vg:
            raise ValueError(f"k_group / v_group: {kg}, {vg} must divide head_dim {d}")
        k_read, k_mode, k_scale, k_zero, k_has_s, k_has_z = kernel_operand(
            k_codes, k_scale, k_zero, self.k_fmt, kg, self.k_axis, d
        )
        v_read, v_mode, v_scale, v_zero, v_has_s, v_has_z = kernel_operand(
            v_codes, v_scale, v_zero, self.v_fmt, vg, "token", d
        )
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale), ("k_zero", k_zero), ("v_zero", v_zero)):
            if t is not None and t.dtype.itemsize == 1 and t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}: 8-bit scales are float8_e4m3fn, not {t.dtype}")
        tables = bool(k_read.lut or v_read.lut)
        bt, k_mode = tile_tokens(d, k_mode, v_mode, self.k_axis, kg, block_t, tables)
        stages = num_stages if num_stages is not None else pipeline_stages(k_read, v_read)
        valid = self.valid
        if valid is not None:
            if valid.shape != (q.shape[0], self.end) or valid.dtype != torch.bool:
                raise ValueError(
                    f"fp_valid: expected bool [{q.shape[0]}, {self.end}], got {valid.dtype} {tuple(valid.shape)}"
                )
            valid = valid.to(q.device).view(torch.uint8)
        dummy = k_codes  # any pointer for absent scale / zero buffers (never read)
        k_sfp8 = k_scale is not None and k_scale.dtype == torch.float8_e4m3fn
        v_sfp8 = v_scale is not None and v_scale.dtype == torch.float8_e4m3fn
        k_scale, k_zero, v_scale, v_zero = map(as_bytes, (k_scale, k_zero, v_scale, v_zero))
        k_codes, v_codes = as_bytes(k_codes), as_bytes(v_codes)  # fp8: decoded from its bytes
        args = (
            k_codes,
            k_scale if k_scale is not None else dummy,
            k_zero if k_zero is not None else dummy,
            v_codes,
            v_scale if v_scale is not None else dummy,
            v_zero if v_zero is not None else dummy,
            level_table(k_read, dummy),
            level_table(v_read, dummy),
            self.start,
            valid if valid is not None else self.start,
        )
        strides = (
            *k_codes.stride(),
            *strides4(k_scale),
            *strides4(k_zero),
            *v_codes.stride(),
            *strides4(v_scale),
            *strides4(v_zero),
        )
        hq, hkv = q.shape[1], k_codes.shape[1]
        consts = dict(
            GQ=hq // hkv,
            GQP=max(16, triton.next_power_of_2(hq // hkv)),
            D=d,
            BT=bt,
            K_BITS=k_read.bits,
            V_BITS=v_read.bits,
            K_FP8=k_read.fp8,
            V_FP8=v_read.fp8,
            K_LUT=k_read.lut,
            V_LUT=v_read.lut,
            K_M=k_read.state_codes,
            V_M=v_read.state_codes,
            K_SFP8=k_sfp8,
            V_SFP8=v_sfp8,
            K_MODE=k_mode,
            V_MODE=v_mode,
            K_CHANNEL=self.k_axis == "channel",
            K_G=kg,
            V_G=vg,
            K_SCALE=k_has_s,
            K_ZERO=k_has_z,
            V_SCALE=v_has_s,
            V_ZERO=v_has_z,
            Q_SPLIT=q.dtype != torch.float16,
            F32_DOT="ieee" if INTERPRET else "tf32x3",
            VALID=valid is not None,
            num_warps=num_warps,
            **({} if stages is None else {"num_stages": stages}),
        )
        val_strides = (0, 0) if valid is None else tuple(valid.stride())
        return Launch(
            args, strides, val_strides, consts, int(self.end), hkv, triton.cdiv(max(self.end, 0), bt)
        )


@dataclass
class Launch:
    """The split-kernel launch of one segment; ``splits`` (its share of the partials) is set by the caller."""

    args: tuple
    strides: tuple
    val_strides: tuple
    consts: dict
    end: int
    hkv: int
    n_tiles: int
    splits: int = 1

    def runtime_args(self, q, o_part, l_part, scaling, softcap) -> list:
        """The split kernel's non-constexpr arguments, in its order (:meth:`launch`; offline builds)."""
        return [q, *self.args, o_part, l_part, self.end, self.splits, self.hkv, float(scaling),
                float(softcap) if softcap else 1.0, *self.val_strides, *q.stride(), *self.strides,
                *o_part.stride(), *l_part.stride()]  # fmt: skip

    def launch(self, q, o_part, l_part, scaling, softcap) -> None:
        """Write this segment's partials into ``o_part [B, Hq, splits, D]`` / ``l_part [B, Hq, splits]``."""
        decode_attention_split_kernel[(q.shape[0] * self.hkv, self.splits)](
            *self.runtime_args(q, o_part, l_part, scaling, softcap), SOFTCAP=bool(softcap), **self.consts
        )


def split_launch(q, tensors, *, k_fmt, v_fmt, k_group, v_group, k_axis, start, end, block_t=None, num_warps=8,
                 num_stages=None) -> Launch:  # fmt: skip
    """The split kernel's launch for one store segment (constexprs in ``.consts``, arguments from
    ``.runtime_args``), exactly as :func:`quantized_decode_attention` prepares it, without
    launching: for offline builds (:mod:`kvquant.tools.kernel_resources`). ``tensors``: the six store
    buffers ``(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)``."""
    seg = Segment(tuple(tensors), k_fmt, v_fmt, k_group, v_group, k_axis, start, end)
    return seg.prepare(q, block_t=block_t, num_warps=num_warps, num_stages=num_stages)
