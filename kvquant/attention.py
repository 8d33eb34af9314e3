"""The ``kvquant`` attention function: attends over the quantized store without rebuilding it.

``import kvquant`` registers it with transformers' ``AttentionInterface`` together with a mask
function of the same name (``AttentionMaskInterface``; without one a custom attention receives no
mask). Load a model with ``attn_implementation="kvquant"`` or call :func:`enable`; a
``KVQuantCache`` then hands this function a :class:`KVView` of the store instead of dequantized
tensors. Per call:

- decode (one query token): the stored history goes through the fused kernel (Triton on CUDA,
  the chunked torch twin on CPU), the full-precision tokens (sinks, residual tail, the new token)
  through a small dense attention, and the two partials are merged by log-sum-exp;
- prefill of a fresh prompt: SDPA / eager on the prompt's own full-precision K/V;
- a prefill chunk after cached tokens: the history is dequantized and attended with the mask.

Given plain tensors (any other cache, or none) it behaves like ``sdpa`` (``eager`` with softcap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvquant.decode_cpu import decode_attention_torch
from kvquant.native import decode_attention_native, native_available, native_formats_ok
from kvquant.rotation import rotate, unrotate

# formats the Triton decode kernel reads; the others decode through the chunked torch path
KERNEL_FORMATS = ("none", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2")

ATTENTION_NAME = "kvquant"


@dataclass
class KVView:
    """What ``KVQuantCache.update`` returns under the ``kvquant`` attention: the call's own
    full-precision keys / values plus where its history lies in the layer.

    ``hist_begin``: first visible position; ``store_end``: end of the quantized positions before
    the call; ``tail_k / tail_v [B, H, n, D]``: the full-precision tail positions
    ``[tail_begin, seq_before)`` as they were before the call (the call may flush them).
    ``main_end``: end of the positions in the main stores; the recent window
    (``config.recent_length``) ``[max(main_end, hist_begin), store_end)`` comes dequantized as
    ``recent_k / recent_v [B, H, r, D]`` (None when empty), read before the call may re-quantize it,
    and is attended with the full-precision tokens.
    """

    layer: object
    new_k: torch.Tensor
    new_v: torch.Tensor
    hist_begin: int
    store_end: int
    tail_begin: int
    seq_before: int
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    main_end: int | None = None  # None: every stored position is in the main stores
    recent_k: torch.Tensor | None = None
    recent_v: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        b, h, q, d = self.new_k.shape
        return torch.Size((b, h, self.seq_before - self.hist_begin + q, d))

    @property
    def dtype(self) -> torch.dtype:
        return self.new_k.dtype

    @property
    def device(self) -> torch.device:
        return self.new_k.device

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The history (dequantized where stored) followed by the call's tokens: ``[B, H, n, D]``."""
        parts_k, parts_v = [], []
        main_end = _main_end(self)
        if self.hist_begin < main_end:
            k, v = self.layer.read_store(self.hist_begin, main_end)
            parts_k.append(k)
            parts_v.append(v)
        if self.recent_k is not None:
            parts_k.append(self.recent_k)
            parts_v.append(self.recent_v)
        parts_k += [self.tail_k, self.new_k]
        parts_v += [self.tail_v, self.new_v]
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)


# --------------------------------------------------------------------------------------------- dense parts


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention returning ``(out[B, Hq, q, D], lse[B, Hq, q])``.

    ``mask``: bool (True = attend) or additive float, broadcastable to ``[B, Hq, q, n]``.
    """
    n_rep = query.shape[1] // key.shape[1]
    k = _repeat_kv(key.float(), n_rep)
    v = _repeat_kv(value.float(), n_rep)
    scores = (query.float() @ k.transpose(-1, -2)) * scaling  # [B, Hq, q, n]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_safe[..., None])
    return probs @ v, lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine attention partials over disjoint key sets by log-sum-exp weights."""
    lse = torch.stack(lses)  # [P, ...]
    total = torch.logsumexp(lse, dim=0)
    total_safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lse - total_safe)  # [P, ...]
    return sum(w[..., None] * o for w, o in zip(weights, outs, strict=True))


# --------------------------------------------------------------------------------------------- decode


