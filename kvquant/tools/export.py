"""``kvquant export vllm|sglang``: calibrated static fp8 KV-cache scales, written for a serving engine.

Calibrate (``kvquant calibrate``'s pass: each layer's per-head max ``|k|`` / ``|v|`` over the corpus,
through a full-precision cache), reduce to the engine's granularity (per tensor: the layer's largest
head; per KV head: kept), and write either

- a checkpoint folder: the model's weights as loaded (``save_pretrained``: for the embedded SmolLM2,
  the weights dequantized from its 4-bit GGUF, in the dtype loaded), the tokenizer, ``config.json``
  with the compressed-tensors ``quantization_config`` (:func:`kvquant.engine_scales.quantization_config`)
  and the tensors ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` in the safetensors files (and
  their index, when there is one); or
- with ``scales_only``: ``kv_scales.safetensors`` (those tensors) and ``quantization_config.json``
  (the fragment to merge into an existing checkpoint's ``config.json``).

For SGLang (per tensor only) it also writes ``kv_cache_scales.json`` for ``--quantization-param-path``:
``{"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {rank: {layer: s}}}}``,
one entry per TP rank (the schema SGLang took over from vLLM's ``QuantParamSchema`` asserts as many as
the TP size it runs with), and one scale per layer for keys and values alike (SGLang's loader sets
``k_scale`` and ``v_scale`` of a layer from the same number): the larger of the two.

Then it measures what the engine will store (:func:`kvquant.eval.caches.engine_cache`) against the
full-precision cache on a short corpus window: mean KL, perplexity change, top-1 agreement.

The calibration pass is ``kvquant.tools.calibrate`` (the command runs it, then this module).

Example:
    >>> cfg = KVQuantConfig(key_format="fp8_e4m3", value_format="fp8_e4m3")
    >>> scales = calibrate_static_scales(model, ids, cfg)          # [L, H] per-head amax / 448
    >>> write_export(model, tok, scales, "vllm", "tensor", "out/smollm2-fp8kv")
    >>> measure_engine(model, windows, "out/smollm2-fp8kv", prefix_len=512)["kl_mean"]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvquant.engine_scales import (
    STRATEGIES,
    check_strategy,
    quantization_config,
    reduce_scales,
    scale_tensors,
)

ENGINES = ("vllm", "sglang")
PER_HEAD_NOTE = (
    "note: per-head (attn_head) KV scales are served only by some vLLM attention backends "
    "(FlashAttention 3 on Hopper at the time of writing); others refuse the checkpoint or need "
    "--strategy tensor"
)
SCALES_FILE = "kv_scales.safetensors"
FRAGMENT_FILE = "quantization_config.json"
SGLANG_FILE = "kv_cache_scales.json"


def check_export(engine: str, strategy: str, out: str | Path, tp: int = 1) -> None:
    """Refuse bad settings before any slow work (``ValueError`` naming the flag)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if engine == "sglang" and strategy != "tensor":
        raise ValueError(
            "--strategy: SGLang takes per-tensor fp8 KV scales only; use --strategy tensor "
            "(per-head attn_head scales are for vLLM: kvquant export vllm --strategy attn_head)"
        )
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp: expected an integer >= 1, got {tp!r}")
    path = Path(out).expanduser()
    if path.is_file():
        raise ValueError(f"--out: {str(out)!r} is a file; give a folder")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"--out: folder {str(out)!r} is not empty; give a new or empty folder")


def sglang_scales_json(scales: dict[str, torch.Tensor], model_type: str | None, tp: int = 1) -> dict:
    """The ``--quantization-param-path`` JSON: per layer ``max(k_scale, v_scale)`` (per tensor), the same
    for every one of ``tp`` ranks."""
    reduced = reduce_scales(scales, "tensor")
    per_layer = torch.maximum(reduced["keys"][:, 0], reduced["values"][:, 0])  # [L]
    layers = {str(i): float(s) for i, s in enumerate(per_layer.tolist())}
    return {
        "model_type": model_type,
        "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {str(r): dict(layers) for r in range(tp)}},
    }


