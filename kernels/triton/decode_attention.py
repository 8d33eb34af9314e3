"""Flash-decoding over a quantized KV store: one query token per row, codes dequantized in the loop.

``quantized_decode_attention`` launches two kernels:

1. ``decode_attention_split_kernel``, grid ``(B * Hkv, S)``, once per segment of the call (the
   store, each extra quantized segment such as the recent window, the full-precision tokens under
   an optional token mask), each into its own share of one buffer of partials: program ``(b, h, s)`` serves all ``G_q``
   query heads of KV head ``h`` (each K/V tile is loaded once for the whole GQA group) over the
   ``s``-th share of the row's tiles ``[start[b], end)``. Per tile of ``BT`` tokens it unpacks codes
   (each row's bytes loaded contiguously, the planes split with one shift + mask each and joined
   back into channel order; int3's two planes alike; a trellis state's neighbour codes from the
   same row loaded shifted by a byte; codebook and trellis values then looked up in the format's
   fp32 table, see ``load_levels``), computes the
   scores, runs an online softmax (base 2) and accumulates ``P @ V``; it writes the normalized
   partial output and its log-sum-exp.
2. ``merge_splits_kernel``, grid ``(B * Hq,)``: merges all segments' partials by log-sum-exp (skipped
   when there is one: the split kernel then writes the final output itself).

How scales enter (``K_MODE`` / ``V_MODE``):

- ``0`` per-token scale (one group per head, or a static per-head scale): folded out of the dot
  products. Keys: ``scores = s_t * (q . c_t) + z_t * sum(q)``; values: ``out = (p * s) @ C + p @ z``.
- ``1`` channel-axis keys (KIVI): the per-channel scales of the tile's token block are folded into
  ``q``: ``scores = (q * s) . c_t + q . z``. Tiles never straddle a block (``BT`` divides ``G``).
- ``3`` per-token scales per channel group of ``G >= 16`` channels: one batched dot per group,
  each group's scale folded out as in mode 0: ``scores = sum_g s_tg * (q_g . c_tg) + z_tg * sum(q_g)``;
  ``out_g = (p * s_g) @ C_g + p @ z_g``.
- ``2`` anything else (channel groups below 16 channels, odd channel-axis blocks, the ``none``
  format in bf16 / fp32): the tile is dequantized in registers (``c * s + z``) before the dot.

Scales and zero points in fp32 / fp16 / bf16 are loaded as they are, float8_e4m3fn ones as bytes
decoded in the kernel (``load_scale``).

Precision: every code value (int8, int4, int3, int2, fp8) is exact in fp16, so the folded dots multiply
exact fp16 codes by an fp32 operand carried as two fp16 halves (``hi + lo``, 22 significant bits,
row-scaled by a power of two so nothing overflows); fp16 queries are used as they are. Codebook and
trellis values (fp32 table entries, ``TritonRead.exact_f16`` False) are split into two fp16 halves
as well, and the dots take the three products above 2**-22 (``hi hi``, ``lo hi``, ``hi lo``; fp16
queries: two), so a per-token scale folds out for them too. Dequantized tiles (mode 2) use fp32 dots
(``tf32x3`` on GPU). The result matches the fp32 reference
(:func:`kvquant.kernels.reference.quantized_decode_attention_ref`) to fp32 rounding.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import triton

from kvquant.formats import format_spec, is_static_scale
from kvquant.kernels.backend import SegmentRead
from kvquant.kernels.reference import (
    check_attention,
    dense_decode_attention_ref,
    merge_attention,
    quantized_decode_attention_ref,
)
from kvquant.kernels.triton._common import INTERPRET, as_bytes, is_pow2, level_table
from kvquant.kernels.triton.decode_kernels import (  # noqa: F401  (load_codes: re-exported for tests)
    decode_attention_split_kernel,
    load_codes,
    merge_splits_kernel,
)

# --------------------------------------------------------------------------------------------- launcher


def _operand(codes, scale, zero, fmt, group, axis, d):
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


def _block_t(
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


def _num_stages(k_read, v_read) -> int | None:
    """Software-pipelining stages: 1 where K or V is read through a table (codebooks, trellis codes),
    else Triton's default (``None``). With Triton's default the table formats' kernels hold several
    pipelined fp32 tiles in shared memory (one program per SM) and ran slower on an H200; one 3-bit
    trellis build also gave wrong outputs there with the default and right ones with 1 stage. The
    measurements are in docs/measured.md ("First GPU runs")."""
    return 1 if k_read.lut or v_read.lut else None


def default_num_splits(batch_heads: int, n_tiles: int, device: torch.device) -> int:
    """Splits per (batch, KV head): enough programs to fill the device, at least 4 tiles per split."""
    if n_tiles <= 1:
        return 1
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # interpreter: few programs (each one is slow), but still exercise the merge
        target = 2 * batch_heads
    return max(1, min(triton.cdiv(target, batch_heads), triton.cdiv(n_tiles, 4), 128))


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if t is None else tuple(t.stride())


def quantized_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    *,
    k_fmt: str,
    v_fmt: str,
    k_group: int | None,
    v_group: int | None,
    k_axis: str,
    start: torch.Tensor,
    end: int,
    scaling: float,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int = 8,
    num_stages: int | None = None,
    fp_k: torch.Tensor | None = None,
    fp_v: torch.Tensor | None = None,
    fp_valid: torch.Tensor | None = None,
    extra: tuple[SegmentRead, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding over a quantized store (Triton); the contract of
    :func:`kvquant.kernels.reference.quantized_decode_attention_ref`, plus the segments
    :func:`kvquant.kernels.ops.decode_attention` passes: ``fp_k`` / ``fp_v [B, Hkv, n, D]``
    full-precision tokens with ``fp_valid [B, n]`` (bool, None: all attend; a mask with holes is
    honoured) and ``extra`` quantized segments (:class:`~kvquant.kernels.backend.SegmentRead`).

    Every segment is one launch of the split kernel into its own share of one buffer of partials,
    merged by one ``merge_splits_kernel``: a decode step with a recent window and full-precision
    tokens costs 3 + 1 launches and no torch ops. ``num_splits`` overrides the main store's split
    count; ``out[B, Hq, D]`` / ``lse[B, Hq]`` (fp32) may be preallocated and are written in place. A
    ``head_dim`` that is not a power of two >= 16 falls back to the torch references (with a
    warning). Launch knobs: ``block_t`` tokens per tile (a power of two >= 16; default
    :func:`_block_t`), ``num_warps``, ``num_stages`` (default :func:`_num_stages`).

    Example:
        >>> out, lse = quantized_decode_attention(q, *k_parts, *v_parts, k_fmt="int4", v_fmt="int4",
        ...     k_group=128, v_group=128, k_axis="token", start=start, end=t, scaling=128**-0.5,
        ...     fp_k=tail_k, fp_v=tail_v)                    # q [B, Hq, 128]; out [B, Hq, 128] fp32
    """
    check_attention(q, k_codes, v_codes, start, end, k_axis, k_group)
    b, hq, d = q.shape
    main = _Segment((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), k_fmt, v_fmt, k_group, v_group, k_axis,
                    start, end)  # fmt: skip
    segments = [main] + [_Segment(s.tensors(), s.k_fmt, s.v_fmt, s.k_group, s.v_group, s.k_axis, s.start, s.end)
                         for s in extra]  # fmt: skip
    if fp_k is not None and fp_k.shape[2] > 0:
        n = fp_k.shape[2]
        segments.append(_Segment((fp_k, None, None, fp_v, None, None), "none", "none", None, None, "token",
                                 _zero_starts(b, q.device), n, fp_valid, dense=True))  # fmt: skip
    if not (is_pow2(d) and d >= 16):
        warnings.warn(
            f"quantized_decode_attention: head_dim {d} is not a power of two >= 16; using the torch references",
            stacklevel=2,
        )
        return _reference(q, segments, scaling, softcap, out, lse)
    if out is None:
        out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if out.shape != (b, hq, d) or lse.shape != (b, hq) or lse.dtype != torch.float32:
        raise ValueError(f"out / lse: expected [{b}, {hq}, {d}] and fp32 [{b}, {hq}]")
    if b * hq == 0:
        return out, lse
    knobs = dict(block_t=block_t, num_warps=num_warps, num_stages=num_stages)
    launches = [seg.prepare(q, **knobs) for seg in segments]
    for i, (seg, launch) in enumerate(zip(segments, launches, strict=True)):
        if i and launch.n_tiles == 0:  # (an empty extra segment adds nothing)
            launch.splits = 0
        elif i == 0 and num_splits is not None:
            launch.splits = max(1, min(int(num_splits), max(launch.n_tiles, 1)))
        else:
            launch.splits = default_num_splits(b * seg.tensors[0].shape[1], launch.n_tiles, q.device)
    total = sum(x.splits for x in launches)
    if total == 1:  # the split kernel writes the final result
        launches[0].launch(q, out.unsqueeze(2), lse.unsqueeze(2), scaling, softcap)
        return out, lse
    o_part = torch.empty(b, hq, total, d, dtype=torch.float32, device=q.device)
    l_part = torch.empty(b, hq, total, dtype=torch.float32, device=q.device)
    first = 0
    for x in launches:
        if x.splits:
            x.launch(
                q,
                o_part[:, :, first : first + x.splits],
                l_part[:, :, first : first + x.splits],
                scaling,
                softcap,
            )
            first += x.splits
    merge_splits_kernel[(b * hq,)](
        o_part,
        l_part,
        out,
        lse,
        total,
        hq,
        *o_part.stride(),
        *l_part.stride(),
        *out.stride(),
        *lse.stride(),
        D=d,
        BS=triton.next_power_of_2(total),
    )
    return out, lse


