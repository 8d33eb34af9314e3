"""The ``kvquant`` attention function: attends over the quantized tiers without rebuilding them.

``import kvquant`` registers it with transformers' ``AttentionInterface`` together with a mask
function of the same name (``AttentionMaskInterface``; without one a custom attention receives no
mask). Load a model with ``attn_implementation="kvquant"`` or call :func:`enable`; a
``KVQuantCache`` then hands this function a :class:`~kvquant.cache.view.KVView` of its tiers
instead of dequantized tensors. Per call:

- decode (one query token): each quantized tier goes through ``kernels.ops.decode_attention``
  (codes and scales read in place; the query folded by the key transform), the full-precision
  tokens (sinks, tail, the new token) ride along in the first call, and the partials are merged by
  log-sum-exp. The fused decode knows only each row's left padding (``KVView.pads``); a mask that
  asks for anything else (a hole: a 0 after a row's first 1, as assisted decoding or a user-given
  mask make; a hidden token the cache holds) is detected by :func:`decode_mask_is_fused` and that
  step goes to the dequantizing path below instead;
- prefill of a fresh prompt: SDPA / eager on the prompt's own full-precision K/V, with the mask;
- a prefill chunk after cached tokens (or a decode step whose mask has holes): the history is
  dequantized and attended with the mask (no mask: lower-right causal).

Given plain tensors (any other cache, or none) it behaves like ``sdpa`` (``eager`` with softcap).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvquant.cache.head_split import HeadSplitView
from kvquant.cache.view import KVView
from kvquant.kernels import ops

ATTENTION_NAME = "kvquant"


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


# --------------------------------------------------------------------------------------------- decode


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``out[B, Hq, ..., D]`` of a softmax with log-sum-exp ``lse[B, Hq, ...]``, re-weighted for one
    more logit per head, ``sinks[Hq]``, that takes weight and brings no value (gpt-oss's attention
    sinks): ``out * e^lse / (e^lse + e^sink)``."""
    if sinks is None:
        return out
    shape = (1, -1) + (1,) * (lse.dim() - 2)
    return out * torch.sigmoid(lse - sinks.float().view(shape))[..., None]


def _decode_plan(view: KVView, head_dim: int, scaling: float, softcap: float | None, fp: bool):
    """The decode plan of ``view``'s tiers (``ops.plan_decode_attention``), made when their buffers
    (or the call's constants) changed since the layer's last step, else the one it ran then."""
    operands = tuple(o for r in view.reads for o in (r.k, r.v))  # the same objects while buffers stay
    key = (tuple(map(id, operands)), head_dim, scaling, softcap, fp, view.transform.rotated)
    memo = view.plans
    if memo.get("key") != key:
        main, *more = [
            ops.SegmentRead(
                *r.k.tensors(),
                *r.v.tensors(),
                k_fmt=r.k.fmt,
                v_fmt=r.v.fmt,
                k_group=r.k.group,
                v_group=r.v.group,
                k_axis=r.k.axis,
                start=r.start,
                end=r.end,
            )
            for r in view.reads
        ]
        kw = main.call_kwargs()
        del kw["start"], kw["end"]
        run = ops.plan_decode_attention(
            *main.tensors(),
            **kw,
            head_dim=head_dim,
            scaling=scaling,
            softcap=softcap,
            fp_tokens=fp,
            extra=tuple(more),
            rotation=view.transform.rotated,
        )
        if not memo.get("stale", frozenset()).isdisjoint(key[0]):  # buffers the layer just left
            return run  # (kept, it would hold them alive until the layer's next step)
        memo.clear()
        memo.update(key=key, operands=operands, run=run)  # (the operands held: their ids stay theirs)
    return memo["run"]


