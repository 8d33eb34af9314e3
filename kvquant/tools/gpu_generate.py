"""Part 4 of the GPU check (:mod:`kvquant.tools.gpu_check`): ``model.generate`` with a Llama-shaped
random model under the ``kvquant`` attention, for DynamicCache and a few presets, each after an
untimed warm-up generate: prefill seconds, decode tokens/s (timed by a streamer between the first
and the last new token), peak CUDA memory and cache bytes, written to ``generate.json`` after every
contender. ``gpu_check`` runs it in its own process (``--part generate``) under a time limit.

Example:
    >>> run_generate(Path("/tmp/gc"), "cpu", tiny=True, budget=60.0)   # a tiny model, on CPU
    0
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

PRESETS = ["int4", "nuq4", "fp8", "tcq2-recent"]
LLAMA = dict(  # Llama-3-8B-shaped layers, fewer of them; transformers' default init (std 0.02)
    num_hidden_layers=8, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=65536,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FULL = dict(prompt=32768, new_tokens=64, warm_prompt=512, dtype="bfloat16")
TINY = dict(prompt=48, new_tokens=8, warm_prompt=16, dtype="float32")


class _Clock:
    """A ``generate`` streamer that notes the time of every ``put`` (the prompt, then each token)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _model(tiny: bool, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvquant.attention import enable
    from kvquant.models import tiny_config

    cfg = tiny_config("llama") if tiny else AutoConfig.for_model("llama", **LLAMA)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return enable(model)


def _one_generate(
    model, cache, ids: torch.Tensor, new: int, device: torch.device
) -> tuple[_Clock, torch.Tensor]:
    clock = _Clock(device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
            min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0,
        )  # fmt: skip
    return clock, out


def run_generate(
    out: Path,
    device: str,
    tiny: bool,
    budget: float,
    prompt: int | None = None,
    new_tokens: int | None = None,
) -> int:
    """Part 4 (its own process): writes ``generate.json`` after every contender."""
    from transformers import DynamicCache

    from kvquant.cache import KVQuantCache
    from kvquant.eval.caches import cache_nbytes

    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda":
        # cuDNN's SDPA took ~7.6 ms of host time per decode call on an H200 with torch 2.11 (the key
        # length changes every step) and made DynamicCache host-bound (profile in docs/measured.md);
        # flash / memory-efficient SDPA remain.
        torch.backends.cuda.enable_cudnn_sdp(False)
    shape = dict(TINY if tiny else FULL)
    shape.update({k: v for k, v in (("prompt", prompt), ("new_tokens", new_tokens)) if v})
    model = _model(tiny, dev, getattr(torch, shape["dtype"]))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab - 1, (1, shape["prompt"]), generator=gen).to(dev)  # [1, T]
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    model_meta = {k: getattr(model.config, k, None) for k in keys}
    meta = {"device": str(dev), "model": model_meta, **shape, "tiny": tiny, "cudnn_sdpa": False}
    contenders = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    contenders |= {p: (lambda p=p: KVQuantCache(model, p)) for p in PRESETS}
    rows: list[dict] = []
    last = 0.0
    for name, build in contenders.items():
        spent = time.perf_counter() - t0
        if spent + 1.5 * last > budget:
            rows.append({"cache": name, "status": f"skipped: {spent:.0f} s spent of {budget:.0f} s"})
            continue
        t1 = time.perf_counter()
        try:
            _one_generate(model, build(), ids[:, : shape["warm_prompt"]], 4, dev)  # compiles, untimed
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            cache = build()
            clock, tokens = _one_generate(model, cache, ids, shape["new_tokens"], dev)
            t = clock.times  # the prompt, then one time per new token
            n = tokens.shape[1] - ids.shape[1]
            row = {
                "cache": name,
                "status": "ok",
                "new_tokens": n,
                "prefill_s": t[1] - t[0],
                "decode_tok_s": (len(t) - 2) / (t[-1] - t[1]) if len(t) > 2 else None,
                "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
                "cache_mib": cache_nbytes(cache) / 2**20,
            }
            del cache
        except Exception as e:  # report it, keep going
            row = {"cache": name, "status": f"failed: {type(e).__name__}: {' '.join(str(e).split())}"[:300]}
        last = time.perf_counter() - t1
        row["seconds"] = round(last, 1)
        rows.append(row)
        base = next((r for r in rows if r["cache"] == "DynamicCache" and r["status"] == "ok"), None)
        for r in rows:
            ok = base and r.get("decode_tok_s") and base.get("decode_tok_s")
            r["vs_dynamic"] = r["decode_tok_s"] / base["decode_tok_s"] if ok else None
        meta["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "generate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(json.dumps(row), flush=True)
    return 0
