"""The CUDA path of a decode step, run on CPU: the Triton kernels under the interpreter, the C kernels
switched off (a GPU never runs them). On a GPU the cache path is host-bound (a profile on an H200
counted ~1,340 kernel launches per decode step of an 8-layer model with ``int4``, the GPU busy for a
tenth of the step), so what a step launches is behaviour that matters:

- the fused logits equal the dequantizing path (left padding: full-precision tokens under a mask with
  holes, read by the Triton kernel itself), the same greedy tokens;
- per layer and decode step, the torch ops issued from kvquant's code (each a kernel launch on a GPU)
  and the Triton launches stay within a small budget: the quantize kernel flags non-finite values in
  place (no check of its own), every segment of the decode (store, recent window, full-precision
  tokens) is one launch of the split kernel and one merge joins them.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvquant
from kvquant import KVQuantCache, KVQuantConfig
from kvquant.models import tiny_model

triton = pytest.importorskip("triton")

# metadata and views launch nothing on a GPU
_NO_LAUNCH = {
    "view", "_unsafe_view", "t", "transpose", "slice", "select", "unsqueeze", "squeeze", "expand",
    "as_strided", "detach", "alias", "permute", "reshape", "split", "unbind", "narrow", "empty",
    "empty_like", "empty_strided", "_local_scalar_dense", "lift_fresh", "resize_", "set_",
    "_reshape_alias", "split_with_sizes", "new_empty", "new_empty_strided",
}  # fmt: skip
_OURS = tuple(os.path.dirname(p) + os.sep for p in (kvquant.__file__, kvquant.kernels.__file__))
_INTERPRETER = os.sep + os.path.join("triton", "runtime", "interpreter")


class _Launches(TorchDispatchMode):
    """Counts the torch ops issued (directly or not) from kvquant's code, outside Triton's interpreter."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_LAUNCH:
            ours, frame = None, sys._getframe(1)
            while frame is not None:
                file = frame.f_code.co_filename
                if _INTERPRETER in file:
                    break
                if ours is None and file.startswith(_OURS):
                    ours = frame  # the innermost frame of ours
                frame = frame.f_back
            if frame is None and ours is not None:
                self.ops[f"{name} @ {os.path.basename(ours.f_code.co_filename)}:{ours.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cuda_path(monkeypatch):
    """The backends as a GPU sees them: Triton takes CPU tensors too (interpreter), C none. Yields
    a counter of the Triton kernels launched, by name."""
    from triton.runtime.interpreter import InterpretedFunction

    from kvquant.kernels import INTERPRET, dispatch
    from kvquant.kernels.cpu.backend import BACKEND as cpu
    from kvquant.kernels.triton.backend import BACKEND as tri

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 at import")
    monkeypatch.setattr(tri, "devices", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(cpu, "devices", frozenset())
    dispatch.supporting.cache_clear()
    launched = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    yield launched
    monkeypatch.undo()
    dispatch.supporting.cache_clear()


# case: (torch ops issued from kvquant's code, Triton launches) per layer and decode step, at most;
# batch 2 with a left-padded row (its mask and starts cost a few small ops per layer). When written:
# int4 without rotation 25.5 ops, 5 launches (quantize K and V, one split launch per segment: store and fp tokens, one
# merge); a recent window adds a segment and the transcode of the token leaving it (the dequantize
# kernel, then the quantize kernel; 36.5 ops before the dequantize kernel, 30.5 after); a KIVI store writes a block of keys every 32 steps (none here); the
# rotation costs one torch matmul each way. Before the deferred flag and the segment launches:
# ~104 ops for int4. On CPU the entry check of the new states is 2 sums; on CUDA it is 6 small ops
# (``check_finite``), not counted here. (The codebook kernels, whose scale search is slow under the interpreter, have the
# same launch structure as int4's and their own kernel tests.)
_RECENT = {**KVQuantConfig.resolve("k3v2-recent").to_dict(), "name": None, "key_format": "int3",
           "value_format": "int2", "recent_key_format": "int8", "recent_value_format": "int8", "recent_length": 16}  # fmt: skip
_INT4 = {**KVQuantConfig.resolve("int4").to_dict(), "name": None}
CASES = {
    "int4": ("int4", 24, (32, 5)),  # rotated, and the keys' divisor folded into the query
    "fp8": ("fp8", 24, (24, 5)),
    "int4-plain": ({**_INT4, "rotation": "none", "smoothing": "channel"}, 24, (27, 5)),
    "kivi4": ("kivi4", 150, (17, 3)),  # (a prompt long enough for a block of per-channel keys)
    "int3-int2-recent-int8": (_RECENT, 40, (34, 10)),  # (+1.5 since its keys' divisor is folded too)
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_decode_step_on_the_cuda_path_is_exact_and_launches_little(cuda_path, case, greedy):
    preset, prompt, (most_ops, most_launches) = CASES[case]
    model = tiny_model("llama", head_dim=32, num_hidden_layers=2)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 100, (2, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0  # a left-padded row: its padding is a hole in the fp tokens' mask
    seq_ref, logits_ref = greedy(
        model, KVQuantCache(model.config, preset, fused=False), ids, 4, mask, pad_token_id=0
    )
    kvquant.enable(model)
    seq, logits = greedy(model, KVQuantCache(model.config, preset), ids, 4, mask, pad_token_id=0)
    rel = ((logits - logits_ref).norm() / logits_ref.norm()).item()
    assert rel <= 1e-4 and torch.equal(seq, seq_ref), (case, rel)

    cache = KVQuantCache(model.config, preset)
    steps = 3
    pos = (mask.cumsum(-1) - 1).clamp(
        min=0
    )  # [B, T] as generate gives them (the cache reads the padding off them)

    def step(tok):
        nonlocal mask, pos
        mask, pos = torch.cat([mask, torch.ones_like(tok)], 1), pos[:, -1:] + 1
        return (
            model(tok, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1:].argmax(-1)
        )

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = (
            model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1:].argmax(-1)
        )
        tok = step(tok)  # (the decode plans made)
        cuda_path.clear()
        with _Launches() as counted:
            for _ in range(steps):
                tok = step(tok)
    ops_per_step = sum(counted.ops.values()) / (steps * layers)
    assert ops_per_step <= most_ops, (case, ops_per_step, counted.ops.most_common(6))
    launches = sum(cuda_path.values()) / (steps * layers)
    assert 1 <= launches <= most_launches, (case, dict(cuda_path))
