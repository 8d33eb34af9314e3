"""``run_eval``: every task for every cache config, written to one results folder per run.

A run folder (``<output.dir>/<model>-<corpus>-<mode>-<hash>``; the hash covers the whole config
except the list of caches, so adding caches to a finished run reuses its folder) holds:

``config.yaml``            the resolved config, with the resolved settings of every cache
``env.json``               package versions, git commit, device, threads
``baseline_logprobs.pt``   the full-precision DynamicCache log-probs of the windows, computed once
``results.jsonl``          one record per finished cache config, appended as each one finishes
``results.json``           everything: config, model, corpus, env and all records
``results.md``             the markdown table (also printed at the end)

Resuming: a cache whose record (name + hash of its settings) is already in ``results.jsonl`` is
skipped; an interrupted config is redone. Speed ratios are always taken against a DynamicCache
whose runs are interleaved with the config's own (:func:`kvquant.eval.speed.measure_speed`).

Example:
    >>> from kvquant.eval import run_eval
    >>> result = run_eval("smollm2-wikitext2", overrides={"caches": ["dynamic", "int4"]})
    >>> print(result.table)
"""

from __future__ import annotations

import gc
import hashlib
import logging
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from kvquant.eval.caches import CacheSpec, fp16_bytes_per_token, kv_geometry, resolve_specs
from kvquant.eval.config import EvalConfig, EvalError, check_output_dir, load_config
from kvquant.eval.context import EvalContext, progress_bar
from kvquant.eval.corpus import load_corpus, make_windows, tokenize
from kvquant.eval.records import RecordStore, claim_folder, write_json
from kvquant.eval.report import environment, markdown_table

logger = logging.getLogger("kvquant.eval")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EvalResult:
    run_dir: Path
    records: list[dict[str, Any]]
    table: str
    skipped: list[str] = field(default_factory=list)  # cache names found finished in results.jsonl


# ------------------------------------------------------------------------------------------ setup


def safe_name(text: str) -> str:
    """``text`` as a folder name: runs of other characters than ``A-Za-z0-9._-`` become ``-``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def model_label(name: str) -> str:
    """The label of a model loaded by name: ``smollm2`` for every alias of the embedded model."""
    from kvquant.models import EMBEDDED_ALIASES

    return "smollm2" if name.lower() in EMBEDDED_ALIASES else name


def load_eval_model(cfg: EvalConfig) -> tuple[Any, Any]:
    from transformers.utils import logging as hf_logging

    from kvquant.models import load_model

    device = cfg.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bars = hf_logging.is_progress_bar_enabled()
    if not cfg.progress:
        hf_logging.disable_progress_bar()
    try:
        return load_model(
            cfg.model.name,
            dtype=_DTYPES[cfg.model.dtype],
            device=device,
            device_map=cfg.model.device_map,
            attn_implementation=cfg.model.attn_implementation,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        raise EvalError(f"model {cfg.model.name!r}: {_one_line(exc)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def model_fingerprint(model: Any) -> str:
    """Identity of a model object passed in (not loaded by name): config + a parameter checksum."""
    h = hashlib.sha1(model.config.to_json_string().encode())
    with torch.no_grad():
        h.update(repr([round(float(p.double().sum()), 6) for p in model.parameters()]).encode())
    return h.hexdigest()[:12]


def model_max_context(model: Any) -> int | None:
    cfg = model.config.get_text_config(decoder=True)
    return getattr(cfg, "max_position_embeddings", None)


def resolve_lengths(cfg: EvalConfig, limit: int | None) -> list[int]:
    """Retrieval lengths with "max" replaced by the model's limit (minus the answer tokens)."""
    answer = cfg.retrieval.digits + 2
    out = []
    for length in cfg.retrieval.lengths:
        if length == "max":
            if limit is None:
                raise EvalError("retrieval.lengths: 'max' needs a model with max_position_embeddings")
            length = limit - answer
        out.append(length)
    return out


def check_context(what: str, tokens: int, limit: int | None, whose: str = "the model's") -> None:
    if limit is not None and tokens > limit:
        raise EvalError(
            f"{what}: context of {tokens} tokens is beyond {whose} limit of {limit} (max_position_embeddings)"
        )


def _check_limits(cfg: EvalConfig, limit: int | None, retrieval_lengths: list[int]) -> None:
    q, answer, d = cfg.quality, cfg.retrieval.digits + 2, cfg.speed.decode_tokens
    if cfg.quality.enabled or cfg.memory.enabled:
        check_context("quality.prefix_len + quality.score_len", q.prefix_len + q.score_len, limit)
    for length in retrieval_lengths if cfg.retrieval.enabled else []:
        check_context(f"retrieval.lengths ({length} + {answer} answer tokens)", length + answer, limit)
    if cfg.free_run.enabled:
        f = cfg.free_run
        check_context("free_run.prompt_len + free_run.tokens", f.prompt_len + f.tokens, limit)
    for c in cfg.speed.context_lengths if cfg.speed.enabled else []:
        check_context(f"speed.context_lengths ({c} + {d} decoded)", c + d, limit)


