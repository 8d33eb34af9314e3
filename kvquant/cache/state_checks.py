"""What a cache layer accepts: the layout checks every ``update`` runs before anything is stored.

Metadata only (shapes, dtypes, devices); the values are :func:`kvquant.kernels.ops.check_finite`'s,
which the layer runs after these (no host sync on CUDA).

Example:
    >>> check_layout(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64))   # fine: returns None
    >>> k = v = torch.zeros(1, 2, 3, 64)                             # [B, H, n, D]
    >>> check_layout(k, v, held=(1, 4, 64, 64, torch.float32, torch.device("cpu")))
    Traceback (most recent call last):
    ValueError: key_states: kv_heads 2 but this layer holds 4 (from its first update); ...
"""

from __future__ import annotations

import torch

STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what a layer stores
# the fields of `held`, and which argument each is read from
_HELD_FIELDS = ("batch", "kv_heads", "head_dim", "head_dim", "dtype", "device")
_HELD_NAMES = ("key_states",) * 3 + ("value_states",) + ("key_states",) * 2


def check_layout(k: object, v: object, held: tuple | None = None) -> None:
    """One clear ``TypeError`` / ``ValueError`` for key / value states a layer cannot store.

    Args:
        k, v: the states of one update: tensors ``[B, H, n, D]`` and ``[B, H, n, Dv]``, ``n >= 1``, of
            a dtype in :data:`STATE_DTYPES`, alike in batch, heads, tokens, dtype and device.
        held: once the layer holds data, its ``(batch, kv_heads, head_dim, value_head_dim, dtype,
            device)``, which the states must match; ``None`` before its first update.
    """
    for name, x in (("key_states", k), ("value_states", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{name}: expected [batch, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}"
            )
        if x.dtype not in STATE_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in STATE_DTYPES)
            raise TypeError(f"{name}: dtype {str(x.dtype).removeprefix('torch.')}; allowed: {allowed}")
    if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"value_states: {tuple(v.shape)} {v.dtype} on {v.device} does not match key_states "
            f"{tuple(k.shape)} {k.dtype} on {k.device} in batch, heads, tokens, dtype and device"
        )
    if k.shape[2] == 0:
        raise ValueError("key_states: an update needs at least one token, got 0")
    if held is None:
        return
    got = (k.shape[0], k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)
    for name, field, want, have in zip(_HELD_NAMES, _HELD_FIELDS, held, got, strict=True):
        if want != have:
            raise ValueError(
                f"{name}: {field} {have} but this layer holds {want} (from its first update); "
                "reset the cache (or reorder / select / repeat it) before changing it"
            )
