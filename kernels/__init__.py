"""kvquant's kernels, installed as ``kvquant.kernels`` (never as a top-level ``kernels``).

Every op has one signature and one dispatch, :mod:`kvquant.kernels.ops` (``quantize_append``,
``decode_attention``, ``encode``, ``backend_for``); the backends it picks from, in that order:

=========================  ===============================================================
``triton/``                Triton kernels (CUDA; ``TRITON_INTERPRET=1`` runs them on CPU)
``cpu/``                   C kernels via ctypes, built at first use
``chunked.py``             chunked torch decode, any device
``reference.py``           plain-torch twins: the spec the others are tested against
=========================  ===============================================================

Each backend declares what it supports (:mod:`kvquant.kernels.backend`). Exported here as before:
the Triton kernels and their twins (:func:`quantize_append` / :func:`quantize_append_ref`,
:func:`quantized_decode_attention` / :func:`quantized_decode_attention_ref`), :func:`merge_attention`
(torch) to combine partial attentions by log-sum-exp, and :func:`use_triton`. Triton reads
``TRITON_INTERPRET`` when the kernels are decorated, i.e. when this package is first imported:
set it before that to run them on CPU.

Example:
    >>> from kvquant.kernels import ops
    >>> ops.backend_for("decode_attention", fmt="int4", head_dim=128, device="cuda")
    'triton'
"""

from __future__ import annotations

import os

import torch

from kvquant.kernels.reference import merge_attention, quantize_append_ref, quantized_decode_attention_ref

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a linux dependency
    HAS_TRITON = False

if HAS_TRITON:
    from kvquant.kernels.triton._common import INTERPRET
    from kvquant.kernels.triton.decode_attention import quantized_decode_attention
    from kvquant.kernels.triton.quantize import quantize_append
else:  # pragma: no cover
    INTERPRET = False
    quantize_append = quantize_append_ref
    quantized_decode_attention = quantized_decode_attention_ref


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``'s device.

    True for CUDA tensors when Triton is importable, and for any tensor while ``TRITON_INTERPRET=1``
    if it was already set when this package was imported (Triton reads it when the ``@triton.jit``
    decorators run; setting it later cannot turn compiled kernels into interpreted ones).
    """
    if not HAS_TRITON:
        return False
    return tensor.is_cuda or (bool(INTERPRET) and os.environ.get("TRITON_INTERPRET", "0") == "1")


__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "merge_attention",
    "quantize_append",
    "quantize_append_ref",
    "quantized_decode_attention",
    "quantized_decode_attention_ref",
    "use_triton",
]
