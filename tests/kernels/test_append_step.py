"""``ops.plan_append_step``: a cache layer's decode-step append in one C call.

The C step equals its torch twin (:class:`kvquant.kernels.reference.AppendStepRef`), bit for bit:
the tail row it copies, the leaving token in the stored space, the codes, scales and zero points
it writes into the first tier and moves into the main store, over the formats the presets chain,
with and without the rotation and the smoothing statistics; nothing outside those rows is touched.
Values a write refuses raise that op's own error; what no backend plans gets None.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import format_spec, quantize
from kvquant.kernels import ops
from kvquant.kernels.cpu import native_available
from kvquant.kernels.reference import AppendStepRef

needs_c = pytest.mark.skipif(not native_available(), reason="C kernels not built")

B, H, CAP = 2, 3, 12


def _dst(fmt, d, group, scale_dtype):
    """Empty store buffers, poisoned: 0xAB codes, NaN scales and zero points."""
    spec = format_spec(fmt)
    codes = torch.full((B, H, CAP, spec.code_width(d)), 0xAB, dtype=torch.uint8)
    codes = codes.view(spec.code_dtype) if spec.code_dtype is not None else codes
    scale = torch.full((B, H, CAP, d // group), float("nan")).to(scale_dtype)
    zero = torch.full((B, H, CAP, d // group), float("nan")).to(scale_dtype) if spec.has_zero else None
    return (codes, scale, zero, fmt, group, "token", False)


def _src(fmt, d, group, seed):
    """A recent window's buffers holding CAP quantized tokens."""
    g = torch.Generator().manual_seed(seed)
    q = quantize(torch.randn(B, H, CAP, d, generator=g), fmt, group_size=group, scale_dtype=torch.float16)
    return (q.codes, q.scale, q.zero, fmt, group, "token")


def _clone(x):
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in x)


def _bytes(t):
    return None if t is None else t.contiguous().view(torch.uint8)


def _case(d, first_fmts, move_fmts, stats, rotation, scale_dtype, seed=0):
    """Tail, stats, first tier and move operands of one case, and the step's inputs."""
    g = torch.Generator().manual_seed(seed)
    tail = tuple(torch.randn(B, H, CAP, d, generator=g) * torch.linspace(0.2, 3, d) for _ in range(2))
    mean = torch.randn(B, H, 1, d, generator=g) if stats else None
    std = torch.rand(B, H, 1, d, generator=g) + 0.5 if stats == "mean+std" else None
    group = 32 if d % 32 == 0 else d
    first = tuple(_dst(f, d, group, scale_dtype) for f in first_fmts)
    move = None
    if move_fmts is not None:
        src = tuple(_src(f, d, d, seed + i) for i, f in enumerate(first_fmts))
        move = (src, tuple(_dst(f, d, group, scale_dtype) for f in move_fmts))
    k = torch.randn(B, H, 1, d, generator=g)
    v = torch.randn(B, H, 1, d, generator=g)
    return tail, (mean, std), first, move, k, v


def _copies(tail, first, move):
    t = _clone(tail)
    f = tuple(_clone(x) for x in first)
    m = None if move is None else (move[0], tuple(_clone(x) for x in move[1]))
    return t, f, m


CASES = [  # (first tier K / V, the main store K / V after a recent window or None)
    (("int4", "int4"), None),
    (("nuq4", "nuq4"), ("tcq2", "tcq2")),
    (("nuq4", "nuq4"), ("nuq2", "nuq2")),
    (("nuq4", "nuq4"), ("tcq3", "tcq2")),
    (("nuq3", "nuq2"), None),
    (("int8", "int4"), None),
    (("fp8_e4m3", "fp8_e4m3"), None),
    (("tcq2", "tcq2"), None),
]


@needs_c
@pytest.mark.parametrize("leaves", ["tail-row", "new-token"])
@pytest.mark.parametrize("stats", [None, "mean", "mean+std"])
@pytest.mark.parametrize("rotation", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize(
    "fmts", CASES, ids=lambda c: "-".join(c[0]) + ("" if c[1] is None else "->" + "-".join(c[1]))
)
def test_c_step_equals_the_torch_twin_bit_for_bit(fmts, rotation, stats, leaves):
    """``new-token``: a layer with no tail (``leave_row`` ``STEP_NEW_TOKEN``): the tail untouched,
    the first tier gets what a tail row holding the same token would have given it."""
    for d, scale_dtype in ((64, torch.float8_e4m3fn), (48, torch.float16)):
        tail, st, first, move, k, v = _case(d, *fmts, stats, rotation, scale_dtype)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)  # (values as a model hands them: strided)
        args = dict(tail_row=9, leave_row=2, first_index=5, move_from=-1 if move is None else 4, move_to=7)
        if leaves == "new-token":
            args.update(tail_row=-1, leave_row=ops.STEP_NEW_TOKEN)
        runs = []
        for cls in ("cpu", "reference"):
            t, f, m = _copies(tail, first, move)
            if cls == "cpu":
                run = ops.plan_append_step(t, st, rotation, f, m, head_dim=d)
                assert run is not None
                scratch = None
            else:
                twin = AppendStepRef(*t, *st, rotation, f, m, head_dim=d)
                run, scratch = twin, twin.scratch
            run(k, v, *args.values())
            runs.append((t, f, m))
        (t1, f1, m1), (t2, f2, m2) = runs
        for x, y in zip(t1, t2, strict=True):
            assert torch.equal(x, y)
        if leaves == "tail-row":
            assert torch.equal(t1[0][:, :, 9], k[:, :, 0]) and torch.equal(t1[1][:, :, 9], v[:, :, 0])
        else:
            assert all(torch.equal(x, y) for x, y in zip(t1, tail, strict=True))  # the tail untouched
            t3, f3, m3 = _copies(tail, first, move)  # the same token entering tail row 2, leaving it
            ops.plan_append_step(t3, st, rotation, f3, m3, head_dim=d)(k, v, 2, 2, 5, -1, -1)
            for a, b in zip(f1, f3, strict=True):
                assert all(
                    x is None or torch.equal(_bytes(x), _bytes(y)) for x, y in zip(a[:3], b[:3], strict=True)
                )
        written = [(a, b, orig, 5) for a, b, orig in zip(f1, f2, first, strict=True)]
        if move is not None:
            written += [(a, b, orig, 7) for a, b, orig in zip(m1[1], m2[1], move[1], strict=True)]
        for a, b, orig, row in written:
            for name, x, y, z in zip(("codes", "scale", "zero"), a[:3], b[:3], orig[:3], strict=True):
                assert (x is None) == (y is None)
                if x is None:
                    continue
                assert torch.equal(_bytes(x), _bytes(y)), (fmts, d, name)
                rest = [i for i in range(CAP) if i != row]  # the poison outside the written row is untouched
                assert torch.equal(_bytes(x[:, :, rest]), _bytes(z[:, :, rest])), (fmts, d, name)
                assert not torch.equal(_bytes(x[:, :, row]), _bytes(z[:, :, row])), (fmts, d, name)
        assert scratch is not None


