"""``kvquant.kernels.ops``: one dispatch per op, every backend against the reference.

- ``backend_for`` names the backend a call takes (triton > cpu > chunked > reference);
- ``quantize_append`` writes the codes / scales / zero points of ``formats.quantize`` on every
  format, into poisoned buffers (an unwritten or stray element fails);
- ``decode_attention`` on every backend that runs a format pair equals the reference; the two torch
  references (dequantize-then-attend and the chunked fold) equal each other on every format;
- full-precision tokens: one call equals one softmax over the dequantized store and those tokens,
  for a backend that takes them (C) and one that does not (chunked, merged inside ``ops``).
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import FORMAT_NAMES, QuantizedBlock, dequantize, format_spec, quantize
from kvquant.kernels import ops
from kvquant.kernels.backend import deferred_flag, raise_deferred
from kvquant.kernels.cpu import native_available
from kvquant.kernels.reference import (
    dense_decode_attention_ref,
    merge_attention,
    quantized_decode_attention_ref,
)

QUANTIZED = [f for f in FORMAT_NAMES if f != "none"]
HAS_C = native_available()


def _store(x, fmt, group, axis="token", scale_dtype=torch.float16, static=None):
    """``(codes, scale, zero)`` of ``x[B, H, T, D]`` as a store holds them at indices ``[0, T)``."""
    q = quantize(x, fmt, group_size=group, axis=axis, scale_dtype=scale_dtype, static_scale=static)
    return q.codes, q.scale, q.zero


def _close(got, ref, rel=1e-4):
    (go, gl), (ro, rl) = got, ref
    assert go.shape == ro.shape and gl.shape == rl.shape
    assert not torch.isnan(go).any() and not torch.isnan(gl).any()
    scale = ro.abs().max().clamp_min(1e-6)
    assert ((go - ro).abs().max() / scale).item() <= rel
    finite = torch.isfinite(rl)
    assert torch.equal(finite, torch.isfinite(gl))
    if finite.any():
        assert (gl[finite] - rl[finite]).abs().max().item() <= rel * max(1.0, rl[finite].abs().max().item())


# --------------------------------------------------------------------------------------------- which backend


def test_backend_for_names_the_expected_backend():
    c = "cpu" if HAS_C else "chunked"
    assert ops.backend_for("decode_attention", fmt="int4", head_dim=64) == c
    assert ops.backend_for("decode_attention", fmt="tcq2", head_dim=64) == c
    assert ops.backend_for("decode_attention", fmt="none", head_dim=64) == "chunked"
    assert ops.backend_for("decode_attention", k_fmt="int4", v_fmt="tcq3", head_dim=64) == c
    assert ops.backend_for("decode_attention", fmt="int4", head_dim=1024) == "chunked"  # C: up to 512
    assert ops.backend_for("quantize_append", fmt="int4", head_dim=64) == ("cpu" if HAS_C else "reference")
    quantize_int4_channel = ops.backend_for("quantize_append", fmt="int4", head_dim=64, axis="channel")
    assert quantize_int4_channel == ("cpu" if HAS_C else "reference")  # KIVI's keys
    assert ops.backend_for("quantize_append", fmt="nuq4", head_dim=64) == ("cpu" if HAS_C else "reference")
    assert ops.backend_for("encode", fmt="tcq2", head_dim=64) == ("cpu" if HAS_C else "reference")
    assert ops.backend_for("encode", fmt="nuq2", head_dim=64) == "reference"
    pytest.importorskip("triton")
    for fmt in ("int8", "int4", "int2", "fp8_e5m2", "none"):  # described, no GPU needed
        assert ops.backend_for("decode_attention", fmt=fmt, head_dim=128, device="cuda") == "triton"
        assert ops.backend_for("quantize_append", fmt=fmt, head_dim=128, device="cuda") == "triton"
    for fmt in ("int3", "nuq4", "tcq2", "tcq3"):  # tables and trellis states read in the kernel (issue 13)
        assert ops.backend_for("decode_attention", fmt=fmt, head_dim=128, device="cuda") == "triton"
    fp8 = torch.float8_e4m3fn
    assert (
        ops.backend_for("decode_attention", fmt="tcq2", head_dim=64, device="cuda", scale_dtype=fp8)
        == "triton"
    )
    assert ops.backend_for("decode_attention", fmt="int4", head_dim=96, device="cuda") == "chunked"
    for fmt in ("int3", "nuq4"):  # int3 planes, the codebook scale search in the kernel (issue 13)
        assert ops.backend_for("quantize_append", fmt=fmt, head_dim=128, device="cuda") == "triton"
    fp8_scales = dict(head_dim=128, device="cuda", scale_dtype=torch.float8_e4m3fn)
    assert ops.backend_for("quantize_append", fmt="int8", **fp8_scales) == "triton"
    assert ops.backend_for("quantize_append", fmt="nuq4", axis="channel", **fp8_scales) == "reference"


def test_bad_calls_get_one_clear_error():
    with pytest.raises(ValueError, match="op_name: unknown op"):
        ops.backend_for("attend", fmt="int4")
    with pytest.raises(ValueError, match="call: unknown fields"):
        ops.backend_for("encode", fmt="tcq2", heads=4)
    with pytest.raises(ValueError, match="backend: unknown backend 'gpu'; allowed: triton, cpu"):
        ops.encode(torch.randn(2, 64), "tcq2", backend="gpu")
    with pytest.raises(ValueError, match=r"backend: chunked cannot run this encode"):
        ops.encode(torch.randn(2, 64), "tcq2", backend="chunked")
    with pytest.raises(ValueError, match="fmt: none has no codes to search"):
        ops.encode(torch.randn(2, 64), "none")


# --------------------------------------------------------------------------------------------- quantize


def _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, static=None, dtype=torch.float32):
    """Store buffers, poisoned: codes 0xA5 (``none``: NaN in ``dtype``), scales / zero points NaN."""
    spec = format_spec(fmt)
    if spec.code_dtype is None:
        return torch.full((b, h, cap, d), float("nan"), dtype=dtype), None, None
    codes = torch.full((b, h, cap, spec.code_width(d)), 0xA5, dtype=torch.uint8).view(spec.code_dtype)
    if static is not None:
        return codes, static.to(scale_dtype).view(1, h, 1, 1), None
    rows, cols = (cap // g, d) if axis == "channel" else (cap, d // g)
    scale = torch.full((b, h, rows, cols), float("nan"), dtype=scale_dtype)
    return codes, scale, torch.full_like(scale, float("nan")) if spec.has_zero else None


def _bits(t):
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def _check_append(x, fmt, g, axis="token", scale_dtype=torch.float16, index=8, static=None, backend=None):
    b, h, n, d = x.shape
    cap = index + n + 8
    codes, scale, zero = _buffers(fmt, b, h, cap, d, g, axis, scale_dtype, static, x.dtype)
    poisoned = [None if t is None else t.clone() for t in (codes, scale, zero)]
    ops.quantize_append(
        x,
        codes,
        scale,
        zero,
        index,
        fmt=fmt,
        group_size=g,
        axis=axis,
        static_scale=static is not None,
        backend=backend,
    )
    want = quantize(x, fmt, group_size=g, axis=axis, scale_dtype=scale_dtype, static_scale=static)
    blk = g if axis == "channel" else 1
    for got, old, ref, block in ((codes, poisoned[0], want.codes, 1), (scale, poisoned[1], want.scale, blk), (zero, poisoned[2], want.zero, blk)):  # fmt: skip
        if got is None:
            assert ref is None or static is not None
            continue
        if static is not None and got is scale:
            assert torch.equal(_bits(got), _bits(old))  # read, not written
            continue
        r0, r1 = index // block, (index + n) // block
        if format_spec(fmt).code_dtype is None:
            assert torch.equal(got[:, :, r0:r1], ref)
        else:
            assert torch.equal(_bits(got[:, :, r0:r1]), _bits(ref)), f"{fmt} {axis} {scale_dtype}"
        outside = torch.cat([_bits(got[:, :, :r0]), _bits(got[:, :, r1:])], dim=2)
        expect = torch.cat([_bits(old[:, :, :r0]), _bits(old[:, :, r1:])], dim=2)
        assert torch.equal(outside, expect), "written outside [index, index + n)"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_quantize_append_writes_the_spec_codes(fmt, scale_dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 64) * torch.logspace(-2, 2, 11)[None, None, :, None]
    if scale_dtype == torch.float8_e4m3fn and format_spec(fmt).has_zero:
        x = x / 100  # 8-bit zero points hold small values only
    _check_append(x, fmt, 32, scale_dtype=scale_dtype)
    _check_append(x.to(torch.bfloat16), fmt, 64, scale_dtype=scale_dtype, index=0)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2"])
def test_quantize_append_channel_axis_and_static_scales(fmt):
    torch.manual_seed(1)
    x = torch.randn(2, 2, 32, 64)
    _check_append(x, fmt, 16, axis="channel", index=16)
    if format_spec(fmt).takes_static_scale:
        _check_append(x, fmt, 64, static=torch.tensor([0.01, 0.02]), index=3)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("fmt", ["int4", "int8", "tcq2"])
def test_every_quantize_backend_writes_the_same_codes(backend, fmt):
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(2)
    x = torch.randn(1, 2, 9, 64)
    try:
        _check_append(x, fmt, 32, backend=backend)
    except ValueError as err:
        assert "cannot run" in str(err)
        if backend == "cpu" and HAS_C or backend == "triton" and fmt != "tcq2":
            raise


@pytest.mark.parametrize("fmt", ["tcq2", "tcq3", "nuq4", "int4", "fp8_e5m2"])
@pytest.mark.parametrize("d", [4, 16, 64, 96])
def test_encode_gives_the_same_codes_on_every_backend(fmt, d):
    from kvquant.formats.trellis import trellis_encode

    torch.manual_seed(d)
    y = torch.randn(37, d)
    ref = ops.encode(y, fmt, backend="reference")
    assert torch.equal(ops.encode(y, fmt).view(torch.uint8), ref.view(torch.uint8))
    if format_spec(fmt).state_bits is not None:
        assert torch.equal(ref, trellis_encode(y, format_spec(fmt).bits))
        if HAS_C:
            assert torch.equal(ops.encode(y, fmt, backend="cpu"), ref)


@pytest.mark.parametrize("backend", [None, "reference", "cpu", "triton"])
@pytest.mark.parametrize("fmt", ["int4", "nuq3", "tcq2"])
def test_nan_input_raises_the_spec_error(backend, fmt):
    if backend == "triton":
        pytest.importorskip("triton")
    x = torch.randn(1, 1, 4, 32)
    x[0, 0, 2, 5] = float("nan")
    codes, scale, zero = _buffers(fmt, 1, 1, 8, 32, 32, "token", torch.float16)
    with pytest.raises(ValueError) as err:
        ops.quantize_append(x, codes, scale, zero, 0, fmt=fmt, group_size=32, backend=backend)
    if "cannot run" not in str(err.value):  # (a forced backend that does not run this format)
        assert str(err.value).startswith("input: key/value states contain NaN or Inf")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_defers_to_the_flag_on_cuda(dtype, bad):
    k = torch.randn(2, 3, 5, 64, device="cuda", dtype=dtype)
    v = torch.full_like(k, torch.finfo(dtype).max)  # the largest finite value is not flagged
    raise_deferred()
    ops.check_finite(k, v)
    raise_deferred()  # nothing flagged
    v[1, 2, 4, 63] = bad
    ops.check_finite(k, v)  # no host sync, no error yet
    with pytest.raises(ValueError, match="input: key/value states contain NaN or Inf"):
        raise_deferred("cuda")
    raise_deferred()  # cleared


@pytest.mark.parametrize(
    ("fmt", "axis", "scale_dtype"),
    [
        ("int4", "token", torch.float16),
        ("nuq4", "token", torch.float8_e4m3fn),
        ("int2", "channel", torch.float16),
    ],
)
def test_quantize_kernel_flags_errors_for_the_next_sync_point_once(fmt, axis, scale_dtype):
    """The Triton kernel raises the device flag itself (no check of its own launched): 2 for a
    non-finite input, 1 for a scale the scale dtype cannot hold, the worst one kept; raise_deferred
    raises it once and clears it."""
    pytest.importorskip("triton")
    from kvquant.kernels import INTERPRET
    from kvquant.kernels.triton.quantize import quantize_append as triton_quantize

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 at import")
    flag = deferred_flag("cpu")
    raise_deferred("cpu")  # (a clean flag)

    def write(x):
        codes, scale, zero = _buffers(fmt, 1, 2, 64, 32, 32 if axis == "channel" else 16, axis, scale_dtype)
        triton_quantize(x, codes, scale, zero, 0, fmt, 32 if axis == "channel" else 16, axis, flag=flag)

    ok = torch.randn(1, 2, 32, 32)
    write(ok)
    assert int(flag) == 0
    raise_deferred()  # nothing flagged
    big = ok.clone()
    big[0, 1, 7, 3] = 1e30 if scale_dtype == torch.float8_e4m3fn else 3e9  # finite; its scale is not
    write(big)
    assert int(flag) == 1
    nan = ok.clone()
    nan[0, 0, 30, 31] = float("nan")
    write(nan)
    write(big)  # a lower code does not lower the flag
    assert int(flag) == 2
    with pytest.raises(ValueError, match="input: key/value states contain NaN or Inf"):
        raise_deferred("cpu")
    assert int(flag) == 0
    raise_deferred()  # cleared
    write(big)
    with pytest.raises(ValueError, match="scale_dtype"):
        raise_deferred()


# --------------------------------------------------------------------------------------------- decode

PAIRS = [
    ("int4", "int4"),
    ("int8", "fp8_e4m3"),
    ("int2", "int2"),
    ("fp8_e5m2", "int8"),
    ("none", "none"),
    ("int3", "nuq4"),
    ("nuq2", "nuq3"),
    ("tcq3", "tcq2"),
]


def _decode_case(k_fmt, v_fmt, *, b=2, hkv=2, gq=3, t=63, d=64, k_group=32, v_group=64, k_axis="token", seed=0, static=None):  # fmt: skip
    torch.manual_seed(seed)
    k, v = torch.randn(b, hkv, t, d) * 2 + 0.3, torch.randn(b, hkv, t, d)
    q = torch.randn(b, hkv * gq, d)
    kp = _store(k, k_fmt, k_group, k_axis, static=static)
    vp = _store(v, v_fmt, v_group, static=static)
    start = torch.tensor([0, t // 2, t - 1, t][:b])
    args = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, k_axis=k_axis, start=start, end=t, scaling=d**-0.5)  # fmt: skip
    return (q, *kp, *vp), args


@pytest.mark.parametrize(("k_fmt", "v_fmt"), PAIRS)
@pytest.mark.parametrize("backend", ["triton", "cpu", "chunked"])
def test_every_decode_backend_equals_the_reference(k_fmt, v_fmt, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    tensors, args = _decode_case(k_fmt, v_fmt, t=40 if backend == "triton" else 63)
    ref = quantized_decode_attention_ref(*tensors, **args)
    try:
        got = ops.decode_attention(*tensors, **args, backend=backend)
    except ValueError as err:
        assert "cannot run" in str(err)
        return
    _close(got, ref)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("t", [1, 63, 130])
@pytest.mark.parametrize("gq", [1, 3])
def test_the_two_references_agree_on_every_format(fmt, t, gq):
    from kvquant.kernels.chunked import decode_attention_torch

    tensors, args = _decode_case(fmt, fmt, t=t, gq=gq, b=3, seed=t)
    ref = quantized_decode_attention_ref(*tensors, **args)
    _close(decode_attention_torch(*tensors, **args, chunk=32), ref)
    _close(decode_attention_torch(*tensors, **args), ref)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_two_references_agree_on_static_scales(fmt):
    from kvquant.kernels.chunked import decode_attention_torch

    tensors, args = _decode_case(fmt, fmt, t=70, static=torch.tensor([0.05, 0.03]), k_group=64)
    ref = quantized_decode_attention_ref(*tensors, **args)
    _close(decode_attention_torch(*tensors, **args, chunk=32), ref)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2", "fp8_e5m2"])
@pytest.mark.parametrize("t", [32, 128])
def test_the_two_references_agree_on_channel_axis_keys(fmt, t):
    from kvquant.kernels.chunked import decode_attention_torch

    tensors, args = _decode_case(fmt, "int4", t=t, k_axis="channel", k_group=16, seed=t)
    ref = quantized_decode_attention_ref(*tensors, **args)
    _close(decode_attention_torch(*tensors, **args, chunk=48), ref)


def _needs(backend):
    if backend == "cpu" and not HAS_C:
        pytest.skip("no C compiler")
    if backend == "triton":
        pytest.importorskip("triton")


def _one_softmax(tensors, args, fp_k, fp_v, valid):
    """Attention over the dequantized store and the full-precision tokens in one softmax."""
    q, kc, ks, kz, vc, vs, vz = tensors
    d = q.shape[-1]
    k = dequantize(QuantizedBlock(kc, ks, kz), args["k_fmt"], head_dim=d, group_size=args["k_group"], axis=args["k_axis"])  # fmt: skip
    v = dequantize(QuantizedBlock(vc, vs, vz), args["v_fmt"], head_dim=d, group_size=args["v_group"])
    pos = torch.arange(k.shape[2])
    store_valid = (pos[None, :] >= args["start"][:, None]) & (pos[None, :] < args["end"])
    fp_valid = torch.ones(fp_k.shape[0], fp_k.shape[2], dtype=torch.bool) if valid is None else valid
    return dense_decode_attention_ref(
        q,
        torch.cat([k, fp_k], 2),
        torch.cat([v, fp_v], 2),
        torch.cat([store_valid, fp_valid], 1),
        args["scaling"],
    )


@pytest.mark.parametrize("backend", ["cpu", "triton", "chunked", "reference"])
@pytest.mark.parametrize("with_mask", [True, False])
def test_full_precision_tokens_join_the_same_softmax(backend, with_mask):
    _needs(backend)
    tensors, args = _decode_case("int4", "nuq2", t=50, k_group=64, v_group=32, seed=7)
    b, hkv, n, d = 2, 2, 7, 64
    fk, fv = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    valid = torch.rand(b, n) > 0.3 if with_mask else None
    if valid is not None:
        valid[:, -1] = True  # the new token always counts
    want = _one_softmax(tensors, args, fk, fv, valid)
    got = ops.decode_attention(*tensors, **args, fp_k=fk, fp_v=fv, fp_valid=valid, backend=backend)
    _close(got, want)
    # and: store partial merged with the dense partial
    store = quantized_decode_attention_ref(*tensors, **args)
    dense = dense_decode_attention_ref(tensors[0], fk, fv, valid, args["scaling"])
    _close(got, merge_attention([store[0], dense[0]], [store[1], dense[1]]))


def test_an_empty_store_range_leaves_the_full_precision_tokens():
    tensors, args = _decode_case("int4", "int4", t=8, k_group=64)
    args["start"] = torch.tensor([8, 8])
    fk, fv = torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64)
    out, lse = ops.decode_attention(*tensors, **args)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    got = ops.decode_attention(*tensors, **args, fp_k=fk, fp_v=fv, backend="chunked")
    _close(got, dense_decode_attention_ref(tensors[0], fk, fv, None, args["scaling"]))


def _segment(k_fmt, v_fmt, t, seed, k_axis="token", k_group=32):
    """A second quantized segment (as the recent window is) and what it holds, dequantized."""
    tensors, args = _decode_case(k_fmt, v_fmt, t=t, k_group=k_group, k_axis=k_axis, seed=seed)
    seg = ops.SegmentRead(
        *tensors[1:],
        k_fmt=k_fmt,
        v_fmt=v_fmt,
        k_group=k_group,
        v_group=args["v_group"],
        k_axis=k_axis,
        start=torch.tensor([3, 0]),
        end=t if k_axis == "channel" else t - 2,  # a per-channel store holds whole blocks
    )
    args = dict(args, start=seg.start, end=seg.end)
    return seg, tensors, args


@pytest.mark.parametrize("backend", [None, "cpu", "triton", "chunked", "reference"])
def test_more_segments_join_the_same_softmax(backend):
    """The recent window as one more segment: one C call (no merge), or one Triton launch per segment
    and one merge, equals the reference's partials of the main store, the full-precision tokens (a
    mask with holes) and each segment merged by log-sum-exp; a segment of formats the main call's
    backend does not read goes through its own dispatch."""
    _needs(backend)
    tensors, args = _decode_case("tcq3", "int2", t=70, k_group=32, v_group=64, seed=3)
    q = tensors[0]
    fk, fv = torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64)
    valid = torch.tensor([[True, False, True, True, True], [False, True, True, False, True]])
    recent, r_tensors, r_args = _segment("nuq4", "nuq4", 21, seed=4)
    kivi, c_tensors, c_args = _segment("int2", "int4", 20, seed=5, k_axis="channel", k_group=5)
    parts = [
        quantized_decode_attention_ref(*tensors, **args),
        dense_decode_attention_ref(q, fk, fv, valid, args["scaling"]),
        quantized_decode_attention_ref(q, *r_tensors[1:], **r_args),
        quantized_decode_attention_ref(q, *c_tensors[1:], **c_args),
    ]
    want = merge_attention([o for o, _ in parts], [lse for _, lse in parts])
    fp = dict(fp_k=fk, fp_v=fv, fp_valid=valid)
    got = ops.decode_attention(*tensors, **args, **fp, extra=(recent, kivi), backend=backend)
    _close(got, want)
    # a segment that reads nothing (its range empty) adds nothing
    empty = ops.SegmentRead(**{**recent.__dict__, "start": torch.tensor([9, 9]), "end": 9})
    _close(ops.decode_attention(*tensors, **args, **fp, extra=(empty,), backend=backend), merge_attention(
        [o for o, _ in parts[:2]], [lse for _, lse in parts[:2]]))  # fmt: skip
    if backend == "cpu":  # split-KV: the first thread also reads the fp tokens and the segments, so it
        from kvquant.kernels.cpu import binding  # takes fewer main tokens (3 threads: none, 46 of 48)

        for threads in (2, 3):
            out, lse = torch.full_like(want[0], float("nan")), torch.full_like(want[1], float("nan"))
            got = binding.decode_attention_native(
                *tensors, **args, **fp, extra=(recent, kivi), threads=threads, out=out, lse=lse
            )
            assert not torch.isnan(out).any() and not torch.isnan(lse).any()  # (poisoned first)
            _close(got, want)


@pytest.mark.parametrize("backend", [None, "cpu", "triton", "chunked", "reference"])
def test_rotation_rotates_the_query_and_fp_tokens_in_and_the_output_back(backend):
    """``rotation=True``: stores of rotated vectors, the rest in the model's space. Equals rotating
    by hand around the reference: ``R . attn(R q; stores, R fp)``, also with more segments."""
    _needs(backend)
    tensors, args = _decode_case("nuq4", "nuq3", t=40, k_group=64, v_group=64, seed=8)
    q = tensors[0] * 3
    fk, fv = torch.randn(2, 2, 6, 64), torch.randn(2, 2, 6, 64)
    valid = torch.rand(2, 6) > 0.4
    valid[:, -1] = True
    recent, *_ = _segment("int4", "int4", 17, seed=9)
    rot = ops.rotate
    fp = dict(fp_k=fk, fp_v=fv, fp_valid=valid)
    for extra in ((), (recent,)):
        ref = dict(fp_k=rot(fk), fp_v=rot(fv), fp_valid=valid, extra=extra, backend="reference")
        w_out, w_lse = ops.decode_attention(rot(q), *tensors[1:], **args, **ref)
        got = ops.decode_attention(q, *tensors[1:], **args, **fp, extra=extra, rotation=True, backend=backend)
        _close(got, (rot(w_out), w_lse))
    if backend == "triton":  # (head sizes that are powers of two only)
        return
    t48, a48 = _decode_case("int8", "int8", d=48, k_group=48, v_group=48, seed=3)  # blocks of 16
    fk48, fv48 = torch.randn(2, 2, 3, 48), torch.randn(2, 2, 3, 48)
    ref48 = dict(fp_k=rot(fk48), fp_v=rot(fv48), backend="reference")
    w_out, w_lse = ops.decode_attention(rot(t48[0]), *t48[1:], **a48, **ref48)
    got = ops.decode_attention(*t48, **a48, fp_k=fk48, fp_v=fv48, rotation=True, backend=backend)
    _close(got, (rot(w_out), w_lse))


def _fp_segments(b=2, hkv=2, d=64, seed=21):
    """Full-precision tokens as a cache hands them over: sinks (a buffer of their own), the tail (a
    strided view into a bigger buffer), an empty segment and the new token (a transposed view)."""
    torch.manual_seed(seed)
    buf_k, buf_v = torch.randn(b, hkv, 20, d) * 2 + 1, torch.randn(b, hkv, 20, d)
    sink_k, sink_v = torch.randn(b, hkv, 3, d) * 3, torch.randn(b, hkv, 3, d)
    new_k, new_v = torch.randn(b, 1, hkv, d).transpose(1, 2), torch.randn(b, 1, hkv, d).transpose(1, 2)
    segs_k = (sink_k, buf_k[:, :, 7:12], buf_k[:, :, 0:0], new_k)
    segs_v = (sink_v, buf_v[:, :, 7:12], buf_v[:, :, 0:0], new_v)
    mean = torch.randn(b, hkv, 1, d)
    std = torch.rand(b, hkv, 1, d) * 2 + 0.25
    return segs_k, segs_v, mean, std


def _folded_by_hand(q, segs_k, segs_v, mean, std):
    """The query and fp tokens in the smoothed space, as a caller without ``smoothing`` passes them."""
    gq = q.shape[1] // mean.shape[1]
    qf = q if std is None else q * std[:, :, 0].repeat_interleave(gq, dim=1)
    fk = torch.cat(segs_k, 2) - mean
    return qf, (fk if std is None else fk / std), torch.cat(segs_v, 2)


@pytest.mark.parametrize("backend", [None, "cpu", "triton", "chunked", "reference"])
@pytest.mark.parametrize("rotation", [False, True])
def test_fp_segments_and_smoothing_equal_folding_by_hand(backend, rotation):
    """``fp_k`` / ``fp_v`` as segments (strided, empty, transposed) and ``smoothing=(mean, std)``:
    every backend equals the reference given the query and the joined fp keys folded by hand (the C
    kernel reads the segments in place and folds the statistics itself: bit for bit its own result
    on the hand-folded inputs), with and without ``std``, also with another segment and holes."""
    _needs(backend)
    tensors, args = _decode_case("nuq4", "int4", t=45, k_group=64, v_group=64, seed=13)
    q = tensors[0] * 2
    segs_k, segs_v, mean, std = _fp_segments()
    n = sum(x.shape[2] for x in segs_k)
    valid = torch.rand(2, n, generator=torch.Generator().manual_seed(2)) > 0.3
    valid[:, -1] = True
    recent, *_ = _segment("int4", "nuq3", 17, seed=9)
    for sd, extra in ((std, ()), (None, (recent,)), (std, (recent,))):
        qf, fk, fv = _folded_by_hand(q, segs_k, segs_v, mean, sd)
        common = dict(fp_valid=valid, extra=extra, rotation=rotation)
        want = ops.decode_attention(qf, *tensors[1:], **args, fp_k=fk, fp_v=fv, **common, backend="reference")
        got = ops.decode_attention(
            q, *tensors[1:], **args, fp_k=segs_k, fp_v=segs_v, smoothing=(mean, sd), **common, backend=backend
        )
        _close(got, want)
        if backend == "cpu":
            same = ops.decode_attention(qf, *tensors[1:], **args, fp_k=fk, fp_v=fv, **common, backend="cpu")
            assert torch.equal(got[0], same[0]) and torch.equal(got[1], same[1])
            from kvquant.kernels.cpu import binding

            out, lse = torch.full_like(same[0], float("nan")), torch.full_like(same[1], float("nan"))
            binding.decode_attention_native(
                q, *tensors[1:], **args, fp_k=segs_k, fp_v=segs_v, fp_valid=valid, extra=extra,
                rotation=rotation, smoothing=(mean, sd), out=out, lse=lse,
            )  # fmt: skip
            assert torch.equal(out, same[0]) and torch.equal(lse, same[1])  # (poisoned first)
    # the plan takes them the same way
    kw = {k: v for k, v in args.items() if k not in ("start", "end")}
    run = ops.plan_decode_attention(
        *tensors[1:], **kw, head_dim=64, fp_tokens=True, rotation=rotation, backend=backend
    )
    qf, fk, fv = _folded_by_hand(q, segs_k, segs_v, mean, std)
    want = ops.decode_attention(
        qf, *tensors[1:], **args, fp_k=fk, fp_v=fv, fp_valid=valid, rotation=rotation, backend="reference"
    )
    got = run(q, args["start"], args["end"], fp_k=segs_k, fp_v=segs_v, fp_valid=valid, smoothing=(mean, std))
    _close(got, want)
    if rotation and backend != "triton":  # a head of 48 channels: rotation blocks of 16
        t48, a48 = _decode_case("int8", "int8", d=48, k_group=48, v_group=48, seed=3)
        s48k, s48v, m48, sd48 = _fp_segments(d=48)
        qf, fk, fv = _folded_by_hand(t48[0], s48k, s48v, m48, sd48)
        want = ops.decode_attention(qf, *t48[1:], **a48, fp_k=fk, fp_v=fv, rotation=True, backend="reference")
        got = ops.decode_attention(
            *t48, **a48, fp_k=s48k, fp_v=s48v, smoothing=(m48, sd48), rotation=True, backend=backend
        )
        _close(got, want)


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
def test_bad_fp_segments_or_statistics_name_the_field():
    tensors, args = _decode_case("int4", "int4", t=20, k_group=64, v_group=64)
    segs_k, segs_v, mean, std = _fp_segments()
    with pytest.raises(ValueError, match="fp_k / fp_v"):
        ops.decode_attention(*tensors, **args, fp_k=segs_k, fp_v=segs_v[:2], backend="cpu")
    with pytest.raises(ValueError, match="fp_k / fp_v"):
        ops.decode_attention(
            *tensors, **args, fp_k=(segs_k[0][:, :1],), fp_v=(segs_v[0][:, :1],), backend="cpu"
        )
    with pytest.raises(ValueError, match="smoothing"):
        ops.decode_attention(
            *tensors, **args, fp_k=segs_k, fp_v=segs_v, smoothing=(mean[:, :1], std), backend="cpu"
        )


@pytest.mark.parametrize("backend", [None, "cpu", "triton", "chunked", "reference"])
@pytest.mark.parametrize("rotation", [False, True])
def test_a_decode_plan_answers_as_the_op_call_after_call(backend, rotation):
    """``plan_decode_attention`` (the buffers described once, the ranges, query and fp tokens per
    call): every call equals ``decode_attention`` with the same arguments, also after the buffers'
    contents and the ranges changed (what a cache does between decode steps)."""
    _needs(backend)
    tensors, args = _decode_case("tcq3", "nuq3", t=70, k_group=64, v_group=64, seed=11)
    recent, _, r_args = _segment("nuq4", "int4", 21, seed=12)
    fixed = {k: args[k] for k in ("k_fmt", "v_fmt", "k_group", "v_group", "k_axis", "scaling")}
    run = ops.plan_decode_attention(
        *tensors[1:],
        **fixed,
        head_dim=64,
        fp_tokens=True,
        extra=(recent,),
        rotation=rotation,
        backend=backend,
    )
    for step, end in enumerate((70, 50, 69)):
        torch.manual_seed(step)
        q, fk, fv = torch.randn(2, 6, 64), torch.randn(2, 2, 4 + step, 64), torch.randn(2, 2, 4 + step, 64)
        valid = torch.rand(2, 4 + step) > 0.3
        start, r_start, r_end = torch.tensor([step, 2 * step]), torch.tensor([1, step]), 21 - step
        tensors[1].copy_(torch.roll(tensors[1], 1, dims=2))  # the store's codes change in place
        fp = dict(fp_k=fk, fp_v=fv, fp_valid=valid)
        got = run(q, start, end, **fp, extra_bounds=((r_start, r_end),))
        seg = ops.SegmentRead(**{**recent.__dict__, "start": r_start, "end": r_end})
        want = ops.decode_attention(
            q, *tensors[1:], **{**args, "start": start, "end": end}, **fp, extra=(seg,), rotation=rotation,
            backend=backend,
        )  # fmt: skip
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ref = dict(fp, extra=(seg,), rotation=rotation, backend="reference")
        _close(got, ops.decode_attention(q, *tensors[1:], **{**args, "start": start, "end": end}, **ref))
    assert not torch.isnan(got[0]).any()


@pytest.mark.parametrize("backend", [None, "reference", "cpu"])
@pytest.mark.parametrize("fmt", ["int4", "nuq4", "fp8_e4m3", "tcq2"])
def test_a_write_plan_writes_the_op_codes_and_refuses_as_the_op(backend, fmt):
    """``plan_quantize_append`` into poisoned buffers: the codes and scales ``quantize_append``
    writes, call after call at moving indices; NaN input raises the spec's error."""
    if backend == "cpu" and not HAS_C:
        pytest.skip("no C compiler")
    torch.manual_seed(1)
    got = _buffers(fmt, 2, 3, 12, 64, 64, "token", torch.float16)
    want = tuple(None if t is None else t.clone() for t in got)
    run = ops.plan_quantize_append(*got, fmt=fmt, group_size=64, head_dim=64, backend=backend)
    for index, n in ((0, 5), (5, 1), (6, 3)):
        x = torch.randn(2, 3, n, 64) * (index + 1)
        run(x, index)
        ops.quantize_append(x, *want, index, fmt=fmt, group_size=64, backend=backend)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None) and (
            g is None or torch.equal(_bits(g[:, :, :9]), _bits(w[:, :, :9]))
        )
    bad = torch.randn(2, 3, 1, 64)
    bad[1, 2, 0, 7] = float("inf")
    with pytest.raises(ValueError, match="input: key/value states contain NaN or Inf"):
        run(bad, 9)


