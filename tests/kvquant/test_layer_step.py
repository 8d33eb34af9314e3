"""A layer's steady decode steps take one planned op (``ops.plan_append_step``, one C call on CPU)
and leave the state the general append leaves: every buffer bit for bit, every counter, the
history read back, over presets with a recent window, sinks, left padding, head groups, a sliding
window, small capacities that make the tiers grow and move, and crops and beam reorders between
steps. A decode step's view reads the sinks' and the tail's rows in place, and the step's append
leaves them as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvquant import KVQuantConfig
from kvquant.cache.factory import make_layer
from kvquant.kernels.cpu import native_available

needs_c = pytest.mark.skipif(not native_available(), reason="C kernels not built")

B, H, D = 2, 3, 64

CONFIGS = {
    "int4": KVQuantConfig.resolve("int4"),
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
    "fp8-plain": KVQuantConfig(key_format="fp8_e4m3", value_format="fp8_e4m3", residual_length=2),
    "int8": KVQuantConfig.resolve("int8"),  # (no tail: the new token itself is stored)
    "head-groups": KVQuantConfig(
        key_format="nuq2",
        value_format="nuq2",
        rotation="hadamard",
        residual_length=4,
        recent_length=6,
        recent_key_format="nuq4",
        recent_value_format="nuq4",
        heads={1: {"key_format": "nuq4", "value_format": "nuq4"}},
    ),  # fmt: skip
}


CONFIGS["no-tail-recent"] = dataclasses.replace(CONFIGS["small-recent"], residual_length=0)  # (sinks kept)

SEGMENT_CONFIGS = {
    **{name: CONFIGS[name] for name in ("int4", "tcq2-recent", "small-recent", "int8", "no-tail-recent")},
    "kivi2": KVQuantConfig.resolve("kivi2"),  # (keys per channel: the tail leaves in blocks)
}


def _layers(cfg, sliding):
    return [make_layer(cfg, sliding, kv_heads=H, initial_capacity=4) for _ in range(2)]


def _state(layer):
    """Every buffer (as bytes) and counter of a layer's leaves."""
    out = []
    for leaf in layer.leaves():
        out += [leaf.seq_len, leaf.tail.begin, leaf.tail.end, leaf.tail.off, leaf.tail.k, leaf.tail.v]
        for tier in leaf.tiers:
            out += [tier.begin, tier.end, tier.origin, tier.low]
            out += [t for s in tier.stores for t in s.buffers() if t is not None]
        if leaf.sinks is not None and leaf.sinks.held:
            out += [leaf.sinks.k, leaf.sinks.v]
    return [x.contiguous().view(torch.uint8) if isinstance(x, torch.Tensor) else x for x in out]


def _same_state(sa, sb):
    return len(sa) == len(sb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(sa, sb, strict=True)
    )


def _same(a, b):
    return _same_state(_state(a), _state(b))