def _decode(
    view: KVView, query: torch.Tensor, scaling: float, softcap: float | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """One query token over the view's tiers and full-precision tokens: ``[B, 1, Hq, D]``."""
    q = query[:, :, 0]  # [B, Hq, D]
    b = q.shape[0]
    valid = view.dense_valid  # [B, n] or None
    if valid is not None:
        new = torch.ones(b, view.new_k.shape[2], dtype=torch.bool, device=valid.device)
        valid = torch.cat([valid, new], dim=1)
    if not view.reads:
        mask = None if valid is None else valid[:, None, None, :]
        out, lse = dense_attention(q[:, :, None], view.fp_k, view.fp_v, mask, scaling, softcap)
        return _with_sinks(out, lse, sinks).transpose(1, 2).to(query.dtype)
    t = view.transform
    # the fp tokens as segments (sinks, tail, the new token); the smoothing and the rotation (of q and
    # the fp tokens in, the output back) folded in the op (a key map: folded here)
    q_in, fp_k, fp_v, smoothing = t.decode_operands(q, view.fp_parts_k, view.fp_parts_v)
    # the main store, then the recent window: all in the same softmax (one C kernel call on CPU)
    reads = view.reads
    run = _decode_plan(view, q.shape[-1], scaling, softcap, any(x.shape[2] for x in fp_k))
    bounds = tuple((r.start, r.end) for r in reads[1:])
    out, lse = run(
        q_in, reads[0].start, reads[0].end, fp_k=fp_k, fp_v=fp_v, fp_valid=valid, extra_bounds=bounds,
        smoothing=smoothing,
    )  # fmt: skip
    if sinks is not None:
        out = _with_sinks(out, t.shift_lse(lse, q, scaling), sinks)  # lse of the model's own scores
    out = out.unsqueeze(1)  # [B, 1, Hq, D]
    return out if out.dtype == query.dtype else out.to(query.dtype)


# --------------------------------------------------------------------------------------------- masks


def decode_mask_is_fused(view: KVView, mask: torch.Tensor | None) -> bool:
    """Whether a decode step's ``mask`` asks for exactly what the fused decode reads.

    The fused decode reads every position of ``view`` but each row's left padding
    (:meth:`KVView.attended`). ``mask`` (the 4-D mask handed to the attention: bool, True = attend,
    or additive float, 0 = attend) must select the same positions for the last query: otherwise (a
    hole, a hidden token the cache holds, a bias that is neither 0 nor -inf, a shape the view does not
    have) the step is answered by the dequantizing path, which applies the mask as given.

    Cost: ``None`` (what transformers passes when no row is padded) is free. Otherwise one ``[B, n]``
    comparison and one host sync, once per forward and mask: the answer is memoised on the mask
    tensor (keyed on the view's positions), so every layer handed the same mask object reuses it
    (layers of one forward share the padding they were filled with). Transformers' own mask
    construction already reads the padding mask on the host once per forward.

    Example:
        >>> view, _ = layer.update(k, v)  # a layer with return_view set, after its prompt; k [B, H_kv, 1, D]
        >>> decode_mask_is_fused(view, None)  # no mask: every row reads all but its padding
        True
    """
    if mask is None:
        return True
    n = view.shape[2]
    key = (view.hist_begin, view.seq_before, n)
    memo = getattr(mask, "_kvquant_fused", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    fused = mask.dim() == 4 and mask.shape[-1] == n and mask.shape[0] in (1, view.new_k.shape[0])
    if fused:
        row, want = mask[:, :, -1], view.attended()[:, None]  # [B or 1, H or 1, n], [B, 1, n]
        if row.dtype == torch.bool and row.shape == want.shape:  # what transformers hands over
            fused = torch.equal(row, want)  # the one host sync
        else:  # additive: 0 where attended, -inf (or the dtype's min) elsewhere, nothing in between
            attend = row if row.dtype == torch.bool else row == 0
            same = attend == want
            if row.dtype != torch.bool:
                same = same & (attend | (row <= torch.finfo(row.dtype).min / 2))
            fused = bool(same.all())  # the one host sync
    try:
        mask._kvquant_fused = (key, fused)
    except (AttributeError, RuntimeError):  # a tensor subclass without attributes: decide per call
        pass
    return fused


def _causal_mask(q_len: int, n: int, device: torch.device) -> torch.Tensor:
    """``[q, n]`` bool, lower-right aligned: query i sees keys ``[0, n - q + i]``."""
    return torch.ones(q_len, n, dtype=torch.bool, device=device).tril(n - q_len)


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
    """Attention function registered as ``"kvquant"``: ``query[B, Hq, q, D]`` -> ``[B, q, Hq, D]``.

    Honours what the model's own attention takes beyond q, k, v and the mask: ``scaling``,
    ``softcap`` (Gemma 2), ``s_aux`` (gpt-oss's attention sinks: one logit per head that takes
    weight and brings no value) and ``position_bias`` (T5: added to the scores; those steps take
    the dequantizing path, a per-key bias being no part of the fused decode).
    """
    if isinstance(key, HeadSplitView):
        return _split_forward(module, query, key, attention_mask, dropout, scaling, **kwargs), None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    sinks = kwargs.pop("s_aux", None)  # [Hq]
    bias = kwargs.pop("position_bias", None)  # [B or 1, Hq, q, n], additive
    if isinstance(key, KVView):
        view = key
        smoothed_softcap = softcap is not None and view.transform.stats is not None
        decode = query.shape[2] == 1 and view.seq_before > 0 and not smoothed_softcap and bias is None
        if decode and decode_mask_is_fused(view, attention_mask):
            return _decode(view, query, scaling, softcap, sinks), None
        if view.seq_before == 0:  # a fresh prompt: its own full-precision K/V
            key, value = view.new_k, view.new_v
        else:  # a chunk after cached tokens, a decode step whose mask has holes, a smoothed store
            key, value = view.dequantized()  # under softcap: dequantize, then the mask as given
    mask, q_len, n = attention_mask, query.shape[2], key.shape[2]
    dense = softcap is not None or dropout != 0.0 or sinks is not None or bias is not None
    if mask is None and q_len > 1 and (dense or q_len < n) and getattr(module, "is_causal", True):
        mask = _causal_mask(q_len, n, query.device)  # sdpa's is_causal would align upper-left
    if not dense:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
    if bias is not None:
        bias = bias[..., -n:].float()  # the keys attended (a cache may hold fewer than the bias covers)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        mask = bias if mask is None else mask[..., -n:].float() + bias
    out, lse = dense_attention(query, key, value, mask, scaling, softcap)
    return _with_sinks(out, lse, sinks).transpose(1, 2).to(query.dtype), None


def _split_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    split: HeadSplitView,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    **kwargs,
) -> torch.Tensor:
    """A layer stored as groups of KV heads (:class:`~kvquant.cache.head_split.HeadSplitView`): each
    group's query heads attend over that group's view, as any layer's would (fused decode included);
    the outputs land in one ``[B, q, Hq, D]``. Per-head inputs (``s_aux``, ``position_bias``, a mask
    with one row per head) are sliced to the group's query heads."""
    b, hq, q_len, _ = query.shape
    out = None
    for i, (_, view) in enumerate(split.parts):
        heads = split.query_heads(i, hq)  # [h * G]
        part_kwargs = dict(kwargs)
        for name in ("s_aux", "position_bias"):
            x = kwargs.get(name)
            if x is not None and x.dim() >= 1 and x.shape[-1 if name == "s_aux" else 1] == hq:
                part_kwargs[name] = x.index_select(0 if name == "s_aux" else 1, heads)
        mask = attention_mask
        if mask is not None and mask.dim() == 4 and mask.shape[1] == hq > 1:
            mask = mask.index_select(1, heads)
        part, _ = kvquant_attention_forward(
            module, query.index_select(1, heads), view, view, mask, dropout, scaling, **part_kwargs
        )  # [B, q, h * G, Dv]
        if out is None:
            out = part.new_empty(b, q_len, hq, part.shape[-1])
        out.index_copy_(2, heads, part)
    return out


def register() -> None:
    """Register the ``kvquant`` attention and mask functions with transformers (idempotent), and
    have a model that would never run it refused when it is loaded with
    ``attn_implementation="kvquant"`` (see :func:`check_dispatches_attention`)."""
    AttentionInterface.register(ATTENTION_NAME, kvquant_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _refuse_at_load()


def _refuse_at_load() -> None:
    """Wrap ``PreTrainedModel.get_correct_attn_implementation`` (where transformers validates the
    requested attention, in ``from_pretrained`` / ``from_config`` / ``set_attn_implementation``,
    before the layers are built) so that ``"kvquant"`` on a model whose modeling code picks its
    attention classes itself raises :func:`check_dispatches_attention`'s ``ValueError`` instead of
    that code's ``KeyError: 'kvquant'`` (Falcon) or a silent no-op (models with one attention)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_kvquant_checked", False):
        return

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        if requested_attention == ATTENTION_NAME:
            check_dispatches_attention(self)
        return original(self, requested_attention, is_init_check)

    get_correct_attn_implementation._kvquant_checked = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a loaded model to the ``kvquant`` attention (returns the model).

    Example:
        >>> model = kvquant.enable(model)
        >>> model.generate(**inputs, cache=KVQuantCache(model, "int4"))
    """
    check_dispatches_attention(model)
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def check_dispatches_attention(model: torch.nn.Module) -> None:
    """``ValueError`` naming the architecture when its modeling code does not call attention through
    transformers' ``AttentionInterface`` (it picks eager / sdpa / flash classes itself, e.g. Falcon,
    GPT-Neo, or has one attention, e.g. Bloom, MPT): the ``kvquant`` attention would never run there.
    A model dispatches when its modeling module looks attention up in ``ALL_ATTENTION_FUNCTIONS`` or
    its class declares ``_supports_attention_backend`` (composite models, e.g. Llava, whose
    language model does the lookup). A ``KVQuantCache`` still works with such a model's own
    attention (it hands it dequantized tensors)."""
    import sys

    module = sys.modules.get(type(model).__module__)
    if getattr(type(model), "_supports_attention_backend", False):
        return
    if module is not None and not hasattr(module, "ALL_ATTENTION_FUNCTIONS"):
        arch = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"model: {arch} does not dispatch attention through transformers' AttentionInterface, so "
            "the kvquant attention cannot run in it; use KVQuantCache with the model's own attention "
            '(load it without attn_implementation="kvquant")'
        )
