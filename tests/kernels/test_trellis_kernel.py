"""The Triton Viterbi kernel (``kernels/triton/trellis.py``) against the torch search.

Under the interpreter the kernel does the torch search's fp32 operations in the same order, so the
codes are the same, bit for bit (short heads: every history; from 64 channels on: the two passes).
The squared error is compared too (the quantity the search minimizes), and on the GPU, where the
arithmetic may round differently, only the error is held equal. Interpreter-sized: a few vectors.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import format_spec, quantize
from kvquant.formats.trellis import trellis_decode, trellis_encode_torch, trellis_table
from kvquant.kernels import ops

pytest.importorskip("triton")
from kvquant.kernels.triton import trellis as tk  # noqa: E402 - needs triton


def _err(codes, y, bits):
    return (trellis_decode(codes, bits) - y.float()).square().sum(-1)  # [N]


@pytest.mark.parametrize(
    ("bits", "d", "n"), [(2, 8, 3), (3, 8, 2), (1, 16, 2), (2, 64, 3), (3, 128, 2), (1, 64, 2)]
)
def test_codes_equal_the_torch_search(bits, d, n, device):
    torch.manual_seed(bits * d)
    y = torch.randn(n, d, device=device) * 1.3
    got = tk.trellis_encode_triton(y, bits)
    want = trellis_encode_torch(y, bits, trellis_table(bits, y.device))
    assert got.dtype == torch.uint8 and got.shape == (n, d)
    assert torch.equal(_err(got, y, bits), _err(want, y, bits))
    if not y.is_cuda:
        assert torch.equal(got, want)


def test_chunks_and_the_ops_backend(device, monkeypatch):
    """Vectors searched in several chunks (a small scratch budget) give the same codes; ``ops.encode``
    with the Triton backend runs this search."""
    torch.manual_seed(5)
    y = torch.randn(5, 64, device=device)
    monkeypatch.setattr(tk, "SCRATCH_BYTES", 2 * 64 * 63 * 2)  # two vectors per chunk
    chunked = tk.trellis_encode_triton(y, 2)
    monkeypatch.undo()
    assert torch.equal(chunked, ops.encode(y, "tcq2", backend="triton"))
    assert torch.equal(_err(chunked, y, 2), _err(ops.encode(y, "tcq2", backend="reference"), y, 2))


def test_quantize_append_writes_the_spec_codes_and_scales(device):
    """tcq on the Triton backend: the spec's scales (8-bit, per 16 channels) around the kernel's codes."""
    torch.manual_seed(9)
    x = torch.randn(2, 1, 3, 64, device=device)
    x[0, 0, 0] = 0.0
    spec = format_spec("tcq2")
    codes = torch.full((2, 1, 6, spec.code_width(64)), 0xA5, dtype=torch.uint8, device=device)
    scale = torch.full((2, 1, 6, 4), float("nan"), device=device).to(torch.float8_e4m3fn)
    ops.quantize_append(x, codes, scale, None, 2, fmt="tcq2", group_size=16, backend="triton")
    want = quantize(x, "tcq2", group_size=16, scale_dtype=torch.float8_e4m3fn)
    assert torch.equal(codes[:, :, 2:5], want.codes) and (codes[:, :, :2] == 0xA5).all()
    assert torch.equal(scale[:, :, 2:5].view(torch.uint8), want.scale.view(torch.uint8))
    assert scale[:, :, 5:].float().isnan().all()


def test_the_backend_says_what_it_searches():
    assert ops.backend_for("encode", fmt="tcq3", head_dim=128, device="cuda") == "triton"
    assert ops.backend_for("quantize_append", fmt="tcq2", head_dim=128, device="cuda") == "triton"
    assert ops.backend_for("encode", fmt="nuq2", head_dim=128, device="cuda") == "reference"
    assert ops.backend_for("encode", fmt="tcq2", head_dim=2, device="cuda") == "reference"  # < one state


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("d", [32, 128])
def test_gpu_equal_error(bits, d):
    torch.manual_seed(d)
    y = torch.randn(4096 if d >= 64 else 512, d, device="cuda")
    got = tk.trellis_encode_triton(y, bits)
    want = trellis_encode_torch(y, bits, trellis_table(bits, y.device))
    torch.testing.assert_close(_err(got, y, bits), _err(want, y, bits), rtol=1e-6, atol=1e-6)
    assert (got == want).float().mean() > 0.999