_ZERO_STARTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _zero_starts(b: int, device: torch.device) -> torch.Tensor:
    """int64 zeros ``[b]`` on ``device``, made once (the full-precision segment starts at 0 in every row)."""
    key = (b, device)
    if key not in _ZERO_STARTS:
        _ZERO_STARTS[key] = torch.zeros(b, dtype=torch.long, device=device)
    return _ZERO_STARTS[key]


@dataclass
class _Segment:
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

    def prepare(self, q: torch.Tensor, *, block_t, num_warps, num_stages) -> _Launch:
        """The kernel arguments of this segment (checked) as a :class:`_Launch`."""
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = self.tensors
        check_attention(q, k_codes, v_codes, self.start, self.end, self.k_axis, self.k_group)
        d = q.shape[2]
        kg = d if self.k_group is None else (min(self.k_group, d) if self.k_axis == "token" else self.k_group)
        vg = d if self.v_group is None else min(self.v_group, d)
        if self.k_axis == "token" and d % kg or d % vg:
            raise ValueError(f"k_group / v_group: {kg}, {vg} must divide head_dim {d}")
        k_read, k_mode, k_scale, k_zero, k_has_s, k_has_z = _operand(
            k_codes, k_scale, k_zero, self.k_fmt, kg, self.k_axis, d
        )
        v_read, v_mode, v_scale, v_zero, v_has_s, v_has_z = _operand(
            v_codes, v_scale, v_zero, self.v_fmt, vg, "token", d
        )
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale), ("k_zero", k_zero), ("v_zero", v_zero)):
            if t is not None and t.dtype.itemsize == 1 and t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}: 8-bit scales are float8_e4m3fn, not {t.dtype}")
        tables = bool(k_read.lut or v_read.lut)
        bt, k_mode = _block_t(d, k_mode, v_mode, self.k_axis, kg, block_t, tables)
        stages = num_stages if num_stages is not None else _num_stages(k_read, v_read)
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
            *_strides4(k_scale),
            *_strides4(k_zero),
            *v_codes.stride(),
            *_strides4(v_scale),
            *_strides4(v_zero),
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
        return _Launch(
            args, strides, val_strides, consts, int(self.end), hkv, triton.cdiv(max(self.end, 0), bt)
        )