def _native_reads(layer, q: torch.Tensor) -> bool:
    """Whether the C kernel reads this layer's store for ``q`` (CPU, quantized formats, built)."""
    ks, vs = layer.k_store, layer.v_store
    return not q.is_cuda and native_formats_ok(ks.fmt, vs.fmt, q.shape[-1]) and native_available()


def _whole_step_native(view: KVView, q: torch.Tensor) -> bool:
    """Whether the C kernel can take the whole decode step (store and full-precision tokens in one
    softmax): no rotation or smoothing (those transform the store's operands only, so their
    partial is merged with the full-precision one instead)."""
    layer = view.layer
    return layer.config.rotation == "none" and layer.smooth is None and _native_reads(layer, q)


def _main_end(view: KVView) -> int:
    """End of the view's positions held in the layer's main stores (the rest: its recent window)."""
    return view.store_end if view.main_end is None else min(view.store_end, view.main_end)


def _store_partial(view: KVView, q: torch.Tensor, scaling: float, softcap: float | None, fp=None):
    """Attention of ``q[B, Hq, D]`` over the view's positions in the main stores (sinks excluded);
    with ``fp = (k, v, valid)`` (native kernel only) over those full-precision tokens too."""
    layer = view.layer
    sink = layer.config.sink_tokens if layer.sink_k is not None else 0
    first = torch.clamp(layer.pads + sink, min=view.hist_begin)  # [B] first stored position per row
    start = first - layer.base
    end = max(_main_end(view) - layer.base, 0)
    ks, vs = layer.k_store, layer.v_store
    rotated = layer.config.rotation == "hadamard"
    smooth = layer.smooth
    n_rep = q.shape[1] // ks.codes.shape[1]

    def per_query_head(t: torch.Tensor) -> torch.Tensor:  # [B, Hkv, 1, D] -> [B, Hq, D]
        return t[:, :, 0].float().repeat_interleave(n_rep, dim=1)

    q_in = q
    if smooth is not None and smooth[1] is not None:  # keys stored as (k - mean) / std
        q_in = q.float() * per_query_head(smooth[1])
    qr = rotate(q_in) if rotated else q_in
    args = dict(
        k_fmt=ks.fmt,
        v_fmt=vs.fmt,
        k_group=ks.group_size,
        v_group=vs.group_size,
        k_axis=ks.axis,
        start=start,
        end=end,
        scaling=scaling,
        softcap=softcap,
    )
    k_scale = ks.scale if ks.scale is not None else ks.static_scale
    v_scale = vs.scale if vs.scale is not None else vs.static_scale
    tensors = (qr, ks.codes, k_scale, ks.zero, vs.codes, v_scale, vs.zero)
    triton_reads = ks.fmt in KERNEL_FORMATS and vs.fmt in KERNEL_FORMATS and ks.scale_dtype.itemsize > 1
    if q.is_cuda and triton_reads:  # (the Triton kernel reads fp32 / fp16 / bf16 scales)
        from kvquant.kernels import quantized_decode_attention

        out, lse = quantized_decode_attention(*tensors, **args)
    elif fp is not None:  # CPU: the C kernel, the whole step
        out, lse = decode_attention_native(*tensors, **args, fp_k=fp[0], fp_v=fp[1], fp_valid=fp[2])
    elif _native_reads(layer, q):
        out, lse = decode_attention_native(*tensors, **args)  # CPU: the C kernel
    else:  # no C compiler, `none`, or a format the Triton kernel does not read on GPU: chunked torch
        out, lse = decode_attention_torch(*tensors, **args)
    if rotated:
        out = unrotate(out)
    if smooth is not None:
        # scores were q.(k - mean): every stored score is short by q.mean, one constant per query
        # head (exact without softcap; softcap makes _decode take the dequantizing path)
        lse = lse + scaling * (q.float() * per_query_head(smooth[0])).sum(-1)
    return out, lse


