"""``LayerEdits``: what ``generate`` does to a :class:`~kvquant.cache.layer.QuantizedKVLayer` between
forward calls: ``crop`` (assisted decoding, contrastive search), beam ``reorder_cache`` and the row
selects / repeats of batched search. Codes and scales move as they are: nothing is requantized,
except the kept part of a partial channel-axis block on a crop.

Example:
    >>> layer = QuantizedKVLayer(KVQuantConfig.resolve("int4"))
    >>> _ = layer.update(torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64))   # [B, H_kv, T, D]
    >>> layer.crop(-10); layer.get_seq_length()
    30
    >>> layer.reorder_cache(torch.tensor([1, 1])); layer.batch_size
    2
"""

from __future__ import annotations

import torch


class LayerEdits:
    """Mixin of :class:`~kvquant.cache.layer.QuantizedKVLayer`: crop and row edits over its tiers,
    tail, sinks and key transform (the attributes that class sets in ``_clear`` /
    ``lazy_initialization``)."""

    def _check_crop(self, new_len: int) -> None:
        """Hook: refuse a crop the layer cannot honour (a sliding layer that dropped the positions)."""

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers passes a count <= 0).

        Positions still in the tail are simply forgotten; stored ones too, except that on the channel
        axis the kept part of a partial block is dequantized back into the tail (its block scale
        covered tokens that are now gone).
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"tokens_to_remove: crop takes a count <= 0 of tokens to remove, got {tokens_to_remove}"
            )
        if not self.is_initialized:
            return
        new_len = max(self.seq_len + tokens_to_remove, 0)
        self._check_crop(new_len)
        if new_len >= self.store_end:
            self.tail.crop(new_len)
        else:
            origin = self.main.origin
            block = self.main.block  # tokens sharing a scale row (channel axis), else 1
            aligned = max(origin + (new_len - origin) // block * block, self.store_begin)
            k, v = self.read(aligned, new_len)
            for tier in self.tiers:
                tier.crop(aligned)
            self.tail.reset(aligned, k, v)
        self.seq_len = new_len
        self.plans.clear()
        self._step = None
        self._after_crop()

    def _after_crop(self) -> None:
        """Hook for subclasses (a sliding layer evicts here)."""

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.plans.clear()
        self._step = None
        for part in (*self.tiers, self.tail, self.transform):
            part.map_batch(fn)
        if self.sinks is not None:
            self.sinks.map_batch(fn)
        self.pads = fn(self.pads)
        self.pads_max = int(self.pads.max()) if self.pads.numel() else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder rows of codes, scales, tail and sinks (no dequantize / requantize)."""
        if self.is_initialized:
            if beam_idx.dim() != 1 or beam_idx.shape[0] != self.batch_size:
                raise ValueError(
                    f"beam_idx: expected one index per cached row ({self.batch_size}), got shape {tuple(beam_idx.shape)}"
                )
            idx = beam_idx.to(self.device)
            self._map_batch(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):  # the store's buffers are not the `keys` / `values` attributes
        return None

    def prefetch(self):
        return None
