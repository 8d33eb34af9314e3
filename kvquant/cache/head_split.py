"""``HeadSplitLayer``: one cache layer whose KV heads are stored in different formats.

A layer config with head overrides (``KVQuantConfig.heads``, e.g. the retrieval heads of
``retrieval_unit: head`` kept in ``nuq4`` while the layer's other heads are ``nuq2``) groups its KV
heads by their config (:meth:`KVQuantConfig.head_groups`) and holds one ordinary layer per group
(:class:`~kvquant.cache.layer.QuantizedKVLayer` or ``SlidingKVLayer``) over those heads alone. Every
call is passed to each sub-layer with its heads' slice of the keys and values; what comes back is
put together again in the model's head order: dequantized tensors, or, under the ``kvquant``
attention, a :class:`HeadSplitView` whose parts the attention decodes one by one (each part's query
heads against its own quantized tiers, fused) and writes into one output.

Example:
    >>> cfg = KVQuantConfig(key_format="nuq2", value_format="nuq2", heads={1: {"key_format": "nuq4"}})
    >>> layer = make_layer(cfg, kv_heads=3)                   # kvquant.cache.factory.make_layer
    >>> [(heads.tolist(), part.config.key_format) for heads, part in layer.parts]
    [([0, 2], 'nuq2'), ([1], 'nuq4')]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import CacheLayerMixin

from kvquant.cache.view import DequantizedKV, KVView
from kvquant.config import KVQuantConfig
from kvquant.kernels import ops


@dataclass(frozen=True)
class HeadSplitView:
    """What a :class:`HeadSplitLayer` hands the ``kvquant`` attention: ``parts``, one
    ``(kv_heads [h] int64, KVView)`` per group of alike heads, ``kv_heads`` KV heads in all;
    ``memo``: the layer's, for the query heads of each group (made once per query head count)."""

    parts: tuple[tuple[torch.Tensor, KVView], ...]
    kv_heads: int
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def query_heads(self, part: int, query_heads: int) -> torch.Tensor:
        """The query heads ``[h * G]`` reading part ``part``'s KV heads (``G = query_heads /
        kv_heads``: the query heads of KV head ``j`` are ``j * G .. j * G + G - 1``, transformers'
        ``repeat_kv`` order)."""
        kv_heads = self.parts[part][0]
        key = (part, query_heads, kv_heads.device)
        if key not in self.memo:
            g = query_heads // self.kv_heads
            offsets = torch.arange(g, device=kv_heads.device)
            self.memo[key] = (kv_heads[:, None] * g + offsets[None, :]).reshape(-1)
        return self.memo[key]