@needs_c
def test_a_negative_row_skips_its_stage():
    tail, st, first, move, k, v = _case(64, ("nuq4", "nuq4"), ("tcq2", "tcq2"), "mean", True, torch.float16)
    t, f, m = _copies(tail, first, move)
    run = ops.plan_append_step(t, st, True, f, m, head_dim=64)
    run(k, v, 3, -1, 5, -1, 7)  # only the copy into the tail
    assert torch.equal(t[0][:, :, 3], k[:, :, 0])
    for a, orig in zip(f + m[1], first + move[1], strict=True):
        assert torch.equal(_bytes(a[0]), _bytes(orig[0]))
    t2, f2, m2 = _copies(tail, first, move)
    ops.plan_append_step(t2, st, True, f2, m2, head_dim=64)(k, v, 3, -1, 5, 4, 7)  # the move alone
    for a, orig in zip(f2, first, strict=True):
        assert torch.equal(_bytes(a[0]), _bytes(orig[0]))
    for a, orig in zip(m2[1], move[1], strict=True):
        assert not torch.equal(_bytes(a[0][:, :, 7]), _bytes(orig[0][:, :, 7]))


@needs_c
def test_refused_values_raise_the_ops_error():
    """A key no fp8 scale can hold: the C write refuses it, the step raises quantize_append's error."""
    tail, st, first, move, k, v = _case(64, ("int4", "int4"), None, None, False, torch.float8_e4m3fn)
    t, f, _ = _copies(tail, first, move)
    t[0][:, :, 2] = 1e30
    run = ops.plan_append_step(t, st, False, f, None, head_dim=64)
    with pytest.raises(ValueError) as got:
        run(k, v, 9, 2, 5, -1, -1)
    with pytest.raises(ValueError) as want:
        ops.quantize_append(t[0][:, :, 2:3], *f[0][:3], 5, fmt="int4", group_size=32, backend="reference")
    assert str(got.value) == str(want.value)


@needs_c
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_states_are_refused_before_anything_is_written(bad):
    """A NaN or Inf in the new key or value: the C step and its twin return 5 with every buffer
    untouched, and the planned op raises the cache's own error."""
    tail, st, first, move, k, v = _case(64, ("nuq4", "nuq4"), ("tcq2", "tcq2"), "mean", True, torch.float16)
    for bad_arg in (0, 1):
        kk, vv = k.clone(), v.clone()
        (kk, vv)[bad_arg][1, 2, 0, 17] = bad
        for which in ("cpu", "reference"):
            t, f, m = _copies(tail, first, move)
            if which == "cpu":
                with pytest.raises(ValueError, match="NaN or Inf"):
                    ops.plan_append_step(t, st, True, f, m, head_dim=64)(kk, vv, 9, 2, 5, 4, 7)
                from kvquant.kernels.cpu.step import NativeAppendStep

                t, f, m = _copies(tail, first, move)
                rc = NativeAppendStep(*t, *st, True, f, m, head_dim=64)(kk, vv, 9, 2, 5, 4, 7)
            else:
                rc = AppendStepRef(*t, *st, True, f, m, head_dim=64)(kk, vv, 9, 2, 5, 4, 7)
            assert rc == 5
            for a, b in zip(t, tail, strict=True):
                assert torch.equal(a, b)
            for a, orig in zip(f + m[1], first + move[1], strict=True):
                for x1, x2 in zip(a[:3], orig[:3], strict=True):
                    assert x1 is None or torch.equal(_bytes(x1), _bytes(x2))


@needs_c
def test_what_no_backend_plans_gets_none():
    tail, st, first, move, *_ = _case(64, ("int4", "int4"), None, "mean", True, torch.float16)
    bf16 = tuple(t.to(torch.bfloat16) for t in tail)
    assert ops.plan_append_step(bf16, st, True, first, None, head_dim=64) is None  # fp32 rows only
    channel = (first[0][:5] + ("channel", False), first[1])
    assert ops.plan_append_step(tail, st, True, channel, None, head_dim=64) is None
    assert ops.plan_append_step(tail, st, True, first, None, head_dim=64, backend="reference") is None
