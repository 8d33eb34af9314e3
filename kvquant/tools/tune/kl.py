"""Decode-mode KL for the tuner: calibration windows prefilled once, then any config's cache in the
loop for the scored tokens (``kvquant eval``'s decode mode).

Example:
    >>> calib = prefill(model, ids, prefix_len=1024)               # ids: [W, 1024 + 64]
    >>> decode_kl(model, calib, KVQuantConfig.resolve("nuq4"))      # mean KL over W x 64 predictions
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvquant.config import KVQuantConfig


@dataclass
class Calibration:
    """Prefilled calibration windows: ``ids[W, P + D]``, the prefix's full-precision ``kv`` per
    layer (``None`` when a layer keeps fewer than ``P`` tokens, e.g. sliding windows: then every run
    prefills again), ``first`` (log-probs of prediction 0, ``[W, 1, V]``) and ``reference``
    (the full-precision cache's log-probs ``[W, D, V]``)."""

    ids: torch.Tensor
    prefix_len: int
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None
    first: torch.Tensor
    reference: torch.Tensor | None = field(default=None, repr=False)


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor, prefix_len: int) -> Calibration:
    """Prefill ``ids[W, P + D]``'s prefixes once (full precision) and decode the reference."""
    from transformers import DynamicCache

    if ids.dim() != 2 or not 0 < prefix_len < ids.shape[1]:
        raise ValueError(
            f"ids: expected [windows, tokens] with 0 < prefix_len ({prefix_len}) < tokens; got {tuple(ids.shape)}"
        )
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[:, :prefix_len].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].float().log_softmax(-1).cpu()
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if any(k is None or k.shape[-2] != prefix_len for k, _ in kv):
        kv = None
    calib = Calibration(ids, prefix_len, kv, first)
    calib.reference = continue_kl(model, calib, cache)
    return calib


def continue_kl(model: Any, calib: Calibration, cache: Any) -> torch.Tensor:
    """Teacher-force the scored tokens through ``cache`` (already holding the prefix): ``[W, D, V]``."""
    from kvquant.eval.decode import continued_logprobs

    return continued_logprobs(model, calib.ids, calib.prefix_len, cache, calib.first[:, 0])


@torch.no_grad()
def decode_logprobs(model: Any, calib: Calibration, quant: KVQuantConfig) -> torch.Tensor:
    """Log-probs ``[W, D, V]`` of the scored tokens with ``quant``'s cache in the loop (decode mode)."""
    from kvquant.cache import KVQuantCache

    cache = KVQuantCache(model, quant)
    if calib.kv is None:
        device = next(model.parameters()).device
        model(
            input_ids=calib.ids[:, : calib.prefix_len].to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    else:
        for i, (k, v) in enumerate(calib.kv):
            cache.update(k, v, i)
    return continue_kl(model, calib, cache)


def decode_kl(model: Any, calib: Calibration, quant: KVQuantConfig) -> float:
    """Mean KL (full precision || ``quant``) over the scored predictions, decode mode."""
    from kvquant.eval.quality import kl_per_prediction

    return kl_per_prediction(calib.reference, decode_logprobs(model, calib, quant)).mean().item()