def _fp_tokens(view: KVView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The full-precision tokens a decode step attends to: sinks, the recent window (dequantized),
    tail, the new token, as ``k, v [B, H, n, D]`` and ``valid [B, n]`` (False: padding, a sink
    position, or outside the visible history; None when every token is valid)."""
    layer = view.layer
    pads = layer.pads
    sinks = layer.sink_k is not None and view.hist_begin < view.store_end
    n_sink = layer.sink_k.shape[2] if sinks else 0
    r0 = max(_main_end(view), view.hist_begin)  # the recent window: positions [r0, store_end)
    recent = view.recent_k is not None
    k_parts = ([layer.sink_k] if sinks else []) + ([view.recent_k] if recent else [])
    v_parts = ([layer.sink_v] if sinks else []) + ([view.recent_v] if recent else [])
    k = torch.cat(k_parts + [view.tail_k, view.new_k], dim=2)
    v = torch.cat(v_parts + [view.tail_v, view.new_v], dim=2)
    n_sink_slots = layer.sink_k.shape[2] if layer.sink_k is not None else 0
    first = pads + n_sink_slots  # [B] first position that is neither padding nor a sink
    recent_valid = not recent or r0 >= layer.pads_max + n_sink_slots
    if layer.pads_max == 0 and view.hist_begin == 0 and n_sink <= view.store_end and recent_valid:
        return k, v, None  # no padding, nothing scrolled out of view: every token counts
    valid = []
    if sinks:
        pos = pads[:, None] + torch.arange(n_sink, device=pads.device)  # [B, S]
        valid.append((pos >= view.hist_begin) & (pos < view.store_end))
    if recent:
        pos = torch.arange(r0, view.store_end, device=pads.device)
        valid.append(pos[None, :] >= first[:, None])  # sinks are attended from their own buffer
    pos = torch.arange(view.tail_begin, view.seq_before, device=pads.device)  # the tail
    valid.append(pos[None, :] >= pads[:, None])
    valid.append(torch.ones(pads.shape[0], view.new_k.shape[2], dtype=torch.bool, device=pads.device))
    return k, v, torch.cat(valid, dim=1)


def _fp_partial(view: KVView, q: torch.Tensor, scaling: float, softcap: float | None):
    """Attention of ``q[B, Hq, D]`` over the full-precision tokens: sinks, tail, the new token."""
    k, v, valid = _fp_tokens(view)
    mask = None if valid is None else valid[:, None, None, :]
    out, lse = dense_attention(q[:, :, None], k, v, mask, scaling, softcap)
    return out[:, :, 0], lse[:, :, 0]


def _decode(view: KVView, query: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    q = query[:, :, 0]  # [B, Hq, D]
    if view.hist_begin < _main_end(view) and _whole_step_native(view, q):
        out, _ = _store_partial(view, q, scaling, softcap, fp=_fp_tokens(view))
        return out[:, None].to(query.dtype)  # [B, 1, Hq, D]
    outs, lses = [], []
    if view.hist_begin < _main_end(view):
        o, lse = _store_partial(view, q, scaling, softcap)
        outs.append(o)
        lses.append(lse)
    o, lse = _fp_partial(view, q, scaling, softcap)
    outs.append(o)
    lses.append(lse)
    out = merge_partials(outs, lses)  # [B, Hq, D]
    return out[:, None].to(query.dtype)  # [B, 1, Hq, D]


# --------------------------------------------------------------------------------------------- entry


def kvquant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | KVView,
    value: torch.Tensor | KVView,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvquant"``: ``query[B, Hq, q, D]`` -> ``[B, q, Hq, D]``."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    if isinstance(key, KVView):
        view = key
        smoothed_softcap = softcap is not None and view.layer.smooth is not None
        if query.shape[2] == 1 and view.seq_before > 0 and not smoothed_softcap:
            return _decode(view, query, scaling, softcap), None
        if view.seq_before == 0:  # a fresh prompt: its own full-precision K/V
            key, value = view.new_k, view.new_v
        else:  # a chunk after cached tokens (or a smoothed store under softcap): dequantize
            key, value = view.dequantized()
    if softcap is None and dropout == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    mask = attention_mask
    if mask is None and query.shape[2] > 1:
        q_len, n = query.shape[2], key.shape[2]
        mask = torch.ones(q_len, n, dtype=torch.bool, device=query.device).tril(n - q_len)
    out, _ = dense_attention(query, key, value, mask, scaling, softcap)
    return out.transpose(1, 2).to(query.dtype), None


def register() -> None:
    """Register the ``kvquant`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvquant_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a loaded model to the ``kvquant`` attention (returns the model).

    Example:
        >>> model = kvquant.enable(model)
        >>> model.generate(**inputs, cache=KVQuantCache(model.config, "int4"))
    """
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return model
