"""The Triton Viterbi kernel (``kernels/triton/trellis.py``) against the torch search.

Under the interpreter the kernel does the torch search's fp32 operations in the same order, so the
codes are the same, bit for bit (short heads: every history; from 64 channels on: the two passes).
The squared error is compared too (the quantity the search minimizes), and on the GPU, where the
arithmetic may round differently, only the error is held equal. Interpreter-sized: a few vectors.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.formats import QuantizedBlock, dequantize, format_spec, quantize
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


@pytest.mark.parametrize("fmt", ["tcq1", "tcq2", "tcq3"])
@pytest.mark.parametrize(
    ("d", "group", "scale_dtype"),
    [
        (64, 64, torch.float16),
        (64, 32, torch.float8_e4m3fn),
        (128, 64, torch.bfloat16),
        (32, 16, torch.float32),
    ],
    ids=str,
)
def test_the_fused_write_equals_the_spec_bit_for_bit(fmt, d, group, scale_dtype, monkeypatch):
    """The fused write (scale kernel, Viterbi, store kernel: no torch scales, no host sync) gives the
    codes and scales of ``formats.quantize``: odd magnitudes per vector, an all-zero vector, a
    vector with one large channel; nothing outside the written rows changes. fp32 scales keep the
    last bit of a group's RMS, which the kernel sums in another order: the same squared error there
    (to fp32 rounding), as for the codebook kernel."""
    from kvquant.kernels.triton import trellis_write

    calls = []
    fused = trellis_write.trellis_append
    monkeypatch.setattr(trellis_write, "trellis_append", lambda *a, **k: calls.append(1) or fused(*a, **k))
    g = torch.Generator().manual_seed(d + group)
    x = torch.randn(2, 2, 3, d, generator=g) * torch.tensor([0.01, 1.0, 20.0])[None, None, :, None]
    x[0, 1, 0] = 0.0
    x[1, 0, 2, 5] = 10.0 * x[1, 0, 2].abs().max()  # (its group's scale still within fp8's 448)
    spec = format_spec(fmt)
    codes = torch.full((2, 2, 7, spec.code_width(d)), 0xA5, dtype=torch.uint8)
    scale = torch.full((2, 2, 7, d // group), float("nan")).to(scale_dtype)
    ops.quantize_append(x, codes, scale, None, 3, fmt=fmt, group_size=group, backend="triton")
    assert calls, "the fused write did not run"
    want = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    if scale_dtype == torch.float32:
        got = QuantizedBlock(codes[:, :, 3:6], scale[:, :, 3:6], None)
        err, want_err = (
            (dequantize(q, fmt, head_dim=d, group_size=group) - x).square().sum() for q in (got, want)
        )
        torch.testing.assert_close(err, want_err, rtol=1e-5, atol=0)
    else:
        assert torch.equal(codes[:, :, 3:6], want.codes)
        assert torch.equal(scale[:, :, 3:6].view(torch.uint8), want.scale.view(torch.uint8))
    assert (codes[:, :, :3] == 0xA5).all() and (codes[:, :, 6:] == 0xA5).all()
    assert scale[:, :, :3].float().isnan().all() and scale[:, :, 6:].float().isnan().all()


@pytest.mark.parametrize(("bad", "error"), [(float("nan"), "input: key/value"), (1e6, "scale_dtype")])
def test_the_fused_write_flags_what_the_spec_refuses(bad, error):
    x = torch.randn(1, 2, 2, 64)
    x[0, 1, 1, 3] = bad  # 1e6: an RMS fp16 scales cannot hold
    codes = torch.zeros(1, 2, 4, format_spec("tcq2").code_width(64), dtype=torch.uint8)
    scale = torch.zeros(1, 2, 4, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match=error):
        ops.quantize_append(x, codes, scale, None, 0, fmt="tcq2", group_size=64, backend="triton")


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