def test_plans_keep_the_buffers_they_describe_alive():
    """A plan holds pointers into the buffers it was made for: it keeps them alive when the caller
    drops its own references (here the buffers are made and dropped inside a function; the memory
    freed buffers would leave is overwritten before the plans run)."""
    import gc

    def make():
        tensors, args = _decode_case("nuq4", "tcq2", t=40, k_group=64, v_group=64, seed=21)
        fixed = {k: args[k] for k in ("k_fmt", "v_fmt", "k_group", "v_group", "k_axis", "scaling")}
        want = ops.decode_attention(*tensors, **args)
        run = ops.plan_decode_attention(*tensors[1:], **fixed, head_dim=64)
        src = (*tensors[1:4], "nuq4", 64, "token")
        dst = (*_buffers("int8", 2, 2, 48, 64, 64, "token", torch.float16), "int8", 64, "token", False)
        moved = [t.clone() if isinstance(t, torch.Tensor) else t for t in dst]
        ops.transcode(src, 0, 40, tuple(moved), 0, via=torch.float32, head_dim=64)
        return (
            run,
            tensors[0],
            args["start"],
            want,
            ops.plan_transcode(src, dst, via=torch.float32, head_dim=64),
            dst[:3],
            moved[:3],
        )

    run, q, start, want, move, (codes, scale, _), (want_codes, want_scale, _) = make()
    gc.collect()
    sizes = [2**i * 40 for i in range(9)] * 8  # bytes of the freed buffers' size classes, 0xFF each
    junk = [torch.full((n,), 255, dtype=torch.uint8) for n in sizes]  # (reuses freed memory)
    got = run(q, start, 40)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    move(0, 40, 0)
    assert torch.equal(codes, want_codes) and torch.equal(_bits(scale), _bits(want_scale))
    del junk
