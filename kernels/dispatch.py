"""The dispatch of :mod:`kvquant.kernels.ops`: the backends in order of preference, which of them
supports a call (from its record, :mod:`kvquant.kernels.backend`; memoised), the one a call runs on
(:func:`pick`, or forced with ``backend=``), and :func:`backend_for`, the same from a description.

Example:
    >>> backend_for("decode_attention", fmt="none", head_dim=64, device="cpu")
    'chunked'
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import fields as record_fields

import torch

from kvquant.kernels.backend import (
    Backend,
    DecodeCall,
    DequantizeCall,
    EncodeCall,
    QuantizeCall,
    RotateCall,
    TranscodeCall,
)

OPS = ("quantize_append", "decode_attention", "dequantize", "transcode", "encode", "rotate", "rotate_pair")


@functools.cache
def backends() -> tuple[Backend, ...]:
    """Every backend, in the order of preference: triton > cpu > chunked > reference."""
    from kvquant.kernels.chunked import BACKEND as chunked
    from kvquant.kernels.cpu.backend import BACKEND as cpu
    from kvquant.kernels.reference import BACKEND as reference
    from kvquant.kernels.triton.backend import BACKEND as triton

    return (triton, cpu, chunked, reference)


def why_unsupported(backend: Backend, op: str, call, forced: bool) -> str | None:
    """None when ``backend`` supports ``call`` of ``op`` (device and capability), else why not."""
    on_device = call.device in backend.devices
    if not on_device and forced and backend.interpretable:
        from kvquant.kernels import use_triton

        on_device = use_triton(torch.empty(0, device=call.device))
    if not on_device:
        return f"runs on {', '.join(sorted(backend.devices))}, not {call.device}"
    check = {
        "quantize_append": backend.supports_quantize,
        "decode_attention": backend.supports_decode,
        "encode": backend.supports_encode,
        "rotate": backend.supports_rotate,
        "rotate_pair": backend.supports_rotate,
        "dequantize": backend.supports_dequantize,
        "transcode": backend.supports_transcode,
    }[op]
    return check(call)


_RECORDS = {
    "quantize_append": QuantizeCall,
    "decode_attention": DecodeCall,
    "encode": EncodeCall,
    "rotate": RotateCall,
    "rotate_pair": RotateCall,
    "dequantize": DequantizeCall,
    "transcode": TranscodeCall,
}


@functools.lru_cache(maxsize=1024)
def supporting(op: str, fields: tuple) -> tuple[Backend, ...]:
    """The backends that support the call of ``op`` described by ``fields`` (its record's fields, in
    order), in order: a pure function of the description, memoised, so a decode step pays one
    dictionary lookup per op instead of building a record and asking every backend."""
    call = _RECORDS[op](*fields)
    return tuple(b for b in backends() if why_unsupported(b, op, call, forced=False) is None)


def pick(op: str, fields: tuple, backend: str | None) -> Iterator[Backend]:
    """The backends to try for a call in order, checked lazily (the forced one alone). Availability
    (e.g. the C library built) is asked at every call, after support: it may build the library."""
    if backend is not None:
        call = _RECORDS[op](*fields)
        names = [b.name for b in backends()]
        if backend not in names:
            raise ValueError(f"backend: unknown backend {backend!r}; allowed: {', '.join(names)}")
        (b,) = [b for b in backends() if b.name == backend]
        reason = why_unsupported(b, op, call, forced=True) or b.available()
        if reason is not None:
            raise ValueError(f"backend: {backend} cannot run this {op} ({reason})")
        return iter([b])
    return (b for b in supporting(op, fields) if b.available() is None)


def backend_for(op_name: str, **call) -> str:
    """The backend that would run a call of ``op_name``, from a description (no tensors needed).

    ``quantize_append``: ``fmt``, ``head_dim``, ``device``, ``group_size`` (default ``head_dim``),
    ``axis``, ``scale_dtype`` (default fp16; None for ``none``), ``static_scale``.
    ``decode_attention``: ``k_fmt``, ``v_fmt`` (or ``fmt`` for both), ``head_dim``, ``device``,
    ``k_axis``, ``k_group``, ``v_group``, ``scale_dtype`` (or ``k_scale_dtype`` / ``v_scale_dtype``),
    ``fp_tokens``. ``encode``: ``fmt``, ``head_dim``, ``device``. ``rotate``: ``head_dim``, ``device``.
    ``dequantize``: ``fmt``, ``head_dim``, ``device``, ``axis``, ``scale_dtype``.
    ``transcode``: ``src_fmt``, ``dst_fmt``, ``head_dim``, ``device``, ``src_axis``, ``dst_axis``,
    ``scale_dtype`` (the source's), ``dst_scale_dtype``, ``static_scale``; a call no backend runs in
    one piece names the backends of its two ops (``"reference+reference"``).

    Example:
        >>> backend_for("decode_attention", fmt="none", head_dim=64, device="cpu")
        'chunked'
    """
    if op_name not in OPS:
        raise ValueError(f"op_name: unknown op {op_name!r}; allowed: {', '.join(OPS)}")
    call = dict(call)
    device = str(torch.device(call.pop("device", "cpu")).type)
    head_dim = call.pop("head_dim", 128)
    scale_dtype = call.pop("scale_dtype", torch.float16)
    if op_name == "encode":
        desc = EncodeCall(call.pop("fmt"), head_dim, device)
    elif op_name in ("rotate", "rotate_pair"):
        desc = RotateCall(head_dim, device)
    elif op_name == "dequantize":
        sdt = None if call.get("fmt") == "none" else scale_dtype
        desc = DequantizeCall(call.pop("fmt"), head_dim, device, call.pop("axis", "token"), sdt)
    elif op_name == "transcode":
        desc = TranscodeCall(
            call.pop("src_fmt"),
            call.pop("dst_fmt"),
            head_dim,
            device,
            call.pop("src_axis", "token"),
            scale_dtype,
            call.pop("dst_axis", "token"),
            call.pop("dst_scale_dtype", scale_dtype),
            bool(call.pop("static_scale", False)),
        )
    elif op_name == "quantize_append":
        fmt = call.pop("fmt")
        desc = QuantizeCall(
            fmt,
            head_dim,
            device,
            call.pop("group_size", None) or head_dim,
            call.pop("axis", "token"),
            scale_dtype,
            bool(call.pop("static_scale", False)),
        )
    else:
        fmt = call.pop("fmt", None)
        k_fmt, v_fmt = call.pop("k_fmt", fmt), call.pop("v_fmt", fmt)
        desc = DecodeCall(
            k_fmt,
            v_fmt,
            head_dim,
            device,
            call.pop("k_axis", "token"),
            call.pop("k_group", None),
            call.pop("v_group", None),
            call.pop("k_scale_dtype", scale_dtype),
            call.pop("v_scale_dtype", scale_dtype),
            bool(call.pop("fp_tokens", False)),
        )
    if call:
        raise ValueError(f"call: unknown fields for {op_name}: {', '.join(sorted(call))}")
    fields = tuple(getattr(desc, f.name) for f in record_fields(desc))
    if op_name == "transcode":  # no backend moves the rows in one call: its two ops, on theirs
        movers = list(pick(op_name, fields, None))
        if not movers:
            read, write = desc.parts()
            return "+".join(
                next(pick(op, tuple(getattr(c, f.name) for f in record_fields(c)), None)).name
                for op, c in (("dequantize", read), ("quantize_append", write))
            )
        return movers[0].name
    return next(pick(op_name, fields, None)).name