def check_buildable(specs: list[CacheSpec], model: Any, prefix: str, error: type = EvalError) -> None:
    """Build every cache once, to fail on an unusable one before any slow work."""
    for spec in specs:
        try:
            spec.build(model)
        except (ValueError, ImportError) as exc:
            raise error(f"{prefix}{spec.name!r}: {_one_line(exc)}") from None


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ run


def run_eval(
    config: EvalConfig | dict[str, Any] | str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    model: Any = None,
    tokenizer: Any = None,
    caches: list[CacheSpec] | None = None,
) -> EvalResult:
    """Evaluate every cache of ``config`` (see the module docstring); bad input raises :class:`EvalError`.

    ``model`` / ``tokenizer``: objects to use instead of loading ``config.model.name`` (the tokenizer
    needs ``encode(text, add_special_tokens=False)`` and ``decode(ids, skip_special_tokens=True)``).
    ``caches``: extra specs (e.g. :meth:`CacheSpec.custom`) evaluated after those of the config.
    """
    cfg = load_config(config, overrides)
    specs = resolve_specs(cfg.caches) + list(caches or [])
    check_output_dir("output.dir", cfg.output.dir)  # before the slow work, not after it
    corpus = load_corpus(cfg.corpus)
    if model is None:
        model, tokenizer = load_eval_model(cfg)
        label, fingerprint = model_label(cfg.model.name), ""
    else:
        if tokenizer is None:
            raise EvalError("run_eval: a model object needs its tokenizer (tokenizer=...)")
        label, fingerprint = model.config.model_type, model_fingerprint(model)
    device = next(model.parameters()).device
    limit = model_max_context(model)
    retrieval_lengths = resolve_lengths(cfg, limit)
    _check_limits(cfg, limit, retrieval_lengths)

    ids = tokenize(tokenizer, corpus.text)
    q = cfg.quality
    windows = None
    if cfg.quality.enabled or cfg.memory.enabled:
        windows = make_windows(ids, q.prefix_len, q.score_len, q.windows, cfg.corpus.name)  # [W, P + D]
    prompts = None
    if cfg.free_run.enabled:
        f = cfg.free_run
        prompts = make_windows(ids, f.prompt_len, f.tokens, f.prompts, cfg.corpus.name)[:, : f.prompt_len]
    check_buildable(specs, model, "cache ")

    corpus_label = (
        cfg.corpus.name if cfg.corpus.name in ("embedded", "wikitext2") else Path(cfg.corpus.name).stem
    )
    identity = cfg.identity_hash(fingerprint)
    name = cfg.output.name or safe_name(f"{Path(label).name}-{corpus_label}-{q.mode}-{identity}")
    run_dir = Path(cfg.output.dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    refusal = EvalError(
        f"output: {str(run_dir)!r} holds a run of another configuration; choose another output.name"
    )
    claim_folder(run_dir / "run.json", identity, fingerprint, refusal)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {**cfg.to_dict(), "resolved_caches": {s.name: s.settings for s in specs}}, sort_keys=False
        )
    )
    env = environment(device)
    write_json(run_dir / "env.json", env)

    layers, kv_heads, head_dim = kv_geometry(model)
    run_info = {
        "run": name,
        "identity": identity,
        "model": {
            "name": cfg.model.name if not fingerprint else f"{label} (object {fingerprint})",
            "class": type(model).__name__,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(device),
            "max_position_embeddings": limit,
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "fp16_bytes_per_token": fp16_bytes_per_token(model),
        },
        "corpus": {**corpus.info, "tokens": ids.numel()},
        "windows": {"count": q.windows, "prefix_len": q.prefix_len, "score_len": q.score_len},
        "retrieval_lengths": retrieval_lengths,
    }
    bar = partial(progress_bar, enabled=cfg.progress)
    ctx = EvalContext(cfg, model, tokenizer, windows, ids, retrieval_lengths, run_dir, bar, prompts=prompts)

    store = RecordStore(run_dir / "results.jsonl", key="key")
    done = store.records
    skipped = [s.name for s in specs if s.key in store]
    for s in skipped:
        logger.info("%s: finished in an earlier run, skipped", s)
    for spec in bar([s for s in specs if s.key not in store], desc="caches"):
        record = ctx.evaluate(spec)
        store.add(record)
        logger.info("%s: done in %.1f s", spec.name, record["seconds"])

    order = [s.key for s in specs]
    records = [done[k] for k in order] + [r for k, r in done.items() if k not in order]
    table = markdown_table(records)
    write_json(
        run_dir / "results.json", {**run_info, "config": cfg.to_dict(), "env": env, "records": records}
    )
    from kvquant.models import weights_label

    weights = weights_label(cfg.model.name) if not fingerprint else run_info["model"]["name"]
    (run_dir / "results.md").write_text(f"Weights: {weights}.\n\n{table}\n")
    return EvalResult(run_dir, records, table, skipped)
