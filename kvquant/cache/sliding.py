"""``SlidingKVLayer``: the quantized layer of a sliding-window (or chunked) attention layer, which
drops the positions no later query can see.

Example:
    >>> layer = SlidingKVLayer(KVQuantConfig.resolve("int4"), sliding_window=32)
    >>> _ = layer.update(torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64))   # [B, H_kv, T, D]
    >>> layer.get_seq_length(), layer.held_tokens()            # 100 seen, the last 31 kept
    (100, 31)
"""

from __future__ import annotations

from kvquant.cache.layer import QuantizedKVLayer
from kvquant.config import KVQuantConfig


class SlidingKVLayer(QuantizedKVLayer):
    """A sliding-window (or chunked) layer: drops positions no later query can see (sinks
    included), unless transformers asked it to record the past for a later ``crop``.

    Args:
        sliding_window: the window, in tokens; the rest as :class:`QuantizedKVLayer`.
    """

    is_sliding = True

    def __init__(self, config: KVQuantConfig, sliding_window: int, **kwargs):
        self.sliding_window = sliding_window
        super().__init__(config, **kwargs)

    def get_max_length(self) -> int:
        return self.sliding_window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = max(self.seq_len - self.sliding_window + 1, 0)
        return min(self.seq_len, self.sliding_window - 1) + query_length, kv_offset

    def history_begin(self) -> int:
        return max(self.seq_len - (self.sliding_window - 1), 0)

    def _evict(self) -> None:
        keep_from = self.history_begin()
        for tier in self.tiers:
            tier.evict_before(keep_from)
        if self.sinks is not None and self.sinks.held and keep_from >= self.pads_max + self.sinks.n:
            self.sinks.drop()  # every sink token has left the window

    def _after_append(self) -> None:
        if not self.record_past:
            self._evict()

    def _check_crop(self, new_len: int) -> None:
        if new_len < self.seq_len and max(new_len - (self.sliding_window - 1), 0) < self.store_begin:
            raise RuntimeError(
                "crop: this sliding-window layer no longer holds the positions needed after the crop; "
                "call activate_past_recording() before generating if you need to roll back"
            )

    def _after_crop(self) -> None:
        self._evict()
