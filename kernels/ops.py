"""TEMPORARY stand-in for the formats helper's kernels/ops.py (the lead's branch only)."""

from __future__ import annotations

import torch

from kvquant.formats import format_spec
from kvquant.kernels.reference import merge_attention, quantize_append_ref


def quantize_append(x, codes, scale, zero, index, *, fmt, group_size, axis="token", static_scale=False):
    from kvquant.native import native_quantizes_args, quantize_into_buffers

    if not static_scale and native_quantizes_args(x, fmt, axis, scale) and quantize_into_buffers(
        x, codes, scale, zero, index, fmt
    ):
        return
    quantize_append_ref(x, codes, scale, zero, index, fmt, group_size, axis, static_scale=static_scale)


def decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, k_fmt, v_fmt, k_group, v_group,
                     k_axis, start, end, scaling, softcap=None, fp_k=None, fp_v=None, fp_valid=None):
    from kvquant.decode_cpu import decode_attention_torch
    from kvquant.native import decode_attention_native, native_available, native_formats_ok

    args = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, k_axis=k_axis, start=start,
                end=end, scaling=scaling, softcap=softcap)
    t = (q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    if not q.is_cuda and native_formats_ok(k_fmt, v_fmt, q.shape[-1]) and native_available():
        return decode_attention_native(*t, **args, fp_k=fp_k, fp_v=fp_v, fp_valid=fp_valid)
    out, lse = decode_attention_torch(*t, **args)
    if fp_k is None:
        return out, lse
    from kvquant.attention import dense_attention

    mask = None if fp_valid is None else fp_valid[:, None, None, :]
    o2, l2 = dense_attention(q[:, :, None], fp_k, fp_v, mask, scaling, softcap)
    return merge_attention([out, o2[:, :, 0]], [lse, l2[:, :, 0]])