@dataclass
class _Launch:
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
                 num_stages=None) -> _Launch:  # fmt: skip
    """The split kernel's launch for one store segment (constexprs in ``.consts``, arguments from
    ``.runtime_args``), exactly as :func:`quantized_decode_attention` prepares it, without
    launching: for offline builds (:mod:`kvquant.tools.kernel_resources`). ``tensors``: the six store
    buffers ``(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)``."""
    seg = _Segment(tuple(tensors), k_fmt, v_fmt, k_group, v_group, k_axis, start, end)
    return seg.prepare(q, block_t=block_t, num_warps=num_warps, num_stages=num_stages)


def _reference(q, segments, scaling, softcap, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments by the torch references, merged by log-sum-exp (head sizes the kernel cannot take)."""
    parts = []
    for seg in segments:
        if seg.dense:
            parts.append(
                dense_decode_attention_ref(q, seg.tensors[0], seg.tensors[3], seg.valid, scaling, softcap)
            )
            continue
        parts.append(
            quantized_decode_attention_ref(
                q,
                *seg.tensors,
                k_fmt=seg.k_fmt,
                v_fmt=seg.v_fmt,
                k_group=seg.k_group,
                v_group=seg.v_group,
                k_axis=seg.k_axis,
                start=seg.start,
                end=seg.end,
                scaling=scaling,
                softcap=softcap,
            )  # fmt: skip
        )
    res_o, res_l = (
        parts[0] if len(parts) == 1 else merge_attention([o for o, _ in parts], [x for _, x in parts])
    )
    if out is not None:
        out.copy_(res_o)
        res_o = out
    if lse is not None:
        lse.copy_(res_l)
        res_l = lse
    return res_o, res_l