@needs_c
@pytest.mark.parametrize("sliding", [None, 20], ids=["full", "sliding"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_planned_steps_leave_the_general_state(name, sliding):
    planned, general = _layers(CONFIGS[name], sliding)
    for leaf in general.leaves():
        leaf._append_step = lambda k, v: False  # (this one always takes the general append)
    taken = []
    for leaf in planned.leaves():
        step = leaf._append_step
        leaf._append_step = lambda k, v, step=step: taken.append(step(k, v)) or taken[-1]
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(30).expand(B, 30) - torch.tensor([[0], [5]])  # row 1: 5 tokens of left padding
    k, v = torch.randn(B, H, 30, D, generator=g), torch.randn(B, H, 30, D, generator=g)
    for layer in (planned, general):
        layer.update(k, v, kwargs={"position_ids": pos.clamp(min=0)})
    for step in range(70):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        for layer in (planned, general):
            got = layer.update(k, v)
            if step == 25 and sliding is None:
                layer.crop(-3)
            if step == 40:
                layer.reorder_cache(torch.tensor([1, 0]))
        assert _same(planned, general), step
    for x, y in zip(planned.read_history(), general.read_history(), strict=True):
        assert torch.equal(x, y)
    assert got[0].shape[2] > 1
    assert sum(taken) >= 40 * len(planned.leaves()), (sum(taken), len(taken))  # most steps took it
    assert not all(taken)  # and the steps that move or grow did not


@needs_c
def test_what_the_step_does_not_take_goes_the_general_way():
    """bf16 rows and channel-axis keys: no plan, every step appends the general way."""
    for cfg, dtype in (
        (KVQuantConfig.resolve("int4"), torch.bfloat16),
        (KVQuantConfig.resolve("kivi4"), torch.float32),
    ):
        layer = make_layer(cfg, None, kv_heads=H)
        layer.update(torch.randn(1, H, 40, D, dtype=dtype), torch.randn(1, H, 40, D, dtype=dtype))
        for _ in range(5):
            k = torch.randn(1, H, 1, D, dtype=dtype)
            assert not layer._append_step(k, k.clone())
            layer.update(k, k.clone())
        assert layer.get_seq_length() == 45


@needs_c
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
@pytest.mark.parametrize("name", ["int4", "tcq2-recent", "int8"])
def test_a_planned_step_refuses_non_finite_states_before_storing(name, bad):
    """A decode step's values are checked by the planned step itself (``update`` leaves it to the
    append): non-finite keys or values raise the cache's own error, and every buffer and counter is
    as it was; the next step is planned again."""
    layer = make_layer(CONFIGS[name], None, kv_heads=H)
    g = torch.Generator().manual_seed(3)
    layer.update(torch.randn(B, H, 40, D, generator=g), torch.randn(B, H, 40, D, generator=g))
    for _ in range(3):
        layer.update(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))
    taken = []
    for leaf in layer.leaves():
        step = leaf._append_step
        leaf._append_step = lambda k, v, step=step: taken.append(step(k, v)) or taken[-1]
    before = _state(layer)
    for which in (0, 1):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        (k, v)[which][1, 2, 0, 5] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            layer.update(k, v)
        assert _same_state(before, _state(layer))
    assert not taken  # (the step raised: it returned nothing)
    layer.update(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))
    assert taken and all(taken) and layer.get_seq_length() == 44


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding", [None, 24], ids=["full", "sliding"])
@pytest.mark.parametrize("name", list(SEGMENT_CONFIGS))
def test_a_decode_views_segments_survive_its_append(name, sliding, dtype):
    """A decode step's view hands the attention the sinks' and the tail's own rows as segments, not a
    copy: the step's append must leave them as they were (checked after every step against a copy
    taken before the append), also where no tail exists, tokens leave the tail in blocks, sinks are
    still being captured behind left padding, rows are bf16, and buffers grow and move."""
    layer = make_layer(SEGMENT_CONFIGS[name], sliding, kv_heads=H, initial_capacity=4)
    assert layer.leaves() == [layer]
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(10).expand(2, 10) - torch.tensor([[0], [9]])  # row 1: 9 of 10 tokens padding
    k, v = torch.randn(2, H, 10, D, generator=g), torch.randn(2, H, 10, D, generator=g)
    layer.update(k.to(dtype), v.to(dtype), kwargs={"position_ids": pos.clamp(min=0)})
    in_place = 0
    for step in range(90):
        k = torch.randn(2, H, 1, D, generator=g).to(dtype)
        v = torch.randn(2, H, 1, D, generator=g).to(dtype)
        view = layer.view(k, v)  # (one group of heads: the layer is its own leaf)
        before = [x.clone() for x in (*view.fp_parts_k, *view.fp_parts_v)]
        layer.append(k, v)
        after = (*view.fp_parts_k, *view.fp_parts_v)
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)), step
        assert view.fp_k.shape[2] - view.n_sinks == view.shape[2] - sum(r.p1 - r.p0 for r in view.reads)
        in_place += view.fp_parts_k[-1] is k and len(view.fp_parts_k) > 1
        if step == 30 and sliding is None:
            layer.crop(-4)
        if step == 50:
            layer.reorder_cache(torch.tensor([1, 0]))
    assert in_place >= 80  # most steps handed the rows over in place (the rest: sinks still captured)
