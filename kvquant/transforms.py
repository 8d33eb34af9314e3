"""The key transform: per-head Hadamard rotation, channel smoothing and a key map as one object.

Stored keys are ``R M (k - mean) / std`` and stored values ``R v`` (``R`` the normalized Walsh-Hadamard
matrix, symmetric and orthogonal; ``mean`` / ``std`` per (row, head, channel), fitted on the first
tokens quantized, padding and sinks excluded; ``M`` an optional calibrated ``[D, D]`` map per KV head,
the identity when none is given: see :mod:`kvquant.key_map`). Attention over the stored operands
stays exact:

- the query is folded: ``q' = R M^-T (q * std)``, so ``q' . k' = q . (k - mean)``;
- every score (stored or full precision, once those go through :meth:`KeyTransform.apply` too) is
  short by the same ``q . mean``: the softmax is unchanged and :meth:`KeyTransform.shift_lse` adds
  ``scaling * q . mean`` back to the log-sum-exp (exact without softcap);
- the output is in the rotated value space and is rotated back. The decode rotates the query, the
  full-precision tokens and the output with ``ops.decode_attention(rotation=True)`` (inside the C
  kernel's call on CPU), so ``fold_query`` / ``apply`` take ``rotate=False`` there.

Used by the cache layer (apply / undo), the ``kvquant`` attention (fold, smoothing of the fp tokens) and
``kvquant calibrate`` (static scales are measured on the keys as they are stored).

Example:
    >>> t = KeyTransform("hadamard", "mean", torch.float16)
    >>> k, v = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    >>> t.fit(k)
    >>> ks, vs = t.apply(k, v)
    >>> torch.allclose(t.undo(ks, vs)[0], k, atol=1e-3)
    True
    >>> m = KeyTransform("hadamard", "mean", key_map=torch.eye(64).repeat(2, 1, 1))  # [H, D, D]
"""

from __future__ import annotations

import torch

from kvquant.config import ROTATIONS, SMOOTHINGS
from kvquant.formats import round_to_dtype
from kvquant.kernels import ops
from kvquant.query_scales import QUERY_EXPONENT_PLAIN, QUERY_EXPONENT_ROTATED

