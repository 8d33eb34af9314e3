"""``QuantizedKVLayer``: one layer of a :class:`~kvquant.KVQuantCache`, a pipeline of tiers.

Tiers, oldest to newest (:mod:`kvquant.cache.segments`): the main quantized store, the recent
window (``recent_length`` > 0: finer formats), the full-precision tail (``residual_length``), and
each row's first ``sink_tokens`` real tokens in full precision beside them. The layer only moves
tokens: new ones enter the tail; what ages out of it is put through the key transform
(:mod:`kvquant.transforms`, fitted on the first tokens that leave) and pushed into the recent window,
whose overflow goes on to the main store. ``SlidingKVLayer`` (:mod:`kvquant.cache.sliding`) also evicts positions no later query
can see.

``update`` returns, for any attention implementation, the dequantized history of the positions
cached *before* the call followed by the call's own fresh full-precision keys / values; under the
``kvquant`` attention it returns a :class:`~kvquant.cache.view.KVView` of the tiers instead.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvquant.cache.edits import LayerEdits
from kvquant.cache.segments import UPFRONT_TOKENS, QuantizedSegment, SinkSegment, TailSegment
from kvquant.cache.state_checks import check_layout
from kvquant.cache.store import TokenStore
from kvquant.cache.view import DequantizedKV, KVView, view_of
from kvquant.config import KVQuantConfig
from kvquant.kernels import ops
from kvquant.transforms import KeyTransform


class QuantizedKVLayer(LayerEdits, DequantizedKV, CacheLayerMixin):
    """Quantized cache layer of a full-attention layer (see the module docstring).

    Args:
        config: this layer's resolved :class:`KVQuantConfig` (no ``layer_overrides``).
        static_scales: optional ``(key_scale[H_kv], value_scale[H_kv])``.
        initial_capacity: tokens the main store is first allocated for (it grows by doubling).
        key_map: optional ``[H_kv, D, D]`` map of the keys before they are rotated and stored
            (:mod:`kvquant.key_map`; shared, never modified).
        query_rms: optional ``[H_kv, D]`` query channel sizes for ``smoothing: query``
            (:func:`kvquant.query_scales.query_channel_rms`; shared, never modified).

    Example:
        >>> layer = QuantizedKVLayer(KVQuantConfig.resolve("int4"))
        >>> k = v = torch.randn(1, 2, 40, 64)                    # [B, H_kv, T, D]
        >>> hist_k, hist_v = layer.update(k, v)                 # the call's own tokens come back
        >>> layer.get_seq_length(), layer.store_end             # 40 seen, 24 quantized (16 in the tail)
        (40, 24)
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    sliding_window: int | None = None

    def __init__(
        self,
        config: KVQuantConfig,
        static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        initial_capacity: int = 256,
        key_map: torch.Tensor | None = None,
        query_rms: torch.Tensor | None = None,
    ):
        super().__init__()
        self.config = config
        self.static_scales = static_scales
        self.key_map = key_map
        self.query_rms = query_rms
        self.initial_capacity = max(1, initial_capacity)
        self.record_past = False
        self.return_view = False  # set by KVQuantCache when the model runs the `kvquant` attention
        self._clear()

    # ------------------------------------------------------------------------------------ state

    def _clear(self) -> None:
        cfg = self.config
        self.is_initialized = False
        self._accepted = None  # the layout of the last states _check_states took in full
        self.keys = self.values = None
        self.seq_len = 0  # positions seen (what get_seq_length reports)
        self.main: QuantizedSegment | None = None
        self.recent: QuantizedSegment | None = None
        self.tail = TailSegment(cfg.residual_length, cfg.tail_block)
        self.sinks = SinkSegment(cfg.sink_tokens) if cfg.sink_tokens else None
        self.transform = KeyTransform(
            cfg.rotation, cfg.smoothing, cfg.torch_scale_dtype, self.key_map, self.query_rms
        )
        self.pads: torch.Tensor | None = None  # [B] left-padding length of each row
        self.pads_max = 0
        self.plans: dict = {}  # the kvquant attention's decode plan for these tiers (see KVView.plans)
        self._step: tuple | None = None  # (buffer ids, ops.plan_append_step run or None) (_append_step)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        dv = value_states.shape[3]
        cfg = self.config
        if self.key_map is not None and tuple(self.key_map.shape) != (h, d, d):
            raise ValueError(
                f"key_map: this layer's map is {tuple(self.key_map.shape)}; its keys need "
                f"[kv_heads, head_dim, head_dim] = [{h}, {d}, {d}]"
            )
        if self.query_rms is not None and tuple(self.query_rms.shape) != (h, d):
            raise ValueError(
                f"query_rms: this layer's query sizes are {tuple(self.query_rms.shape)}; its keys need "
                f"[kv_heads, head_dim] = [{h}, {d}]"
            )
        self.device, self.dtype, self.head_dim, self.kv_heads = key_states.device, key_states.dtype, d, h
        self.value_head_dim = dv
        kg, vg = cfg.group_sizes(d)[0], cfg.group_sizes(dv)[1]
        sdt = cfg.torch_scale_dtype
        sk, sv = self.static_scales if self.static_scales is not None else (None, None)
        self.main = QuantizedSegment(
            TokenStore(cfg.key_format, kg, cfg.key_axis, sdt, sk),
            TokenStore(cfg.value_format, vg, "token", sdt, sv),
        )
        self.main.allocate(b, h, d, self.initial_capacity, self.dtype, self.device, dv)
        if cfg.recent_length:
            self.recent = QuantizedSegment(
                TokenStore(cfg.recent_key_format, kg, "token", sdt),
                TokenStore(cfg.recent_value_format, vg, "token", sdt),
                limit=cfg.recent_length,
            )
            self.recent.allocate(
                b, h, d, 2 * min(cfg.recent_length, UPFRONT_TOKENS), self.dtype, self.device, dv
            )
        self.tail.allocate(key_states, value_states)
        if self.sinks is not None:
            self.sinks.allocate(key_states, value_states)
        self.pads = torch.zeros(b, dtype=torch.long, device=self.device)
        self.pads_max = 0
        self.is_initialized = True

    def reset(self) -> None:
        self._clear()

    @property
    def tiers(self) -> tuple[QuantizedSegment, ...]:
        """The quantized tiers, oldest first (main store, then the recent window if any)."""
        if self.recent is None:
            return () if self.main is None else (self.main,)
        return self.main, self.recent

    @property
    def store_end(self) -> int:
        """End of the quantized positions (the tail holds ``[store_end, seq_len)``)."""
        return self.tail.begin

    @property
    def store_begin(self) -> int:
        """First quantized position still held."""
        for s in self.tiers:
            if s.end > s.begin:
                return s.begin
        return self.store_end

    # ------------------------------------------------------------------------------------ sizes

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def history_begin(self) -> int:
        """First position the next forward call attends to."""
        return self.store_begin

    @property
    def batch_size(self) -> int:
        return 0 if self.pads is None else self.pads.shape[0]

    # ------------------------------------------------------------------------------------ update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return ``(history ++ new)`` keys and values ``[B, H, n, D]``.

        With ``return_view`` set (the model runs the ``kvquant`` attention) both return values are
        one :class:`~kvquant.cache.view.KVView` of the tiers instead: nothing is dequantized here.
        Bad states (:func:`~kvquant.cache.state_checks.check_layout`, non-finite values) raise before
        anything is stored.
        """
        self._check_states(key_states, value_states)
        # a decode step's values are checked where they are appended: the planned step checks them in
        # its own pass (nothing written before), the general append first thing
        checked = not (self.is_initialized and key_states.shape[2] == 1)
        if checked:
            ops.check_finite(key_states, value_states)
        return self._update_checked(key_states, value_states, finite_checked=checked, **kwargs)

    def _update_checked(
        self, key_states: torch.Tensor, value_states: torch.Tensor, finite_checked: bool = True, **kwargs
    ):
        """``update`` once the states passed its checks (a ``HeadSplitLayer`` checks every group first);
        ``finite_checked`` False: the append checks their values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        model_kwargs = kwargs.get("kwargs") or {}
        position_ids = model_kwargs.get("position_ids")
        if self.return_view and self.head_dim == self.value_head_dim:  # (the fused decode: one head size)
            view = self.view(key_states, value_states)
            self.append(key_states, value_states, position_ids, finite_checked)
            return view, view
        hist_k, hist_v = self.read_history()
        self.append(key_states, value_states, position_ids, finite_checked)
        if hist_k.shape[2] == 0:
            return key_states, value_states
        return torch.cat([hist_k, key_states], dim=2), torch.cat([hist_v, value_states], dim=2)

    def _check_states(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """:func:`~kvquant.cache.state_checks.check_layout` against what this layer holds (a decode step
        laid out like the last one it took passes at once)."""
        key = None
        if self.is_initialized and type(k) is torch.Tensor and type(v) is torch.Tensor:
            key = (k.shape, v.shape, k.dtype, v.dtype, k.device, v.device, self.batch_size)
            if key == self._accepted:
                return
        held = None
        if self.is_initialized:
            held = (
                self.batch_size,
                self.kv_heads,
                self.head_dim,
                self.value_head_dim,
                self.dtype,
                self.device,
            )
        check_layout(k, v, held)
        self._accepted = key  # (the layout of states this initialized layer has taken)

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        finite_checked: bool = True,
    ) -> None:
        """Add ``k, v [B, H, n, D]`` at positions ``[seq_len, seq_len + n)``; quantize what leaves the tail.
        ``finite_checked`` False: refuse non-finite values (``ValueError``) before anything is stored."""
        if k.shape[2] == 1 and self._append_step(k, v):  # (checks the values itself)
            return
        if not finite_checked:
            ops.check_finite(k, v)
        if k.requires_grad or v.requires_grad:  # the store holds data, never an autograd graph
            k, v = k.detach(), v.detach()
        if self.seq_len == 0:
            self._set_pads(position_ids, k.shape[2])
        if self.sinks is not None:
            self.sinks.capture(k, v, self.seq_len, self.pads, self.pads_max)
        self.plans.pop("stale", None)  # (the last step's view, made before a move, is consumed)
        t0 = self.store_end
        out = self.tail.push(k, v)
        if out is not None:
            before = self._operand_ids()
            if self.transform.needs_fit:
                self.transform.fit(out[0], self._own_tokens(t0, out[0].shape[2]))
            out = self.transform.apply(*out)
            for tier in reversed(self.tiers):  # newest tier first; each passes on what ages out
                out = tier.push(out)
                if out is None:
                    break
            if self._operand_ids() != before:  # a tier moved to new buffers
                self._drop_stale_plan(before)
        self.seq_len += k.shape[2]
        self._after_append()

    def _append_step(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A decode step's append (``k, v [B, H, 1, D]``) in one planned op
        (``ops.plan_append_step``: one C call on CPU) where the step is a steady one: the tail full,
        its oldest token leaving (or, with no tail, the new token itself), and no buffer moving,
        growing or being fitted this step, no sink left to capture. Leaves the state :meth:`append`
        would; False (nothing done): it runs."""
        tail, tiers = self.tail, self.tiers
        held = tail.end - tail.begin
        no_tail = tail.residual == 0  # the token itself enters the first tier
        if (
            not tiers
            or tail.block != 1
            or held != tail.residual
            or (held < 1 and not no_tail)
            or tail.off + held + 1 > tail.k.shape[2]
            or (no_tail and (k.dtype != torch.float32 or v.dtype != torch.float32))
            or k.requires_grad
            or v.requires_grad
            or self.transform.needs_fit
            or (self.sinks is not None and self.sinks.held and self.seq_len < self.pads_max + self.sinks.n)
        ):
            return False
        first, main = tiers[-1], tiers[0]
        if first.end + 1 - first.origin > first.k_store.capacity:
            return False
        move_from = move_to = -1
        if first is not main and first.end - first.low >= first.limit:  # the window's oldest leaves
            if first.end - first.low > first.limit or main.end + 1 - main.origin > main.k_store.capacity:
                return False
            move_from, move_to = first.low - first.origin, main.end - main.origin
        run = self._step_plan(first, main)
        if run is None:
            return False
        if no_tail:
            run(k, v, -1, ops.STEP_NEW_TOKEN, first.end - first.origin, move_from, move_to)
        else:
            run(k, v, tail.off + held, tail.off, first.end - first.origin, move_from, move_to)
            tail.off += 1
        self.plans.pop("stale", None)
        tail.end += 1
        tail.begin += 1
        if move_from >= 0:
            first.low += 1
            main.end += 1
        first.end += 1
        first.begin = max(first.begin, first.low)
        self.seq_len += 1
        self._after_append()
        return True

    def _step_plan(self, first: QuantizedSegment, main: QuantizedSegment):
        """``ops.plan_append_step`` for the tail and tiers' current buffers (made when they or the
        transform's statistics changed since the last step, else the one it ran then; None: no
        backend plans it)."""
        stats = self.transform.step_stats()
        buffers = (self.tail.k, self.tail.v, *stats)
        buffers += tuple(
            t for s in (first.k_store, first.v_store, main.k_store, main.v_store) for t in s.buffers()
        )
        key = tuple(map(id, buffers))
        if self._step is None or self._step[0] != key:
            if (
                self.key_map is not None
                or self.head_dim != self.value_head_dim
                or self.tail.k.dtype != torch.float32
                or self.tail.v.dtype != torch.float32
            ):
                run = None  # (what the planned step takes: fp32 rows, the transform without a key map)
            else:
                move = None
                if first is not main:
                    move = (
                        (first.k_store.source(), first.v_store.source()),
                        (main.k_store.dest(), main.v_store.dest()),
                    )
                run = ops.plan_append_step(
                    (self.tail.k, self.tail.v), stats, self.transform.rotated,
                    (first.k_store.dest(), first.v_store.dest()), move, head_dim=self.head_dim,
                )  # fmt: skip
            self._step = (key, run, buffers)  # (the buffers held: their ids stay theirs)
        return self._step[1]

    def _operand_ids(self) -> list[int]:
        return [id(o) for t in self.tiers for o in t.operands()]

    def _drop_stale_plan(self, stale: list[int]) -> None:
        """A tier moved: forget the decode plan (it holds the old buffers alive), and have the
        attention not keep one for this call's view either, made before the move (``stale``: the
        ids of its operands, alive while that view is: dropped at the next append)."""
        self.plans.clear()
        self.plans["stale"] = frozenset(stale)
        self._step = None

    def _after_append(self) -> None:
        """Hook for subclasses (a sliding layer evicts here)."""

    def _own_tokens(self, t0: int, n: int) -> torch.Tensor:
        """``[B, 1, n, 1]``: 1 where positions ``[t0, t0 + n)`` are a row's own tokens (not padding,
        not sinks): the smoothing statistics are fitted on those."""
        pos = torch.arange(t0, t0 + n, device=self.device)
        first = self.pads + self.config.sink_tokens  # [B]
        return (pos[None, :] >= first[:, None]).float()[:, None, :, None]

    def _set_pads(self, position_ids: torch.Tensor | None, n: int) -> None:
        """Left padding per row from the prompt's position ids (last position + 1 = real tokens)."""
        b = self.pads.shape[0]
        if position_ids is not None and position_ids.dim() == 3:
            position_ids = position_ids[0]
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (b, n):
            self.pads.zero_()
            self.pads_max = 0
            return
        last = position_ids[:, -1].to(self.pads.device)
        self.pads = (n - 1 - last).clamp(0, n)
        self.pads_max = int(self.pads.max()) if b else 0

    # ------------------------------------------------------------------------------------ reads

    def _sinks_back(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        p0: int,
        sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Put the sink values (default: the ones held now) over their slots in ``k, v [B, H, n, D]``
        holding positions ``[p0, p0 + n)``."""
        s = self.sinks
        if sinks is None and (s is None or not s.held):
            return k, v
        sk, sv = (s.k, s.v) if sinks is None else sinks
        return s.apply(k, p0, sk, self.pads, self.pads_max), s.apply(v, p0, sv, self.pads, self.pads_max)

    def read(self, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V ``[B, H, p1 - p0, D]`` of stored positions ``[p0, p1)`` (transform undone,
        sinks put back)."""
        kdt = self.transform.key_dtype(self.dtype)
        parts, lo = [], p0
        for tier in self.tiers:  # each holds the positions up to its end
            hi = min(p1, tier.end)
            if hi > lo:
                parts.append(tier.read(lo, hi, kdt, self.dtype))
                lo = hi
        if not parts:
            parts.append(self.main.read(p0, p0, kdt, self.dtype))
        k = torch.cat([p[0] for p in parts], 2) if len(parts) > 1 else parts[0][0]
        v = torch.cat([p[1] for p in parts], 2) if len(parts) > 1 else parts[0][1]
        k, v = self.transform.undo(k, v)
        return self._sinks_back(k.to(self.dtype), v, p0)

    def read_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[B, H, n, D]`` of every position the next call attends to (before its own tokens)."""
        begin = self.history_begin()
        tail_k, tail_v = self.tail.read(begin)
        if begin >= self.store_end:  # a copy: the tail buffer is shifted in place by the next append
            return tail_k.clone(), tail_v.clone()
        k, v = self.read(begin, self.store_end)
        return torch.cat([k, tail_k], dim=2), torch.cat([v, tail_v], dim=2)

    def view(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """A :class:`~kvquant.cache.view.KVView` of the history before ``k, v`` are appended
        (:func:`~kvquant.cache.view.view_of`)."""
        return view_of(self, k, v)

    # ------------------------------------------------------------------------------------ generate hooks

    def activate_past_recording(self) -> None:
        self.record_past = True

    # ------------------------------------------------------------------------------------ memory

    def leaves(self) -> list[QuantizedKVLayer]:
        """The layers that hold data: this one (a ``HeadSplitLayer`` has one per group of heads)."""
        return [self]

    def formats(self) -> tuple[str, str]:
        """The key and value formats."""
        return self.config.key_format, self.config.value_format

    def held_tokens(self) -> int:
        """Positions this layer holds data for (quantized tiers + tail)."""
        if not self.is_initialized:
            return 0
        return self.store_end - self.store_begin + len(self.tail)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the valid tokens, by part: ``store`` (codes, scales, zero points, smoothing
        statistics), ``tail``, ``sink``."""
        if not self.is_initialized:
            return {"store": 0, "tail": 0, "sink": 0}
        store = sum(t.nbytes() for t in self.tiers) + self.transform.nbytes()
        sink = 0 if self.sinks is None else self.sinks.nbytes(self.seq_len, self.pads, self.pads_max)
        return {"store": store, "tail": self.tail.nbytes(), "sink": sink}

    def reserved_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        parts = [*self.tiers, self.tail] + ([self.sinks] if self.sinks is not None else [])
        return sum(p.reserved_bytes() for p in parts) + self.transform.nbytes()

    def fp16_bytes(self) -> int:
        """Bytes an fp16 cache would hold for the same positions (K and V)."""
        if not self.is_initialized:
            return 0
        b, h, _, d = self.tail.k.shape
        return self.held_tokens() * b * h * (d + self.tail.v.shape[3]) * 2
