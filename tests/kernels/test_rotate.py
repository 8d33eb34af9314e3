"""``ops.rotate``: the Hadamard rotation of the key transform, on every backend.

- the C kernel equals the reference's fast transform bit for bit (same passes, same order), on odd
  row counts, strided and batched inputs, every power-of-two head size up to 512 and the
  non-power-of-two ones of real models (block-diagonal: blocks of the largest power of two dividing D);
- the torch backend (one product with the cached matrix for few rows) equals it to fp32 rounding;
- it is the matrix it claims (``x @ H``, ``H`` orthogonal and symmetric), its own inverse;
- bad input gets one clear error; a CPU call takes the C kernel where it is built.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvquant.kernels import ops
from kvquant.kernels.cpu import native_available
from kvquant.kernels.hadamard import hadamard_matrix, rotate_ref

HAS_C = native_available()
needs_c = pytest.mark.skipif(not HAS_C, reason="C kernels not built")


@needs_c
@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 24, 80, 96, 112, 160, 192, 6])
@pytest.mark.parametrize("rows", [1, 3, 7, 133, 4099])
def test_c_equals_the_reference_bit_for_bit(d, rows):
    g = torch.Generator().manual_seed(d * 7919 + rows)
    x = torch.randn(rows, d, generator=g) * torch.logspace(-3, 3, rows)[:, None]  # rows of every size
    before = x.clone()
    got = ops.rotate(x, backend="cpu")
    assert torch.equal(got, rotate_ref(x))
    assert got.data_ptr() != x.data_ptr() and torch.equal(x, before)  # a new tensor; x untouched


@needs_c
def test_c_reads_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 3, 5, 128, generator=g)
    for x in (wide[..., :64], wide[..., 64:], wide.transpose(1, 2)[..., :32], wide[:, :, ::2], wide[0, 0, 0]):
        assert torch.equal(ops.rotate(x, backend="cpu"), rotate_ref(x.contiguous()))
    assert torch.equal(ops.rotate(x.expand(4, 128), backend="cpu"), rotate_ref(x.expand(4, 128).contiguous()))


@needs_c
def test_c_keeps_nan_and_inf_where_the_reference_does():
    x = torch.randn(4, 64)
    x[1, 5], x[2, 0], x[3, 63] = float("nan"), float("inf"), -float("inf")
    got, want = ops.rotate(x, backend="cpu"), rotate_ref(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0, 1.0, -1.0), want.nan_to_num(0.0, 1.0, -1.0))


@pytest.mark.parametrize("backend", ["chunked", "reference", *(["cpu"] if HAS_C else [])])
@pytest.mark.parametrize("rows", [1, 9, 4096])
@pytest.mark.parametrize("d, n", [(64, 64), (96, 32), (80, 16)])
def test_every_backend_is_the_hadamard_matrix(backend, rows, d, n):
    x = torch.randn(rows, d, dtype=torch.float64).float()
    h = hadamard_matrix(d).double()
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12)
    block = torch.arange(d)[:, None] // n == torch.arange(d)[None, :] // n  # n x n blocks on the diagonal
    assert torch.equal(h.abs(), torch.where(block, 1 / math.sqrt(n), 0.0).double())
    got = ops.rotate(x, backend=backend)
    want = x.double() @ h
    # each output is a sum of n terms |x_i| / sqrt(n): fp32 summation in any order errs by at most
    # n * u * sum |x_i| / sqrt(n) (u = 2**-24; the butterflies' log2(n) passes stay well inside it)
    bound = n * 2**-24 * x.abs().sum(-1, keepdim=True) / math.sqrt(n)
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.allclose(ops.rotate(got, backend=backend), x, atol=1e-5)


def test_bad_input_gets_one_clear_error():
    with pytest.raises(ValueError, match="an even head_dim, got 95"):
        ops.rotate(torch.zeros(2, 95))
    with pytest.raises(ValueError, match="an even head_dim, got 0"):
        ops.rotate(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="x: rotate takes float32, got torch.float16"):
        ops.rotate(torch.zeros(2, 64, dtype=torch.float16))


def test_a_cpu_call_takes_the_c_kernel_where_built():
    assert ops.backend_for("rotate", head_dim=64) == ("cpu" if HAS_C else "chunked")
    assert ops.backend_for("rotate", head_dim=64, device="meta") == "reference"
    assert ops.backend_for("rotate", head_dim=128, device="cuda") == "chunked"


@pytest.mark.parametrize("backend", ["chunked", "reference", *(["cpu"] if HAS_C else [])])
@pytest.mark.parametrize("d", [64, 96, 24])
def test_rotate_pair_is_the_smoothing_then_one_rotation_of_the_pair(backend, d):
    """``rotate_pair``: the key transform of keys and values in one call equals the torch ops and
    ``rotate`` of the stacked pair on the same backend, bit for bit (the C call too), also on strided
    views (a tail buffer's rows), with and without the smoothing statistics; bad input: one error."""
    torch.manual_seed(d)
    buf = torch.randn(2, 3, 9, d) * 3
    k, v = buf[:, :, 2:5], torch.randn(2, 3, 9, d)[:, :, 4:7]  # [2, 3, 3, d] views
    mean, std = torch.randn(2, 3, 1, d), torch.rand(2, 3, 1, d) + 0.5
    for m, s in ((mean, std), (mean, None), (None, None)):
        want_k = k if m is None else (k - m if s is None else (k - m) / s)
        want = ops.rotate(torch.stack((want_k, v)), backend=backend)
        got_k, got_v = ops.rotate_pair(k, v, mean=m, std=s, backend=backend)
        assert torch.equal(got_k, want[0]) and torch.equal(got_v, want[1])
    with pytest.raises(ValueError, match="rotate_pair takes float32"):
        ops.rotate_pair(k, v.half(), backend=backend)
