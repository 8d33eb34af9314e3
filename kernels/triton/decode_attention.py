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

import torch
import triton

from kvquant.kernels.backend import SegmentRead
from kvquant.kernels.reference import (
    check_attention,
    dense_decode_attention_ref,
    merge_attention,
    quantized_decode_attention_ref,
)
from kvquant.kernels.triton._common import is_pow2
from kvquant.kernels.triton.decode_kernels import merge_splits_kernel
from kvquant.kernels.triton.decode_launch import Segment

# --------------------------------------------------------------------------------------------- launcher


def default_num_splits(batch_heads: int, n_tiles: int, device: torch.device) -> int:
    """Splits per (batch, KV head): enough programs to fill the device, at least 4 tiles per split."""
    if n_tiles <= 1:
        return 1
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # interpreter: few programs (each one is slow), but still exercise the merge
        target = 2 * batch_heads
    return max(1, min(triton.cdiv(target, batch_heads), triton.cdiv(n_tiles, 4), 128))


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
    :func:`tile_tokens`), ``num_warps``, ``num_stages`` (default :func:`pipeline_stages`).

    Example:
        >>> out, lse = quantized_decode_attention(q, *k_parts, *v_parts, k_fmt="int4", v_fmt="int4",
        ...     k_group=128, v_group=128, k_axis="token", start=start, end=t, scaling=128**-0.5,
        ...     fp_k=tail_k, fp_v=tail_v)                    # q [B, Hq, 128]; out [B, Hq, 128] fp32
    """
    check_attention(q, k_codes, v_codes, start, end, k_axis, k_group)
    b, hq, d = q.shape
    main = Segment((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), k_fmt, v_fmt, k_group, v_group, k_axis,
                    start, end)  # fmt: skip
    segments = [main] + [Segment(s.tensors(), s.k_fmt, s.v_fmt, s.k_group, s.v_group, s.k_axis, s.start, s.end)
                         for s in extra]  # fmt: skip
    if fp_k is not None and fp_k.shape[2] > 0:
        n = fp_k.shape[2]
        segments.append(Segment((fp_k, None, None, fp_v, None, None), "none", "none", None, None, "token",
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
