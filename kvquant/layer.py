"""``QuantizedKVLayer``: one layer of a :class:`~kvquant.KVQuantCache`.

A layer holds the tokens of its sequence positions ``[0, seq_len)`` in three places:

- the quantized **store** (:class:`~kvquant.store.TokenStore` for K and for V): positions
  ``[store_begin, store_end)``. Of these, ``[store_begin, main_end)`` lie in the main stores at
  buffer index ``position - base``; with ``recent_length`` W > 0 the newest ``[main_end, store_end)``
  (at most W) lie in the finer *recent* stores at index ``position - main_end``;
- the full-precision **tail** (the residual window): positions ``[store_end, seq_len)``;
- the full-precision **sink**: each row's first ``sink_tokens`` *real* tokens (after left padding),
  which also have (unused) slots in the store so that all rows stay aligned on one time axis.

Tokens enter the tail and are quantized when they leave it (on the channel axis in whole blocks of
``key_group_size`` tokens): into the main stores, or with a recent window first into the recent
stores, from which they are re-quantized into the main stores when W newer tokens have followed.
Sliding-window layers drop positions older than the window (sinks included) unless transformers asked them to record the past for a later ``crop``.

``update`` returns, for any attention implementation, the dequantized history of the positions
cached *before* the call followed by the call's own fresh full-precision keys / values.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvquant.config import KVQuantConfig
from kvquant.formats import QuantizedBlock, round_to_dtype
from kvquant.native import native_quantizes, quantize_into_store
from kvquant.rotation import rotate, unrotate
from kvquant.store import TokenStore


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class QuantizedKVLayer(CacheLayerMixin):
    """Quantized cache layer (see the module docstring for the layout).

    Args:
        config: this layer's resolved :class:`KVQuantConfig` (no ``layer_overrides``).
        sliding_window: window size for sliding / chunked layers, ``None`` for full attention.
        static_scales: optional ``(key_scale[H_kv], value_scale[H_kv])``.
        initial_capacity: tokens the store is first allocated for (it grows by doubling).
    """

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        config: KVQuantConfig,
        sliding_window: int | None = None,
        static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        initial_capacity: int = 256,
    ):
        super().__init__()
        self.config = config
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.static_scales = static_scales
        self.initial_capacity = max(1, initial_capacity)
        self.record_past = False
        self.return_view = False  # set by KVQuantCache when the model runs the `kvquant` attention
        self.block = config.key_group_size if config.key_axis == "channel" else 1
        self._clear()

    # ------------------------------------------------------------------------------------ state

    def _clear(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.seq_len = 0  # positions seen (what get_seq_length reports)
        self.base = 0  # position held at buffer index 0
        self.store_begin = self.store_end = 0
        # [store_begin, main_end) lie in the main stores, [main_end, store_end) in the recent ones
        self.main_end = 0
        self.tail_len = 0
        self.k_store: TokenStore | None = None
        self.v_store: TokenStore | None = None
        self.rk_store: TokenStore | None = None  # recent window (config.recent_length > 0)
        self.rv_store: TokenStore | None = None
        self.tail_k = self.tail_v = None  # [B, H, cap_tail, D]
        self.sink_k = self.sink_v = None  # [B, H, S, D]
        self.pads: torch.Tensor | None = None  # [B] left-padding length of each row
        self.pads_max = 0
        # key smoothing statistics (config.smoothing): mean and std, each [B, H, 1, D] in the scale
        # dtype (std None for "mean"); None until the first tokens are quantized
        self.smooth: tuple[torch.Tensor | None, ...] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        cfg = self.config
        self.device, self.dtype, self.head_dim = key_states.device, key_states.dtype, d
        kg, vg = cfg.group_sizes(d)
        sk, sv = self.static_scales if self.static_scales is not None else (None, None)
        self.k_store = TokenStore(cfg.key_format, kg, cfg.key_axis, cfg.torch_scale_dtype, sk)
        self.v_store = TokenStore(cfg.value_format, vg, "token", cfg.torch_scale_dtype, sv)
        for store in (self.k_store, self.v_store):
            store.allocate(b, h, d, self.initial_capacity, self.dtype, self.device)
        if cfg.recent_length:
            self.rk_store = TokenStore(cfg.recent_key_format, kg, "token", cfg.torch_scale_dtype)
            self.rv_store = TokenStore(cfg.recent_value_format, vg, "token", cfg.torch_scale_dtype)
            for store in self._recent_stores():
                store.allocate(b, h, d, cfg.recent_length + 1, self.dtype, self.device)
        tail_cap = cfg.residual_length + self.block + 1
        self.tail_k = key_states.new_zeros(b, h, tail_cap, d)
        self.tail_v = value_states.new_zeros(b, h, tail_cap, value_states.shape[-1])
        s = cfg.sink_tokens
        self.sink_k = key_states.new_zeros(b, h, s, d) if s else None
        self.sink_v = value_states.new_zeros(b, h, s, value_states.shape[-1]) if s else None
        self.pads = torch.zeros(b, dtype=torch.long, device=self.device)
        self.pads_max = 0
        self.is_initialized = True

    def reset(self) -> None:
        self._clear()

    # ------------------------------------------------------------------------------------ sizes

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.seq_len + query_length, 0
        kv_offset = max(self.seq_len - self.sliding_window + 1, 0)
        return min(self.seq_len, self.sliding_window - 1) + query_length, kv_offset

    def history_begin(self) -> int:
        """First position the next forward call attends to."""
        if not self.is_sliding:
            return self.store_begin
        return max(self.seq_len - (self.sliding_window - 1), 0)

    @property
    def batch_size(self) -> int:
        return 0 if self.pads is None else self.pads.shape[0]

    # ------------------------------------------------------------------------------------ update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return ``(history ++ new)`` keys and values ``[B, H, n, D]``.

        With ``return_view`` set (the model runs the ``kvquant`` attention) both return values are
        one :class:`~kvquant.attention.KVView` of the store instead: nothing is dequantized here.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        model_kwargs = kwargs.get("kwargs") or {}
        position_ids = model_kwargs.get("position_ids")
        if self.return_view:
            view = self.view(key_states, value_states)
            self.append(key_states, value_states, position_ids)
            return view, view
        hist_k, hist_v = self.read_history()
        self.append(key_states, value_states, position_ids)
        if hist_k.shape[2] == 0:
            return key_states, value_states
        return torch.cat([hist_k, key_states], dim=2), torch.cat([hist_v, value_states], dim=2)

    def view(self, k: torch.Tensor, v: torch.Tensor):
        """A :class:`~kvquant.attention.KVView` of the history before ``k, v`` are appended."""
        from kvquant.attention import KVView

        begin = self.history_begin()
        tail_begin = max(begin, self.store_end)
        t0 = tail_begin - self.store_end
        r0 = max(self.main_end, begin)  # the recent window, dequantized before append re-quantizes it
        recent = self.read_store(r0, self.store_end) if r0 < self.store_end else (None, None)
        return KVView(
            layer=self,
            new_k=k,
            new_v=v,
            hist_begin=begin,
            store_end=self.store_end,
            tail_begin=tail_begin,
            seq_before=self.seq_len,
            tail_k=self.tail_k[:, :, t0 : self.tail_len].clone(),
            tail_v=self.tail_v[:, :, t0 : self.tail_len].clone(),
            main_end=self.main_end,
            recent_k=recent[0],
            recent_v=recent[1],
        )

    def append(self, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Add ``k, v [B, H, n, D]`` at positions ``[seq_len, seq_len + n)``; quantize what leaves the tail."""
        k, v = k.detach(), v.detach()  # the store holds data, never an autograd graph
        n = k.shape[2]
        if self.seq_len == 0:
            self._set_pads(position_ids, n)
        self._capture_sinks(k, v, self.seq_len)
        total = self.tail_len + n
        n_flush = max(total - self.config.residual_length, 0) // self.block * self.block
        if n_flush == 0:
            self._tail_reserve(total)
            self.tail_k[:, :, self.tail_len : total] = k
            self.tail_v[:, :, self.tail_len : total] = v
        else:
            if self.tail_len:
                k = torch.cat([self.tail_k[:, :, : self.tail_len], k], dim=2)
                v = torch.cat([self.tail_v[:, :, : self.tail_len], v], dim=2)
            self._quantize_into_store(k[:, :, :n_flush], v[:, :, :n_flush])
            rest = total - n_flush
            self._tail_reserve(rest)
            self.tail_k[:, :, :rest] = k[:, :, n_flush:]
            self.tail_v[:, :, :rest] = v[:, :, n_flush:]
        self.tail_len = total - n_flush
        self.seq_len += n
        if self.is_sliding and not self.record_past:
            self._evict()

    def _tail_reserve(self, n: int) -> None:
        if n > self.tail_k.shape[2]:
            grow = max(n, 2 * self.tail_k.shape[2])
            for name in ("tail_k", "tail_v"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], grow, old.shape[3])
                new[:, :, : self.tail_len] = old[:, :, : self.tail_len]
                setattr(self, name, new)

    def _recent_stores(self) -> tuple[TokenStore, ...]:
        return () if self.rk_store is None else (self.rk_store, self.rv_store)

    def _quantize_into_store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k, v [B, H, n, D]`` (positions ``[store_end, store_end + n)``) into the store."""
        n = k.shape[2]
        self._reserve(self.store_end + n)
        if self.config.smoothing != "none":
            k = self._smooth(k)
        if self.config.rotation == "hadamard":
            k, v = rotate(k), rotate(v)
        w = self.config.recent_length
        if not w:
            self._write(self.k_store, self.v_store, self.store_end - self.base, k, v)
            self.store_end += n
            self.main_end = self.store_end
            return
        end = self.store_end + n
        main_end = max(self.main_end, end - w)
        # recent tokens W newer ones have pushed out, then new tokens already that old: main stores
        leave = max(min(self.store_end, main_end) - self.main_end, 0)
        direct = max(main_end - self.store_end, 0)
        if leave + direct:
            rk, rv = self.rk_store, self.rv_store
            parts_k = ([rk.read(0, leave, k.dtype)] if leave else []) + [k[:, :, :direct]]
            parts_v = ([rv.read(0, leave, v.dtype)] if leave else []) + [v[:, :, :direct]]
            self._write(
                self.k_store,
                self.v_store,
                self.main_end - self.base,
                torch.cat(parts_k, 2),
                torch.cat(parts_v, 2),
            )
        kept = self.store_end - self.main_end - leave  # recent tokens that stay
        fresh = end - max(self.store_end, main_end)  # new tokens that enter the recent stores
        for store in self._recent_stores():
            if leave and kept:
                store.move(leave, leave + kept, 0)
            if kept + fresh > store.capacity:
                store.grow(kept + fresh, kept)
        if fresh:
            self._write(self.rk_store, self.rv_store, kept, k[:, :, n - fresh :], v[:, :, n - fresh :])
        self.main_end = main_end
        self.store_end = end

    def _write(self, ks: TokenStore, vs: TokenStore, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize (smoothed, rotated) ``k, v [B, H, n, D]`` into ``ks, vs`` at buffer index ``index``."""
        native = native_quantizes(ks, k) and native_quantizes(vs, v)  # both or neither: no work twice
        if native and quantize_into_store(ks, index, k) and quantize_into_store(vs, index, v):  # CPU: C
            return
        same = (ks.fmt, ks.group_size, ks.axis, ks.static_scale) == (vs.fmt, vs.group_size, vs.axis, None)
        if same and ks.static_scale is None and k.shape == v.shape:  # one quantize call for K and V
            both = ks.quantize(torch.cat([k, v], dim=0))
            b = k.shape[0]
            ks.write(
                index,
                QuantizedBlock(*(None if t is None else t[:b] for t in (both.codes, both.scale, both.zero))),
            )
            vs.write(
                index,
                QuantizedBlock(*(None if t is None else t[b:] for t in (both.codes, both.scale, both.zero))),
            )
        else:
            ks.write(index, ks.quantize(k))
            vs.write(index, vs.quantize(v))

    # ------------------------------------------------------------------------------------ smoothing

    def _smoothing_stats(self, k: torch.Tensor, t0: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-(row, head) channel mean (and std) of keys ``k`` at positions ``[t0, t0 + n)``,
        padding and sink tokens excluded (a row with none of its own tokens gets mean 0, std 1)."""
        n = k.shape[2]
        pos = torch.arange(t0, t0 + n, device=k.device)
        first = self.pads + self.config.sink_tokens  # [B] first position that is neither pad nor sink
        w = (pos[None, :] >= first[:, None]).float()[:, None, :, None]  # [B, 1, n, 1]
        count = w.sum(2, keepdim=True)  # [B, 1, 1, 1]
        sdt = self.config.torch_scale_dtype
        x = k.float()
        mean = (x * w).sum(2, keepdim=True) / count.clamp_min(1)  # [B, H, 1, D]
        if self.config.smoothing != "channel":
            return mean.to(sdt), None
        std = ((((x - mean) ** 2) * w).sum(2, keepdim=True) / count.clamp_min(1)).sqrt()
        floor = std.mean(-1, keepdim=True) * 1e-2 + torch.finfo(sdt).tiny  # no channel collapses
        std = torch.where(count > 1, torch.maximum(std, floor), torch.ones_like(std))
        return mean.to(sdt), round_to_dtype(std, sdt, +1)

    def _smooth(self, k: torch.Tensor) -> torch.Tensor:
        """``(k - mean) / std`` (statistics fixed by the first call)."""
        if self.smooth is None:
            self.smooth = self._smoothing_stats(k, self.store_end)
        mean, std = self.smooth
        k = k.float() - mean.float()
        return k if std is None else k / std.float()

    def _unsmooth(self, k: torch.Tensor) -> torch.Tensor:
        mean, std = self.smooth
        if std is not None:
            k = k * std.float()
        return k + mean.float()

    def _reserve(self, end_position: int) -> None:
        """Room in the store up to ``end_position``: compact dropped positions first, else grow."""
        needed = end_position - self.base
        cap = self.k_store.capacity
        if needed <= cap:
            return
        shift = (self.store_begin - self.base) // self.block * self.block
        if shift and needed - shift <= cap and shift >= cap // 2:
            used = self.store_end - self.base
            for store in (self.k_store, self.v_store):
                store.move(shift, used, 0)
            self.base += shift
            return
        used = self.store_end - self.base
        for store in (self.k_store, self.v_store):
            store.grow(needed, used)

    def _evict(self) -> None:
        """Sliding layers: drop positions no later query can see."""
        keep_from = max(self.seq_len - (self.sliding_window - 1), 0)
        self.store_begin = max(self.store_begin, min(keep_from, self.store_end))
        if self.sink_k is not None and keep_from >= self.pads_max + self.config.sink_tokens:
            self.sink_k = self.sink_v = None  # every sink token has left the window

    # ------------------------------------------------------------------------------------ sinks / padding

    def _set_pads(self, position_ids: torch.Tensor | None, n: int) -> None:
        """Left padding per row from the prompt's position ids (last position + 1 = real tokens)."""
        b = self.pads.shape[0]
        if position_ids is not None and position_ids.dim() == 3:
            position_ids = position_ids[0]
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (b, n):
            self.pads.zero_()
        else:
            last = position_ids[:, -1].to(self.pads.device)
            self.pads = (n - 1 - last).clamp(0, n)
        self.pads_max = int(self.pads.max()) if b else 0

    def _capture_sinks(self, k: torch.Tensor, v: torch.Tensor, t0: int) -> None:
        """Copy the sink tokens of each row found among positions ``[t0, t0 + n)``."""
        s = self.config.sink_tokens
        if self.sink_k is None or t0 >= self.pads_max + s:
            return
        n = k.shape[2]
        rel = self.pads[:, None] + torch.arange(s, device=k.device) - t0  # [B, S]
        valid = ((rel >= 0) & (rel < n))[:, None, :, None]
        idx = rel.clamp(0, n - 1)[:, None, :, None]
        for sink, new in ((self.sink_k, k), (self.sink_v, v)):
            got = new.gather(2, idx.expand(-1, new.shape[1], -1, new.shape[3]))
            sink.copy_(torch.where(valid, got, sink))

    def _apply_sinks(self, x: torch.Tensor, t0: int, sink: torch.Tensor | None) -> torch.Tensor:
        """Replace, in ``x[B, H, n, D]`` holding positions ``[t0, t0 + n)``, the sink positions."""
        s = self.config.sink_tokens
        if sink is None or t0 >= self.pads_max + s or x.shape[2] == 0:
            return x
        m = min(x.shape[2], self.pads_max + s - t0)
        slot = torch.arange(m, device=x.device) + t0 - self.pads[:, None]  # [B, m]
        is_sink = ((slot >= 0) & (slot < s))[:, None, :, None]
        got = sink.gather(2, slot.clamp(0, s - 1)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
        x[:, :, :m] = torch.where(is_sink, got, x[:, :, :m])
        return x

    # ------------------------------------------------------------------------------------ reads

    def read_store(self, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of stored positions ``[p0, p1)`` (sinks applied, rotation undone)."""
        smoothed = self.smooth is not None
        kdt = torch.float32 if smoothed else self.dtype
        split = min(max(self.main_end, p0), p1)  # [p0, split) main stores, [split, p1) recent ones
        i0, i1 = p0 - self.base, split - self.base
        k, v = self.k_store.read(i0, i1, kdt), self.v_store.read(i0, i1, self.dtype)
        if split < p1:
            i0, i1 = split - self.main_end, p1 - self.main_end
            k = torch.cat([k, self.rk_store.read(i0, i1, kdt)], 2)
            v = torch.cat([v, self.rv_store.read(i0, i1, self.dtype)], 2)
        if self.config.rotation == "hadamard":
            k, v = unrotate(k), unrotate(v)
        if smoothed:
            k = self._unsmooth(k).to(self.dtype)
        return self._apply_sinks(k, p0, self.sink_k), self._apply_sinks(v, p0, self.sink_v)

    def read_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[B, H, n, D]`` of every position the next call attends to (before its own tokens)."""
        begin = self.history_begin()
        parts_k, parts_v = [], []
        if begin < self.store_end:
            k, v = self.read_store(begin, self.store_end)
            parts_k.append(k)
            parts_v.append(v)
        t0 = max(begin - self.store_end, 0)
        parts_k.append(self.tail_k[:, :, t0 : self.tail_len])
        parts_v.append(self.tail_v[:, :, t0 : self.tail_len])
        if len(parts_k) == 1:  # a copy: the tail buffer is shifted in place by the next append
            return parts_k[0].clone(), parts_v[0].clone()
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    # ------------------------------------------------------------------------------------ generate hooks

    def activate_past_recording(self) -> None:
        self.record_past = True

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
        if self.is_sliding and new_len < self.seq_len:
            needed = max(new_len - (self.sliding_window - 1), 0)
            if needed < self.store_begin:
                raise RuntimeError(
                    "crop: this sliding-window layer no longer holds the positions needed after the crop; "
                    "call activate_past_recording() before generating if you need to roll back"
                )
        if new_len >= self.store_end:
            self.tail_len = new_len - self.store_end
        else:
            aligned = self.base + (new_len - self.base) // self.block * self.block
            aligned = max(aligned, self.store_begin)
            k, v = self.read_store(aligned, new_len)
            self.store_end = aligned
            self.main_end = min(self.main_end, aligned)
            self.store_begin = min(self.store_begin, aligned)
            self._tail_reserve(new_len - aligned)
            self.tail_k[:, :, : new_len - aligned] = k
            self.tail_v[:, :, : new_len - aligned] = v
            self.tail_len = new_len - aligned
        self.seq_len = new_len
        if self.is_sliding:
            self._evict()

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for store in (self.k_store, self.v_store, *self._recent_stores()):
            store.map_batch(fn)
        for name in ("tail_k", "tail_v", "sink_k", "sink_v", "pads"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        if self.smooth is not None:
            self.smooth = tuple(None if t is None else fn(t) for t in self.smooth)
        self.pads_max = int(self.pads.max()) if self.pads.numel() else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder rows of codes, scales, tail and sinks (no dequantize / requantize)."""
        if self.is_initialized:
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

    # ------------------------------------------------------------------------------------ memory

    def held_tokens(self) -> int:
        """Positions this layer holds data for (store + tail)."""
        return (self.store_end - self.store_begin) + self.tail_len if self.is_initialized else 0

    def nbytes(self) -> dict[str, int]:
        """Bytes of the valid tokens, by part: ``store`` (codes, scales, zero points), ``tail``, ``sink``."""
        if not self.is_initialized:
            return {"store": 0, "tail": 0, "sink": 0}
        i0, i1 = self.store_begin - self.base, self.main_end - self.base
        store = self.k_store.nbytes(i0, i1) + self.v_store.nbytes(i0, i1)
        r0, r1 = max(self.store_begin - self.main_end, 0), self.store_end - self.main_end
        store += sum(s.nbytes(r0, r1) for s in self._recent_stores())
        tail = self.tail_len * (self.tail_k[:, :, :1].numel() * self.tail_k.element_size()) * 2
        sink = 0
        if self.sink_k is not None:
            held = (self.seq_len - self.pads).clamp(0, self.config.sink_tokens).sum().item()
            per = self.sink_k.shape[1] * self.sink_k.shape[3] * self.sink_k.element_size()
            sink = int(held) * per * 2
        if self.smooth is not None:
            store += sum(_nbytes(t) for t in self.smooth)
        return {"store": store, "tail": tail, "sink": sink}

    def reserved_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        stores = sum(s.reserved_bytes() for s in (self.k_store, self.v_store, *self._recent_stores()))
        fp = sum(_nbytes(t) for t in (self.tail_k, self.tail_v, self.sink_k, self.sink_v))
        if self.smooth is not None:
            fp += sum(_nbytes(t) for t in self.smooth)
        return stores + fp

    def fp16_bytes(self) -> int:
        """Bytes an fp16 cache would hold for the same positions (K and V)."""
        if not self.is_initialized:
            return 0
        b, h, _, d = self.tail_k.shape
        return self.held_tokens() * b * h * d * 2 * 2