class HeadSplitLayer(DequantizedKV, CacheLayerMixin):
    """A layer stored as one sub-layer per group of KV heads with the same config.

    Args:
        config: the layer's resolved config (``KVQuantConfig.for_layer``), with head overrides.
        kv_heads: the layer's KV heads.
        sliding_window: as :func:`~kvquant.cache.factory.make_layer`.
        layer_factory: ``(config, sliding_window, **kwargs) -> layer`` for one group of heads.
        static_scales / key_map / query_rms: as ``QuantizedKVLayer``'s, over all ``kv_heads``
            (each sub-layer gets its heads' rows).
        **kwargs: passed to every sub-layer (``initial_capacity``).
    """

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        config: KVQuantConfig,
        kv_heads: int,
        sliding_window: int | None,
        layer_factory,
        static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_map: torch.Tensor | None = None,
        query_rms: torch.Tensor | None = None,
        **kwargs,
    ):
        super().__init__()
        self.config = config
        self.kv_heads = kv_heads
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.static_scales, self.key_map, self.query_rms = static_scales, key_map, query_rms
        self.return_view = False
        self.parts: list[tuple[torch.Tensor, CacheLayerMixin]] = []
        order = []
        for heads, cfg in config.head_groups(kv_heads):
            idx = torch.tensor(heads, dtype=torch.long)  # [h]
            rows = {}
            if static_scales is not None:
                rows["static_scales"] = (static_scales[0][idx], static_scales[1][idx])
            for name, per_head in (("key_map", key_map), ("query_rms", query_rms)):
                if per_head is not None:
                    if per_head.shape[0] != kv_heads:
                        raise ValueError(
                            f"{name}: {per_head.shape[0]} heads in it; this layer has {kv_heads} KV heads"
                        )
                    rows[name] = per_head[idx]
            self.parts.append((idx, layer_factory(cfg, sliding_window, **rows, **kwargs)))
            order += heads
        self._inverse = torch.argsort(torch.tensor(order))  # [H]: model head -> place in the parts' cat
        self._on: dict[torch.device, tuple] = {}
        self._query_heads: dict = {}  # (part, query heads, device) -> [h * G] (HeadSplitView.query_heads)

    # ------------------------------------------------------------------------------------ state

    @property
    def is_initialized(self) -> bool:
        return bool(self.parts) and all(p.is_initialized for _, p in self.parts)

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # (CacheLayerMixin.__init__ sets it)
        pass

    def leaves(self) -> list[CacheLayerMixin]:
        """The sub-layers, one per group of heads."""
        return [p for _, p in self.parts]

    def _index(self, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The groups' head indices and the inverse order, on ``device`` (moved once)."""
        if device not in self._on:
            self._on[device] = ([i.to(device) for i, _ in self.parts], self._inverse.to(device))
        return self._on[device]

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x [B, H, ...]`` as one ``[B, h, ...]`` slice per group."""
        if x.dim() < 2 or x.shape[1] != self.kv_heads:
            raise ValueError(
                f"key_states: expected [batch, kv_heads={self.kv_heads}, tokens, head_dim], got shape "
                f"{tuple(x.shape)}"
            )
        return [x.index_select(1, i) for i in self._index(x.device)[0]]

    def _join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The groups' ``[B, h, ...]`` put back in the model's head order: ``[B, H, ...]``."""
        return torch.cat(parts, 1).index_select(1, self._index(parts[0].device)[1])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for (_, part), k, v in zip(
            self.parts, self._split(key_states), self._split(value_states), strict=True
        ):
            if not part.is_initialized:
                part.lazy_initialization(k, v)

    def reset(self) -> None:
        for _, part in self.parts:
            part.reset()

    # ------------------------------------------------------------------------------------ update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """As ``QuantizedKVLayer.update``, per group of heads: ``(history ++ new)`` keys and values
        ``[B, H, n, D]`` in the model's head order, or (``return_view``) one :class:`HeadSplitView`
        twice."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        ks, vs = self._split(key_states), self._split(value_states)
        for (_, part), k, v in zip(self.parts, ks, vs, strict=True):
            part._check_states(k, v)
        ops.check_finite(key_states, value_states)  # every group's checks before any group stores
        outs = []
        for (_, part), k, v in zip(self.parts, ks, vs, strict=True):
            part.return_view = self.return_view
            outs.append(part._update_checked(k, v, **kwargs))
        if all(isinstance(o[0], KVView) for o in outs):
            heads = self._index(key_states.device)[0]
            parts = tuple(zip(heads, (o[0] for o in outs), strict=True))
            view = HeadSplitView(parts, self.kv_heads, self._query_heads)
            return view, view
        return self._join([o[0] for o in outs]), self._join([o[1] for o in outs])

    def append(self, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Add ``k, v [B, H, n, D]`` to every group (see ``QuantizedKVLayer.append``)."""
        for (_, part), ks, vs in zip(self.parts, self._split(k), self._split(v), strict=True):
            part.append(ks, vs, position_ids)

    def read_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[B, H, n, D]`` of every position the next call attends to, in the model's head order."""
        reads = [part.read_history() for _, part in self.parts]
        return self._join([r[0] for r in reads]), self._join([r[1] for r in reads])

    # ------------------------------------------------------------------------------------ sizes

    @property
    def _first(self) -> CacheLayerMixin:
        return self.parts[0][1]

    def get_seq_length(self) -> int:
        return self._first.get_seq_length()

    def get_max_length(self) -> int:
        return self._first.get_max_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._first.get_mask_sizes(query_length)

    @property
    def batch_size(self) -> int:
        return self._first.batch_size

    # ------------------------------------------------------------------------------------ generate hooks

    def activate_past_recording(self) -> None:
        for _, part in self.parts:
            part.activate_past_recording()

    def crop(self, tokens_to_remove: int) -> None:
        """``QuantizedKVLayer.crop`` on every group; refused (nothing changed) where any group
        cannot honour it."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"tokens_to_remove: crop takes a count <= 0 of tokens to remove, got {tokens_to_remove}"
            )
        if self.is_initialized:
            new_len = max(self.get_seq_length() + tokens_to_remove, 0)
            for _, part in self.parts:
                part._check_crop(new_len)
        for _, part in self.parts:
            part.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for _, part in self.parts:
            part.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for _, part in self.parts:
            part.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for _, part in self.parts:
            part.batch_select_indices(indices)

    def offload(self):
        return None

    def prefetch(self):
        return None

    # ------------------------------------------------------------------------------------ memory

    def held_tokens(self) -> int:
        return max(part.held_tokens() for _, part in self.parts)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the valid tokens by part (``store``, ``tail``, ``sink``), summed over the groups."""
        total = {"store": 0, "tail": 0, "sink": 0}
        for _, part in self.parts:
            for k, v in part.nbytes().items():
                total[k] += v
        return total

    def reserved_bytes(self) -> int:
        return sum(part.reserved_bytes() for _, part in self.parts)

    def fp16_bytes(self) -> int:
        return sum(part.fp16_bytes() for _, part in self.parts)

    def formats(self) -> tuple[str, str]:
        """The key and value formats, one per group: ``"nuq2[0,2]+nuq4[1]"``."""

        def name(which: str) -> str:
            return "+".join(f"{getattr(p.config, which)}{i.tolist()}".replace(" ", "") for i, p in self.parts)

        return name("key_format"), name("value_format")
