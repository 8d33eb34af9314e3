"""``kernel_stores.tiled_store``: the tiled stores the GPU kernel benchmark reads cover the whole context,
on the token and on the channel axis (one scale row per block of tokens there)."""

from __future__ import annotations

import pytest
import torch

from kvquant.kernels import quantized_decode_attention_ref
from kvquant.tools.kernel_stores import QUANTIZE_TOKENS
from kvquant.tools.kernel_stores import tiled_store as _store


@pytest.mark.parametrize(
    ("fmt", "group", "axis"), [("int4", 32, "channel"), ("int4", 64, "token"), ("nuq4", 64, "token")]
)
def test_store_covers_the_context(fmt, group, axis):
    t = QUANTIZE_TOKENS + 128  # past the quantized tokens: tiled
    x = torch.randn(1, 2, t, 64)
    codes, scale, _ = _store(x, fmt, group, axis)
    assert codes.shape[2] == t
    assert scale.shape[2] == (-(-t // group) if axis == "channel" else t)
    q = torch.randn(1, 4, 64)
    kw = dict(k_fmt=fmt, v_fmt="none", k_group=group, v_group=None, k_axis=axis,
              start=torch.zeros(1, dtype=torch.long), end=t, scaling=0.125)  # fmt: skip
    out, lse = quantized_decode_attention_ref(q, codes, scale, _, x, None, None, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
