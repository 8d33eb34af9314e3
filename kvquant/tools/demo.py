"""``kvquant demo``: generate with an int4 cache beside a full-precision one; report memory and quality.

Runs offline on the embedded SmolLM2. Quality is measured with the cache in the loop: the
full-precision continuation is fed back token by token through each cache (teacher forcing) and the
next-token distributions are compared (KL divergence, top-1 agreement).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from kvquant.attention import enable
from kvquant.cache import KVQuantCache
from kvquant.config import KVQuantConfig
from kvquant.eval.decode import compare, teacher_forced_logprobs
from kvquant.memory import format_bytes_per_token
from kvquant.models import load_model

DEMO_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press. Explain in a few paragraphs how "
    "this invention changed the spread of knowledge in Europe."
)


def _generate(model, ids, cache, n):
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False)
    return out, time.perf_counter() - start


def run(model_name: str | None, prompt: str | None, max_new_tokens: int, preset: str) -> int:
    prompt = prompt or DEMO_PROMPT
    KVQuantConfig.resolve(preset)  # a bad preset fails before the model loads
    start = time.perf_counter()
    model, tok = load_model(model_name)
    print(f"loaded {model_name or 'embedded SmolLM2-135M-Instruct'} in {time.perf_counter() - start:.1f} s")
    enable(model)  # the fused `kvquant` attention: decode reads codes, never a rebuilt history
    messages = [{"role": "user", "content": prompt}]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ids = ids["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids  # [1, T]

    ref_cache = DynamicCache(config=model.config)
    ref_out, ref_s = _generate(model, ids, ref_cache, max_new_tokens)
    cache = KVQuantCache(model.config, preset)
    out, q_s = _generate(model, ids, cache, max_new_tokens)
    n_ref, n_q = ref_out.shape[1] - ids.shape[1], out.shape[1] - ids.shape[1]

    print(f"\n[DynamicCache] {n_ref} tokens, {n_ref / ref_s:.1f} tok/s")
    print(tok.decode(ref_out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    print(f"\n[KVQuantCache {preset!r}] {n_q} tokens, {n_q / q_s:.1f} tok/s")
    print(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())

    # memory: what each cache holds for the same positions
    fp_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in ref_cache.layers)
    cfg = model.config.get_text_config(decoder=True)
    held = cache.get_seq_length()
    theory = format_bytes_per_token(cache.quant_config, cfg.num_key_value_heads, cfg.head_dim)
    print("\nmemory")
    print(
        f"  DynamicCache ({model.dtype}): {fp_bytes / 1024:.0f} KiB for {ref_cache.get_seq_length()} tokens"
    )
    print(
        f"  {preset}: {cache.nbytes() / 1024:.0f} KiB for {held} tokens "
        f"({cache.nbytes() / fp_bytes:.3f}x; {cache.effective_bits():.2f} effective bits vs fp16, "
        f"format alone {8 * theory / (cfg.num_key_value_heads * cfg.head_dim * 2):.2f} bits)"
    )

    # quality: teacher-force the full-precision continuation through both caches
    prefix = ids.shape[1]
    base = teacher_forced_logprobs(model, ref_out, prefix, DynamicCache(config=model.config))
    test = teacher_forced_logprobs(model, ref_out, prefix, KVQuantCache(model.config, preset))
    res = compare(base, test, ref_out[:, prefix:])
    print("\nquality (teacher-forced over the full-precision continuation)")
    print(
        f"  mean KL {res['kl_mean']:.4f} (p90 {res['kl_p90']:.4f}), top-1 agreement "
        f"{100 * res['top1_agreement']:.1f}%, ppl {res['ppl_base']:.3f} -> {res['ppl']:.3f} "
        f"over {res['tokens']} tokens"
    )
    return 0