def _add_to_checkpoint(folder: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Put ``tensors`` into the checkpoint's safetensors: a new shard listed in the index when the
    checkpoint is sharded, else into its single ``model.safetensors``. Returns the files written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        save_file(tensors, str(folder / SCALES_FILE), metadata={"format": "pt"})
        data["weight_map"].update(dict.fromkeys(tensors, SCALES_FILE))
        meta = data.setdefault("metadata", {})
        if "total_size" in meta:
            meta["total_size"] = int(meta["total_size"]) + sum(
                t.numel() * t.element_size() for t in tensors.values()
            )
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return [SCALES_FILE, index.name]
    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as st:
        meta = st.metadata() or {"format": "pt"}
        state = {name: st.get_tensor(name) for name in st.keys()}  # noqa: SIM118
    clash = sorted(set(state) & set(tensors))
    if clash:
        raise ValueError(f"--out: the checkpoint already holds {clash[0]}")
    save_file({**state, **tensors}, str(single), metadata=meta)
    return [single.name]


def write_export(
    model: Any,
    tokenizer: Any,
    scales: dict[str, torch.Tensor],
    engine: str,
    strategy: str,
    out: str | Path,
    *,
    scales_only: bool = False,
    tp: int = 1,
) -> list[str]:
    """Write calibrated ``[L, H]`` scales for ``engine`` into ``out`` (see the module docstring);
    returns the names of the files written."""
    check_strategy(strategy)
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = scale_tensors(scales, strategy)
    qcfg = quantization_config(strategy)
    written: list[str] = []
    if scales_only:
        from safetensors.torch import save_file

        save_file(tensors, str(folder / SCALES_FILE), metadata={"format": "pt"})
        (folder / FRAGMENT_FILE).write_text(json.dumps({"quantization_config": qcfg}, indent=2) + "\n")
        written += [SCALES_FILE, FRAGMENT_FILE]
    else:
        model.save_pretrained(str(folder), safe_serialization=True)
        written += _add_to_checkpoint(folder, tensors)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(folder))
            written.append("the tokenizer")
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = qcfg
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    if engine == "sglang":
        model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
        payload = sglang_scales_json(scales, model_type, tp)
        (folder / SGLANG_FILE).write_text(json.dumps(payload, indent=2) + "\n")
        written.append(SGLANG_FILE)
    return written


def measure_engine(model: Any, windows: torch.Tensor, scales_path: str | Path, prefix_len: int) -> dict:
    """KL / perplexity / top-1 of what the engine stores (``engine-fp8:scales_path``) against the
    full-precision ``DynamicCache`` on ``windows[W, P + N]`` (teacher-forced decode, cache in the loop)."""
    from transformers import DynamicCache

    from kvquant.eval.caches import engine_cache, engine_config
    from kvquant.eval.decode import teacher_forced_logprobs
    from kvquant.eval.quality import compare

    quant = engine_config(scales_path)
    base, test = [], []
    for row in windows:
        ids = row[None]
        base.append(teacher_forced_logprobs(model, ids, prefix_len, DynamicCache(config=model.config)))
        test.append(teacher_forced_logprobs(model, ids, prefix_len, engine_cache(model.config, quant)))
    return compare(torch.cat(base), torch.cat(test), windows[:, prefix_len:])


def format_measurement(m: dict, what: str) -> str:
    return (
        f"{what} vs the full-precision cache, {m['tokens']} teacher-forced tokens: mean KL {m['kl_mean']:.5f}, "
        f"p99 KL {m['kl_p99']:.4f}, ppl {m['ppl_base']:.3f} -> {m['ppl']:.3f} ({100 * m['delta_ppl_rel']:+.2f}%), "
        f"top-1 agreement {100 * m['top1_agreement']:.1f}%"
    )
