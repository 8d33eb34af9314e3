"""``kvquant.tools.sweep_kernels``: each launch config is run, checked against the fp32 reference and
timed; a config whose output is wrong is marked (interpreter-sized on CPU, a stand-in timer)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def _sweep(monkeypatch, corrupt=None):
    from kvquant.kernels.triton import decode_attention
    from kvquant.tools.sweep_kernels import sweep_shape, to_markdown

    real = decode_attention.quantized_decode_attention

    def kernel(*args, **kw):  # the real kernel; the config with block_t == corrupt writes a wrong output
        out, lse = real(*args, **kw)
        if corrupt is not None and kw.get("block_t") == corrupt:
            out[0, 0] += 1.0
        return out, lse

    monkeypatch.setattr(decode_attention, "quantized_decode_attention", kernel)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = {"default": {}, "bt32-w4": {"block_t": 32, "num_warps": 4}}
    rows = sweep_shape(
        1, 70, 4, 2, 32, ["int4", "nuq4"], configs, timer=lambda fn: (fn(), 0.5)[1], device=device
    )
    return rows, to_markdown(rows, dict(device=device, hq=4, hkv=2, d=32))


def test_every_config_is_checked_and_timed(monkeypatch):
    rows, md = _sweep(monkeypatch)
    ours = [r for r in rows if r["config"] != "sdpa"]
    assert [(r["fmt"], r["config"]) for r in ours] == [
        ("int4", "default"), ("int4", "bt32-w4"), ("nuq4", "default"), ("nuq4", "bt32-w4")
    ]  # fmt: skip
    assert all(r["ok"] and r["sqnr_db"] >= 80 and r["us"] == 500.0 for r in ours)
    assert "WRONG" not in md and md.count("| yes |") == 4


def test_a_wrong_config_is_marked(monkeypatch):
    rows, md = _sweep(monkeypatch, corrupt=32)
    bad = {(r["fmt"], r["config"]) for r in rows if r.get("ok") is False}
    assert bad == {("int4", "bt32-w4"), ("nuq4", "bt32-w4")}
    assert md.count("WRONG") == 2
