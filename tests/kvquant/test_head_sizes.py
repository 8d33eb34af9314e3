"""Every shipped preset on the head sizes of real models (64, 80, 96, 112, 128, 256).

- channel groups that do not divide the head become the largest divisor below them (a multiple of 8
  where one exists), so ``int4`` (group 64) runs on Phi-3 (96), Phi-2 (80), StableLM-3B (112);
- the Hadamard rotation is block-diagonal in the largest power of two dividing the head (32 for 96,
  16 for 80 and 112): every rotation preset runs there;
- under the ``kvquant`` attention every preset gives the dequantizing path's logits (1e-4 relative)
  and tokens, on each size, with a left-padded row;
- the block rotation still does its job on a non-power-of-two head: keys with a per-channel offset
  and outlier channels quantize to int4 with far less error rotated than not.
"""

from __future__ import annotations

import pytest
import torch

import kvquant
from kvquant import KVQuantCache, KVQuantConfig
from kvquant.config import preset_names
from kvquant.formats import dequantize, quantize
from kvquant.kernels import ops
from kvquant.models import tiny_model


@pytest.mark.parametrize(
    ("head_dim", "groups"),
    [(64, (64, 64)), (80, (40, 40)), (96, (48, 48)), (112, (56, 56)), (128, (64, 64)), (256, (64, 64))],
)
def test_int4_groups_divide_every_head(head_dim, groups):
    assert KVQuantConfig.resolve("int4").group_sizes(head_dim) == groups
    kg, vg = KVQuantConfig.resolve("tcq2-recent").group_sizes(head_dim)  # keys 32 / values per head
    assert head_dim % kg == 0 and kg % 8 == 0 and vg == head_dim


def test_a_group_with_no_multiple_of_8_below_it_takes_the_largest_divisor():
    cfg = KVQuantConfig(key_format="int4", value_format="int4", key_group_size=6, value_group_size=64)
    assert cfg.group_sizes(20) == (5, 20)
    assert KVQuantConfig(key_format="int4", value_format="int4", key_group_size=64).group_sizes(72)[0] == 24


@pytest.mark.parametrize("head_dim", [80, 96, 112, 256])
def test_every_preset_runs_fused_as_dequantized_on_the_head_size(head_dim, greedy):
    model = tiny_model("llama", head_dim=head_dim)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(head_dim))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # a left-padded row
    for preset in preset_names():
        model.set_attn_implementation("sdpa")
        seq_ref, logits_ref = greedy(
            model, KVQuantCache(model.config, preset, fused=False), ids, 6, mask, pad_token_id=0
        )
        kvquant.enable(model)
        seq, logits = greedy(model, KVQuantCache(model.config, preset), ids, 6, mask, pad_token_id=0)
        assert torch.isfinite(logits).all(), preset
        rel = ((logits - logits_ref).norm() / logits_ref.norm()).item()
        assert rel <= 1e-4, (head_dim, preset, rel)
        assert torch.equal(seq, seq_ref), (head_dim, preset)
    model.set_attn_implementation("sdpa")


def _int4_error(x: torch.Tensor, rotate: bool) -> float:
    """Relative squared error of ``x [1, 1, T, D]`` stored as int4 (group 64 -> the head's divisor),
    rotated first (and back after) or not."""
    d = x.shape[-1]
    group = KVQuantConfig.resolve("int4").group_sizes(d)[0]
    y = ops.rotate(x) if rotate else x
    back = dequantize(quantize(y, "int4", group_size=group), "int4", head_dim=d, group_size=group)
    back = ops.rotate(back.float()) if rotate else back.float()
    return ((back - x) ** 2).sum().item() / (x**2).sum().item()


@pytest.mark.parametrize("head_dim", [96, 80, 128])
def test_the_block_rotation_tames_outlier_channels(head_dim):
    # keys as real models have them: a per-channel offset and a few channels 10-50x larger
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(1, 1, 512, head_dim, generator=g)
    x += 3 * torch.randn(head_dim, generator=g)  # per-channel offset
    for c, gain in ((3, 50.0), (head_dim // 2 + 1, 20.0), (head_dim - 5, 10.0)):
        x[..., c] *= gain
    plain, rotated = _int4_error(x, False), _int4_error(x, True)
    # int4 per token: the step is max|x| / 7 per group; rotation spreads each outlier over its
    # Hadamard block (n = 16 / 32 / 128 channels), cutting max|x| about sqrt(n)-fold in its group
    assert rotated < plain / 3, (head_dim, plain, rotated)
