"""``kvquant demo``: generate with an int4 cache beside a full-precision one; report memory and quality.

Runs offline on the embedded SmolLM2. Quality is measured with the cache in the loop: the
full-precision continuation is fed back token by token through each cache (teacher forcing) and the
next-token distributions are compared (KL divergence, top-1 agreement). When those numbers make the
config risky (:func:`kvquant.eval.preflight.risk_warning`, the line ``kvquant check`` and ``kvquant
sweep`` print) the demo prints the warning: free, from numbers it measures anyway. ``--check`` runs
``kvquant check``'s corpus preflight too (about 20-25 s more on a 2-core CPU; off by default).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from kvquant.attention import enable
from kvquant.cache import KVQuantCache
from kvquant.config import KVQuantConfig
from kvquant.eval.caches import cache_nbytes_16bit
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.eval.preflight import preflight, risk_warning
from kvquant.eval.quality import compare
from kvquant.memory import format_bytes_per_token
from kvquant.models import load_model, weights_label

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


def run(
    model_name: str | None, prompt: str | None, max_new_tokens: int, preset: str, check: bool = False
) -> int:
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an integer >= 1, got {max_new_tokens}")
    prompt = prompt or DEMO_PROMPT
    try:  # a bad preset fails before the model loads
        KVQuantConfig.resolve(preset)
    except ValueError as exc:
        raise ValueError(f"--cache: {exc}") from None
    start = time.perf_counter()
    try:
        model, tok = load_model(model_name)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None
    print(f"loaded {weights_label(model_name)} in {time.perf_counter() - start:.1f} s")
    enable(model)  # the fused `kvquant` attention: decode reads codes, never a rebuilt history
    messages = [{"role": "user", "content": prompt}]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ids = ids["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids  # [1, T]

    # speed: both caches treated alike. An untimed short generation each first (first-call costs such
    # as kernel set-up and allocator growth fall there, not on whichever cache happens to run first),
    # then two timed generations each in the order A B B A (drift in machine load hits both); the
    # faster of each cache's two is reported.
    warm = min(max_new_tokens, 8)
    _generate(model, ids, DynamicCache(config=model.config), warm)
    _generate(model, ids, KVQuantCache(model, preset), warm)
    builds = {
        "ref": lambda: DynamicCache(config=model.config),
        "q": lambda: KVQuantCache(model, preset),
    }
    runs: dict[str, list] = {"ref": [], "q": []}
    for which in ("ref", "q", "q", "ref"):
        cache_ = builds[which]()
        out_, seconds = _generate(model, ids, cache_, max_new_tokens)
        runs[which].append((seconds, out_, cache_))
    ref_s, ref_out, ref_cache = min(runs["ref"], key=lambda r: r[0])
    q_s, out, cache = min(runs["q"], key=lambda r: r[0])
    n_ref, n_q = ref_out.shape[1] - ids.shape[1], out.shape[1] - ids.shape[1]

    print(f"\n[DynamicCache] {n_ref} tokens, {n_ref / ref_s:.1f} tok/s")
    print(tok.decode(ref_out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    print(f"\n[KVQuantCache {preset!r}] {n_q} tokens, {n_q / q_s:.1f} tok/s")
    print(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    print(f"(speed: each cache warmed up by an untimed {warm}-token run; the faster of two timed runs, ABBA)")

    # memory, like with like: both caches as a 16-bit model holds them, for the same positions (a
    # float32 model keeps full-precision tokens at 4 bytes; a deployment runs bf16 / fp16)
    held = cache.get_seq_length()
    fp16 = cache.fp16_bytes()  # a 16-bit DynamicCache's bytes for the positions `cache` holds
    q16 = cache_nbytes_16bit(cache)
    print(f"\nmemory ({held} tokens, 16-bit model)")
    print(f"  DynamicCache: {fp16 / 1024:.0f} KiB")
    cfg = model.config.get_text_config(decoder=True)
    theory = format_bytes_per_token(cache.quant_config, cfg.num_key_value_heads, cfg.head_dim)
    print(
        f"  {preset}: {q16 / 1024:.0f} KiB ({q16 / fp16:.3f}x; {16 * q16 / fp16:.2f} effective bits per "
        f"element vs 16, format alone {8 * theory / (cfg.num_key_value_heads * cfg.head_dim * 2):.2f})"
    )
    if model.dtype not in (torch.float16, torch.bfloat16):
        fp_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in ref_cache.layers)
        print(
            f"  (this {str(model.dtype).removeprefix('torch.')} model's own caches: DynamicCache "
            f"{fp_bytes / 1024:.0f} KiB for {ref_cache.get_seq_length()} tokens, {preset} "
            f"{cache.nbytes() / 1024:.0f} KiB)"
        )

    # quality: teacher-force the full-precision continuation through both caches
    prefix = ids.shape[1]
    base = teacher_forced_logprobs(model, ref_out, prefix, DynamicCache(config=model.config))
    test = teacher_forced_logprobs(model, ref_out, prefix, KVQuantCache(model, preset))
    res = compare(base, test, ref_out[:, prefix:])
    print("\nquality (teacher-forced over the full-precision continuation)")
    print(
        f"  mean KL {res['kl_mean']:.4f} (p90 {res['kl_p90']:.4f}), top-1 agreement "
        f"{100 * res['top1_agreement']:.1f}%, ppl {res['ppl_base']:.3f} -> {res['ppl']:.3f} "
        f"over {res['tokens']} tokens"
    )
    warning = risk_warning(res, preset, model_name or "smollm2")
    if check:
        pre = preflight(model, tok, preset)
        q = pre["quality"]
        print(
            f"\npreflight (kvquant check: {pre['windows']} windows of {pre['prefix_len']} + {pre['score_len']} "
            f"tokens of the embedded corpus)\n  mean KL {q['kl_mean']:.4f}, top-1 {100 * q['top1_agreement']:.1f}%, "
            f"Δppl {100 * q['delta_ppl_rel']:+.2f}% over {q['tokens']} tokens"
        )
        warning = warning or risk_warning(q, preset, model_name or "smollm2")
    if warning:
        print(warning)
    return 0
