"""The C kernels on the formats they gained for issue 13: trellis decode (tcq2 / tcq3, alone and
mixed with the other formats), codebook and fp8 quantize-and-append. Each against its torch twin
(``decode_attention_torch``, :func:`kvquant.formats.quantize`) on odd shapes, outputs poisoned with
NaN before the call; and through :mod:`kvquant.kernels.ops`, which now names ``cpu`` for them."""

import os
import shutil

import pytest
import torch

import kvquant.kernels.cpu as native
import kvquant.kernels.cpu.build as build
from kvquant.formats import quantize
from kvquant.kernels import ops
from kvquant.kernels.chunked import decode_attention_torch
from kvquant.kernels.reference import dense_decode_attention_ref, merge_attention

pytestmark = pytest.mark.skipif(not native.native_available(), reason="no C compiler: torch path only")


def _store(fmt, x, group, scale_dtype=torch.float16):
    block = quantize(x, fmt, group_size=group, scale_dtype=scale_dtype)
    return block.codes, block.scale, block.zero


def _close(got, ref):
    """Same values up to fp32 summation order and the kernel's exp (relative error < 2e-7): the
    bound the integer formats are held to (test_cpu.py)."""
    (go, gl), (ro, rl) = got, ref
    assert not torch.isnan(go).any() and not torch.isnan(gl).any()
    scale = ro.abs().max().clamp_min(1e-6)
    assert ((go - ro).abs().max() / scale).item() <= 2e-5
    finite = torch.isfinite(rl)
    assert torch.equal(finite, torch.isfinite(gl))
    assert (gl[finite] - rl[finite]).abs().max().item() <= 2e-5 * max(1.0, rl[finite].abs().max().item())


def _decode(k_fmt, v_fmt, *, d, t=77, b=2, hkv=3, g=3, k_group=None, v_group=None, scale_dtype=torch.float16,
            n_fp=0, seed=0, threads=None):  # fmt: skip
    """Native decode of a random store against the torch twin (merged with the fp tokens)."""
    torch.manual_seed(seed)
    k, v = torch.randn(b, hkv, t, d) * 1.5 + 0.2, torch.randn(b, hkv, t, d)
    q = torch.randn(b, hkv * g, d)
    k_group, v_group = k_group or d, v_group or d
    kp, vp = _store(k_fmt, k, k_group, scale_dtype), _store(v_fmt, v, v_group, scale_dtype)
    start = torch.tensor([0, 19, 5, t][:b])  # rows start at different buffer indices
    args = dict(k_fmt=k_fmt, v_fmt=v_fmt, k_group=k_group, v_group=v_group, k_axis="token", start=start, end=t, scaling=d**-0.5)  # fmt: skip
    ref = decode_attention_torch(q, *kp, *vp, **args)
    fp = {}
    if n_fp:
        fk, fv = torch.randn(b, hkv, n_fp, d), torch.randn(b, hkv, n_fp, d)
        valid = torch.rand(b, n_fp) > 0.3
        valid[:, -1] = True
        dense = dense_decode_attention_ref(q, fk, fv, valid, args["scaling"])
        ref = merge_attention([ref[0], dense[0]], [ref[1], dense[1]])
        fp = dict(fp_k=fk, fp_v=fv, fp_valid=valid)
    out = torch.full((b, hkv * g, d), float("nan"))  # poisoned: an unwritten element fails
    lse = torch.full((b, hkv * g), float("nan"))
    got = native.decode_attention_native(q, *kp, *vp, **args, **fp, threads=threads, out=out, lse=lse)
    assert got[0].data_ptr() == out.data_ptr()
    _close(got, ref)
    return (q, *kp, *vp), args, fp, ref


# ------------------------------------------------------------------------------------ trellis decode


@pytest.mark.parametrize("fmt", ["tcq2", "tcq3"])
@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_trellis_decode_matches_the_torch_twin(fmt, d):
    _decode(fmt, fmt, d=d, seed=d)
    _decode(fmt, fmt, d=d, k_group=d // 2, v_group=16, seed=d + 1)  # several scales per head


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt"),
    [
        ("tcq3", "tcq2"),
        ("tcq2", "nuq4"),
        ("nuq3", "tcq3"),
        ("int4", "tcq2"),
        ("tcq3", "fp8_e4m3"),
        ("tcq2", "int8"),
    ],
)
def test_trellis_mixed_with_every_family(k_fmt, v_fmt):
    _decode(k_fmt, v_fmt, d=64, k_group=32, seed=3)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_trellis_scales_in_their_stored_dtype(scale_dtype):
    _decode("tcq3", "tcq2", d=64, v_group=32, scale_dtype=scale_dtype, seed=4)


def test_trellis_with_full_precision_tokens_and_threads():
    _decode("tcq3", "tcq2", d=64, n_fp=5, seed=5)
    _decode("tcq2", "tcq3", d=128, t=1031, threads=3, n_fp=2, seed=6)  # split-KV, merged in C


@pytest.mark.parametrize("fmt", ["tcq2", "tcq3"])
def test_trellis_heads_not_a_multiple_of_16_take_the_portable_loop(fmt):
    _decode(fmt, fmt, d=24, g=2, seed=7)  # (D % 16: the row-by-row path on every CPU)
    _decode(fmt, "int4", d=8, g=1, t=5, seed=8)  # a head of little more than one state


@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx512vbmi"])
def test_the_builds_for_other_cpus_read_trellis_codes_too(flag, monkeypatch, tmp_path):
    """The kernel built without AVX-512 (the portable loops) or without its byte permutes (codes
    unpacked to bytes first): same results."""
    monkeypatch.setenv("KVQUANT_CACHE", str(tmp_path))
    cc = shutil.which(os.environ.get("CC", "cc"))
    lib = build._load(build._build(cc, (*build.CFLAGS, flag)))
    monkeypatch.setitem(build._state, "lib", lib)
    _decode("tcq3", "tcq2", d=64, v_group=32, n_fp=3, seed=9)
    _decode("tcq2", "nuq4", d=96, scale_dtype=torch.float8_e4m3fn, seed=10)
    _decode("tcq3", "tcq3", d=32, seed=12)


def test_ops_dispatch_names_cpu_for_trellis_decode():
    for fmt in ("tcq2", "tcq3"):
        assert ops.backend_for("decode_attention", fmt=fmt, head_dim=64) == "cpu"
        assert (
            ops.backend_for("decode_attention", k_fmt=fmt, v_fmt="nuq4", head_dim=96, fp_tokens=True) == "cpu"
        )
    assert ops.backend_for("decode_attention", fmt="tcq2", head_dim=1024) == "chunked"  # C: up to 512
    tensors, args, fp, ref = _decode("tcq3", "tcq2", d=64, n_fp=4, seed=11)
    _close(ops.decode_attention(*tensors, **args, **fp), ref)
    _close(ops.decode_attention(*tensors, **args, **fp, backend="cpu"), ref)


@pytest.mark.parametrize("d", [256, 512])
def test_trellis_decode_on_wide_heads(d):
    _decode("tcq2", "tcq3", d=d, t=21, hkv=1, g=3, v_group=64, seed=d)  # 512: codes unpacked to bytes first