# smoothing "auto": a head's channels are divided by their spread where the largest spread is at least
# this many times the median (fitted on at least AUTO_MIN_TOKENS tokens). Key channel spreads, largest /
# median per head over a 1,024-token WikiText-2 prefix: SmolLM2-135M 1.4-4.9 (every head); Gemma 3 270M
# (QK-norm gains) 4.2-24.9, >= 6.5 in 16 of 18 layers.
AUTO_SPREAD_RATIO = 6.0
AUTO_MIN_TOKENS = 32


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x[..., D] @ R`` in fp32 (returned in ``x``'s dtype); its own inverse (``R^-1 = R``)."""
    return ops.rotate(x.float()).to(x.dtype)


unrotate = rotate
_rotate = rotate  # (the methods' ``rotate`` flag shadows the name)


class KeyTransform:
    """Rotation, smoothing and key map of one layer's stored keys (values: rotation only).

    Args:
        rotation: ``none`` or ``hadamard``.
        smoothing: ``none``, ``mean`` (subtract each channel's mean), ``channel`` (and divide by
            its standard deviation) or ``auto`` (``channel`` for heads whose channel spreads differ by
            :data:`AUTO_SPREAD_RATIO` or more, ``mean`` for the rest) or ``query`` (as ``auto``, but
            the heads it divides are divided by ``std^(1-a) * (mean(query_rms) / query_rms)^a``, ``a``
            from :mod:`kvquant.query_scales`; ``auto`` itself when ``query_rms`` is None).
        scale_dtype: dtype the statistics are kept in (the store's scale dtype).
        key_map: ``[H, D, D]`` (fp32, invertible) applied to each KV head's smoothed keys before the
            rotation (``kvquant calibrate --key-map``); None: the identity. Shared, never modified.
        query_rms: ``[H, D]`` root mean square of each query channel, each KV head's query heads
            pooled (:func:`kvquant.query_scales.query_channel_rms`); read by ``smoothing: query``.

    ``stats`` is ``(mean[B, H, 1, D], std[B, H, 1, D] | None)`` once fitted (None before).
    """

    def __init__(
        self,
        rotation: str = "none",
        smoothing: str = "none",
        scale_dtype=torch.float16,
        key_map: torch.Tensor | None = None,
        query_rms: torch.Tensor | None = None,
    ):
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation: unknown {rotation!r}; allowed: {', '.join(ROTATIONS)}")
        if smoothing not in SMOOTHINGS:
            raise ValueError(f"smoothing: unknown {smoothing!r}; allowed: {', '.join(SMOOTHINGS)}")
        self.rotated = rotation == "hadamard"
        self.smoothing = smoothing
        self.scale_dtype = scale_dtype
        self.key_map = key_map
        self.query_rms = query_rms
        self._maps: dict = {}  # (kind, device, query heads) -> the map as each step uses it
        self.stats = None

    @property
    def stats(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self._stats

    @stats.setter
    def stats(self, value: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
        self._stats = value
        # the fp32 copies every decode step computes with, made once per fit / batch change
        self._stats32 = None if value is None else tuple(None if t is None else t.float() for t in value)
        self._per_head: dict[tuple[int, int], torch.Tensor] = {}  # (stat, query heads) -> [B, Hq, D]

    @property
    def is_identity(self) -> bool:
        return not self.rotated and self.smoothing == "none" and self.key_map is None

    def key_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype stored keys are read in to undo this transform: fp32 where smoothing or a map
        take part (their inverse needs it), else ``dtype``."""
        return torch.float32 if self.stats is not None or self.key_map is not None else dtype

    def _map(self, kind: str, device: torch.device, hq: int = 0) -> torch.Tensor:
        """The key map as one step uses it, made once per (kind, device, query heads): ``fwd``
        ``M^T [1, H, D, D]`` (keys right-multiply it), ``inv`` ``M^-T`` (undo), ``query``
        ``M^-1 [1, Hq, D, D]`` (a query row times it is ``M^-T q``), repeated over each KV head's
        query heads."""
        key = (kind, device, hq)
        if key not in self._maps:
            m = self.key_map.float()  # [H, D, D]
            if kind == "fwd":
                t = m.transpose(-1, -2)
            else:
                inv = torch.linalg.inv(m.double()).float()
                t = (
                    inv.repeat_interleave(hq // m.shape[0], dim=0)
                    if kind == "query"
                    else inv.transpose(-1, -2)
                )
            self._maps[key] = t.unsqueeze(0).to(device).contiguous()
        return self._maps[key]

    @property
    def needs_fit(self) -> bool:
        return self.smoothing != "none" and self.stats is None

    # ------------------------------------------------------------------------------------ fitting

    def fit(self, k: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Fix the smoothing statistics from keys ``k[B, H, n, D]``; ``weight[B, 1, n, 1]`` (0 / 1)
        excludes tokens (padding, sinks). A row with no token of its own gets mean 0, std 1."""
        if self.smoothing == "none":
            return
        sdt = self.scale_dtype
        if k.is_meta:  # a byte count (kvquant.memory): the statistics' shapes and dtype, no values
            shape = (*k.shape[:2], 1, k.shape[3])  # [B, H, 1, D]
            std = None if self.smoothing == "mean" else torch.empty(shape, dtype=sdt, device="meta")
            self.stats = (torch.empty(shape, dtype=sdt, device="meta"), std)
            return
        x = k.float()
        w = torch.ones_like(x[:, :1, :, :1]) if weight is None else weight.float()
        count = w.sum(2, keepdim=True)  # [B, 1, 1, 1]
        mean = (x * w).sum(2, keepdim=True) / count.clamp_min(1)  # [B, H, 1, D]
        if self.smoothing == "mean":
            self.stats = (mean.to(sdt), None)
            return
        std = ((((x - mean) ** 2) * w).sum(2, keepdim=True) / count.clamp_min(1)).sqrt()
        floor = std.mean(-1, keepdim=True) * 1e-2 + torch.finfo(sdt).tiny  # no channel collapses
        std = torch.where(count > 1, torch.maximum(std, floor), torch.ones_like(std))
        if self.smoothing in ("auto", "query"):  # divide only the heads whose spreads differ widely
            ratio = std.amax(-1, keepdim=True) / std.median(-1, keepdim=True).values  # [B, H, 1, 1]
            wide = (ratio >= AUTO_SPREAD_RATIO) & (count >= AUTO_MIN_TOKENS)
            if self.smoothing == "query" and self.query_rms is not None:
                std = self._query_weighted(std)
            # elsewhere 1, exactly as "mean" (the bytes stay those of "channel": the planner's count)
            std = torch.where(wide, std, torch.ones_like(std))
        self.stats = (mean.to(sdt), round_to_dtype(std, sdt, +1))

    def _query_weighted(self, std: torch.Tensor) -> torch.Tensor:
        """``std[B, H, 1, D]`` -> the divisor of ``smoothing: query``: ``std^(1-a) * (mean(rms) /
        rms)^a`` (``rms``: each query channel's size, floored at 1% of the head's mean)."""
        a = QUERY_EXPONENT_ROTATED if self.rotated else QUERY_EXPONENT_PLAIN
        rms = self.query_rms.to(std.device, torch.float32)[None, :, None, :]  # [1, H, 1, D]
        mean = rms.mean(-1, keepdim=True)
        rms = torch.maximum(rms, mean * 1e-2)
        return std ** (1 - a) * (mean / rms) ** a

    # ------------------------------------------------------------------------------------ stored space

    def step_stats(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(mean, std)``, fp32 ``[B, H, 1, D]`` each or None: what :meth:`apply` subtracts from
        and divides the keys by (``ops.plan_append_step`` takes them)."""
        return (None, None) if self._stats32 is None else self._stats32

    def apply(
        self, k: torch.Tensor, v: torch.Tensor, rotate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [B, H, n, D]`` -> the stored space (keys fp32 once smoothed); ``rotate=False``:
        smoothed only (for a kernel that rotates them itself: ``ops.decode_attention(rotation=...)``)."""
        mean, std = (None, None) if self._stats32 is None else self._stats32
        pair = self.rotated and rotate and v.dtype == torch.float32 and k.shape == v.shape
        if pair and self.key_map is None:  # one call for both
            return ops.rotate_pair(k.float(), v, mean=mean, std=std)
        if mean is not None:
            k = k.float() - mean
            if std is not None:
                k = k / std
        if self.key_map is not None:
            k = k.float() @ self._map("fwd", k.device)  # [B, H, n, D]
            if pair:
                return ops.rotate_pair(k, v)
        if self.rotated and rotate:
            k, v = _rotate(k), _rotate(v)
        return k, v

    def decode_operands(self, q: torch.Tensor, fp_k: tuple, fp_v: tuple) -> tuple:
        """What ``ops.decode_attention`` takes over stores in this transform's space, the rotation
        aside (the op's ``rotation``): ``(q, fp_k, fp_v, smoothing)`` for a query ``q [B, Hq, D]`` and
        full-precision tokens given as segments ``[B, H, n_i, D]``. Without a key map ``q`` and the
        segments go as they are and ``smoothing`` is :meth:`step_stats` (None: no smoothing), which the
        op folds in; with one, ``q`` and the joined keys come folded here and ``smoothing`` is None."""
        if self.key_map is None:
            return q, fp_k, fp_v, self._stats32
        k, v = self.apply(torch.cat(fp_k, 2), torch.cat(fp_v, 2), rotate=False)
        return self.fold_query(q, rotate=False), (k,), (v,), None

    def undo(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`apply` (keys come back fp32 where smoothed)."""
        if self.rotated:
            k, v = unrotate(k), unrotate(v)
        if self.key_map is not None:
            k = k.float() @ self._map("inv", k.device)
        if self._stats32 is not None:
            mean, std = self._stats32
            k = k.float()
            if std is not None:
                k = k * std
            k = k + mean
        return k, v

    # ------------------------------------------------------------------------------------ attention

    def _per_query_head(self, which: int, hq: int) -> torch.Tensor:
        """Statistic ``which`` (0: mean, 1: std) ``[B, Hkv, 1, D]`` -> ``[B, Hq, D]`` fp32, made once
        per fit (every decode step reads it)."""
        key = (which, hq)
        if key not in self._per_head:
            t = self._stats32[which]
            self._per_head[key] = t[:, :, 0].repeat_interleave(hq // t.shape[1], dim=1)
        return self._per_head[key]

    def fold_query(self, q: torch.Tensor, rotate: bool = True) -> torch.Tensor:
        """``q[B, Hq, D]`` -> the query that scores stored keys: ``R M^-T (q * std)`` (``rotate=False``:
        ``M^-T (q * std)``, for a kernel that rotates it itself)."""
        if self.stats is not None and self.stats[1] is not None:
            q = q.float() * self._per_query_head(1, q.shape[1])
        if self.key_map is not None:
            q = (q.float().unsqueeze(-2) @ self._map("query", q.device, q.shape[1])).squeeze(-2)
        return _rotate(q) if self.rotated and rotate else q

    def shift_lse(self, lse: torch.Tensor, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """``lse[B, Hq]`` of scores ``q . (k - mean)`` -> of ``q . k`` (``q[B, Hq, D]`` unfolded)."""
        if self.stats is None:
            return lse
        return lse + scaling * (q.float() * self._per_query_head(0, q.shape[1])).sum(-1)

    # ------------------------------------------------------------------------------------ batch / bytes

    def map_batch(self, fn) -> None:
        if self.stats is not None:
            self.stats = tuple(None if t is None else fn(t) for t in self.stats)

    def nbytes(self) -> int:
        if self.stats is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.stats if t is not None)
