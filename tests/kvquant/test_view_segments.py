"""A decode step's :class:`~kvquant.cache.view.KVView` hands the sinks' and the tail's own rows to the
attention as segments, without copying them: the step's append must leave them as they were. Checked
after every step against a copy taken before the append, over presets with a tail, none, channel-axis
keys (tokens leave in blocks), sinks still being captured (left padding), a recent window, bf16 rows,
a sliding window, small capacities that make the buffers grow and move, and a crop and a beam reorder
in between."""

from __future__ import annotations

import pytest
import torch

from kvquant import KVQuantConfig
from kvquant.cache.factory import make_layer

H, D = 3, 64

CONFIGS = {
    "int4": KVQuantConfig.resolve("int4"),
    "int8": KVQuantConfig.resolve("int8"),  # (no tail)
    "kivi2": KVQuantConfig.resolve("kivi2"),  # (keys per channel: the tail leaves in blocks)
    "tcq2-recent": KVQuantConfig.resolve("tcq2-recent"),
    "small-recent": KVQuantConfig(
        key_format="nuq3",
        value_format="nuq2",
        rotation="hadamard",
        smoothing="mean",
        residual_length=3,
        sink_tokens=2,
        recent_length=5,
        recent_key_format="int8",
        recent_value_format="int8",
    ),  # fmt: skip
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding", [None, 24], ids=["full", "sliding"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_decode_views_segments_survive_its_append(name, sliding, dtype):
    layer = make_layer(CONFIGS[name], sliding, kv_heads=H, initial_capacity=4)
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(10).expand(2, 10) - torch.tensor([[0], [9]])  # row 1: 9 of 10 tokens padding
    k, v = torch.randn(2, H, 10, D, generator=g), torch.randn(2, H, 10, D, generator=g)
    layer.update(k.to(dtype), v.to(dtype), kwargs={"position_ids": pos.clamp(min=0)})
    in_place = 0
    for step in range(90):
        k = torch.randn(2, H, 1, D, generator=g).to(dtype)
        v = torch.randn(2, H, 1, D, generator=g).to(dtype)
        for leaf in layer.leaves():
            h = slice(0, H) if len(layer.leaves()) == 1 else None
            kk, vv = (k, v) if h is not None else (k[:, : leaf.kv_heads], v[:, : leaf.kv_heads])
            view = leaf.view(kk, vv)
            before = [x.clone() for x in (*view.fp_parts_k, *view.fp_parts_v)]
            leaf.append(kk, vv)
            after = (*view.fp_parts_k, *view.fp_parts_v)
            assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)), step
            assert view.fp_k.shape[2] - view.n_sinks == view.shape[2] - sum(r.p1 - r.p0 for r in view.reads)
            in_place += view.fp_parts_k[-1] is kk and len(view.fp_parts_k) > 1
            break  # (one leaf is enough: every leaf is a QuantizedKVLayer)
        if len(layer.leaves()) > 1:  # keep the other leaves in step
            for leaf in layer.leaves()[1:]:
                leaf.append(k[:, : leaf.kv_heads], v[:, : leaf.kv_heads])
        if step == 30 and sliding is None:
            layer.crop(-4)
        if step == 50:
            layer.reorder_cache(torch.tensor([1, 0]))
    assert in_place >= 80  # most steps handed the rows over in place (the rest: sinks still captured)
