"""``run_sweep``: cache configs × context lengths × batch sizes (× models), through the eval harness.

A sweep YAML (``configs/sweep_default.yaml`` lists every key with comments) names the models, the
cache specs (as ``kvquant eval --cache`` takes them), the quality settings and the grid. For every
model it measures, as separate pieces, each appended to ``results.jsonl`` the moment it finishes:

- ``quality`` per cache: teacher-forced decode-mode KL / Δppl / top-1 against DynamicCache, by the
  harness's own quality task (``runner.EvalContext``: baseline once, kept in ``baseline_logprobs.pt``);
- ``memory`` per (cache, context, batch): a fresh cache prefills ``[batch, context]`` tokens and
  decodes ``speed.decode_tokens`` greedily (``speed.time_once``) under :class:`PeakMemory`; the bytes
  the cache then holds (``cache_nbytes``: codes, scales, zeros, full-precision sink / residual) give
  bytes per token and effective bits per element; the run also warms the caches up for speed;
- ``speed`` per (cache, context, batch): :func:`measure_speed` over all caches still to do at that
  point plus one DynamicCache, runs interleaved round by round; ratios against that DynamicCache.

Each piece is keyed by (model, cache name + settings hash, kind, context, batch); a restarted sweep
skips the pieces it finds and measures only the rest. At the end it writes ``results.csv`` and
``results.md`` (one row per (model, cache, context, batch) point), the plots (:mod:`kvquant.eval.plots`)
with the data behind each, the capacity at ``capacity.budget`` (:func:`kvquant.planning.plan`) and a
recommendation for the quality budget (:func:`kvquant.eval.recommend.recommend`).

Example:
    >>> from kvquant.eval.sweep import run_sweep
    >>> result = run_sweep("default", overrides={"grid.contexts": [256], "out": "runs/sweep-small"})
    >>> print(result.recommendation["text"])       # also in result.out_dir / "results.md"
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from kvquant.eval.caches import CacheSpec, resolve_specs
from kvquant.eval.config import CorpusSection, EvalError, check_output_dir
from kvquant.eval.context import EvalContext, progress_bar
from kvquant.eval.corpus import load_corpus, make_windows, tokenize
from kvquant.eval.memory import PeakMemory, memory_numbers
from kvquant.eval.records import RecordStore, claim_folder, write_json
from kvquant.eval.report import environment
from kvquant.eval.runner import (
    check_buildable,
    check_context,
    load_eval_model,
    model_fingerprint,
    model_label,
    model_max_context,
    release_memory,
    safe_name,
)
from kvquant.eval.speed import measure_speed, prompt_tokens, time_once, with_ratios
from kvquant.eval.sweep_config import (  # noqa: F401  (re-exported: the sweep's public API)
    SweepConfig,
    SweepError,
    load_sweep_config,
    sweep_names,
)
from kvquant.eval.sweep_report import build_report, record_id

logger = logging.getLogger("kvquant.eval")

# the memory fields of a sweep's point (kvquant eval's memory task records more)
POINT_MEMORY = tuple(
    "tokens bytes bytes_per_token effective_bits effective_bits_16bit theoretical_bits peak_bytes "
    "peak_method peak_rss_bytes".split()
)


@dataclass
class SweepResult:
    out_dir: Path
    records: list[dict[str, Any]]  # the pieces of this sweep's grid, from results.jsonl
    points: list[dict[str, Any]]  # one row per (model, cache, context, batch): results.csv
    table: str  # the markdown table of the points
    markdown: str  # results.md: table, capacity, recommendation, plots
    recommendations: list[dict[str, Any]]  # one per model
    plots: list[Path]
    skipped: int = 0  # pieces found finished in results.jsonl
    measured: int = 0  # pieces measured by this call
    warnings: list[str] = field(default_factory=list)  # risky configs (kvquant.eval.preflight.risk_warning)

    @property
    def recommendation(self) -> dict[str, Any]:
        return self.recommendations[0]


# ------------------------------------------------------------------------------------------ pieces


def _memory_point(model: Any, spec: CacheSpec, stream: torch.Tensor, context: int, batch: int, decode: int):
    """Bytes held and peak memory of one run: prefill ``[batch, context]``, decode ``decode`` tokens."""
    cache = spec.build(model)
    ids = prompt_tokens(stream, context, batch)  # [B, L], made before the peak is watched
    with PeakMemory(next(model.parameters()).device) as pm:
        time_once(model, cache, ids, decode)
    numbers = memory_numbers(model, spec, cache, pm, sequences=batch)
    return {k: numbers[k] for k in POINT_MEMORY}


def _oom(exc: BaseException) -> dict[str, Any]:
    release_memory()
    return {"error": f"out of memory ({' '.join(str(exc).split())[:200]})"}


class _ModelRun:
    """The pieces of one model: quality per cache, memory and speed per grid point."""

    def __init__(self, cfg, label, specs, store, model_dir, model, tok, corpus_section, corpus):
        self.cfg, self.label, self.specs, self.store, self.done = cfg, label, specs, store, store.records
        self.model, self.tok = model, tok
        self.bar = partial(progress_bar, enabled=cfg.progress)
        self.measured = 0
        self.ids = tokenize(tok, corpus.text)  # [N]
        limit, q, d = model_max_context(model), cfg.quality, cfg.speed.decode_tokens
        whose = f"{label}'s"
        check_context("quality.prefix_len + quality.score_len", q.prefix_len + q.score_len, limit, whose)
        for c in cfg.grid.contexts:
            check_context(f"grid.contexts ({c} + {d} decoded)", c + d, limit, whose)
        windows = make_windows(self.ids, q.prefix_len, q.score_len, q.windows, cfg.corpus.name)
        ecfg = cfg.eval_config(label, corpus_section)
        self.ctx = EvalContext(ecfg, model, tok, windows, self.ids, [], model_dir, self.bar)

    def _id(self, spec: CacheSpec, kind: str, context: int, batch: int) -> str:
        return record_id(self.label, spec.key, kind, context, batch)

    def _save(
        self, spec: CacheSpec, kind: str, context: int, batch: int, data: dict[str, Any], seconds: float
    ):
        rid = self._id(spec, kind, context, batch)
        record = {
            "id": rid,
            "model": self.label,
            "cache": spec.name,
            "key": spec.key,
            "cache_kind": spec.kind,
            "kind": kind,
            "context": context,
            "batch": batch,
            "settings": spec.settings,
            kind: data,
            "seconds": seconds,
        }
        self.store.add(record)
        self.measured += 1

    def quality(self) -> None:
        p = self.cfg.quality.prefix_len
        for spec in self.specs:
            if self._id(spec, "quality", p, 1) in self.done:
                continue
            t0 = time.perf_counter()
            rec = self.ctx.evaluate(spec)  # the harness's quality task (baseline computed once)
            self._save(spec, "quality", p, 1, rec["quality"], time.perf_counter() - t0)
            logger.info("%s %s: quality done", self.label, spec.name)

    def point(self, context: int, batch: int) -> None:
        decode = self.cfg.speed.decode_tokens
        for spec in self.specs:
            if self._id(spec, "memory", context, batch) in self.done:
                continue
            t0 = time.perf_counter()
            try:
                data = _memory_point(self.model, spec, self.ids, context, batch, decode)
            except torch.OutOfMemoryError as exc:
                data = _oom(exc)
            self._save(spec, "memory", context, batch, data, time.perf_counter() - t0)
        pending = [s for s in self.specs if self._id(s, "speed", context, batch) not in self.done]
        if not pending:
            return

        def fits(s: CacheSpec) -> bool:
            return "error" not in self.done[self._id(s, "memory", context, batch)]["memory"]

        dynamic = self.specs[0]  # resolve_specs puts dynamic first
        reference = fits(dynamic)
        for s in [s for s in pending if not fits(s)]:
            self._save(s, "speed", context, batch, {"error": "skipped: the memory run did not fit"}, 0.0)
        pending = [s for s in pending if fits(s)]
        if not pending:
            return
        builds = {"dynamic": dynamic.build} if reference else {}
        for s in pending:
            if s.kind != "dynamic":
                builds[s.key] = s.build
        t0 = time.perf_counter()
        try:
            builds = {name: partial(build, self.model) for name, build in builds.items()}
            grid = {"context_lengths": [context], "batch_sizes": [batch]}
            timing = dataclasses.asdict(self.cfg.speed)  # decode_tokens, warmup, repeats
            rows = measure_speed(self.model, builds, self.ids, **grid, **timing, progress=self.bar)
        except torch.OutOfMemoryError as exc:
            for s in pending:
                self._save(s, "speed", context, batch, _oom(exc), 0.0)
            return
        seconds = (time.perf_counter() - t0) / len(pending)
        ref = rows.get("dynamic")
        for s in pending:
            own = rows["dynamic" if s.kind == "dynamic" else s.key]
            row = with_ratios(own, ref)[0] if ref else dict(own[0])
            if ref:
                row["reference_decode_tok_s"] = ref[0]["decode_tok_s"]
                row["reference_prefill_ms"] = ref[0]["prefill_ms"]
            row["interleaved_with"] = len(builds)
            self._save(s, "speed", context, batch, row, seconds)
        logger.info("%s context %d batch %d: speed done", self.label, context, batch)


# ------------------------------------------------------------------------------------------ run


def _corpus(cfg: SweepConfig) -> tuple[CorpusSection, Any]:
    c = cfg.corpus
    section = CorpusSection(c.name, c.text_field, c.join)
    missing = c.name not in ("embedded", "wikitext2") and not Path(c.name).expanduser().is_file()
    if missing or c.name == "wikitext2":
        try:
            if missing:
                raise EvalError(f"corpus: no such file {c.name!r}")
            return section, load_corpus(section)
        except EvalError as exc:
            if c.fallback is None:
                raise SweepError(f"corpus.name: {' '.join(str(exc).split())}") from None
            logger.warning("corpus %r unavailable (%s); using corpus.fallback %r", c.name, exc, c.fallback)
            section = CorpusSection(c.fallback, c.text_field, c.join)
    return section, load_corpus(section)


def _identity(cfg: SweepConfig, corpus: Any, fingerprint: str) -> str:
    """Hash of what decides a sweep's numbers (the grid and the caches may change between runs)."""
    what = {
        "model": dataclasses.asdict(cfg.model),
        "corpus_sha256": corpus.info["sha256"],
        "quality": dataclasses.asdict(cfg.quality),
        "speed": dataclasses.asdict(cfg.speed),
        "seed": cfg.seed,
        "model_object": fingerprint,
    }
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]


def run_sweep(
    config: SweepConfig | dict[str, Any] | str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    model: Any = None,
    tokenizer: Any = None,
) -> SweepResult:
    """Run (or resume) a sweep and write its report; bad input raises :class:`SweepError` /
    :class:`EvalError` (see the module docstring for what is measured and written).

    ``model`` / ``tokenizer``: one model object to sweep instead of loading ``config.models``
    (labelled by its ``model_type``).

    Example:
        >>> result = run_sweep("default", overrides={"caches": ["dynamic", "int8"], "out": "runs/s"})
        >>> result.points[0]["decode_tok_s"], result.plots[0].name
    """
    cfg = load_sweep_config(config, overrides)
    specs = resolve_specs(cfg.caches)
    out = Path(cfg.out or f"runs/sweep-{cfg.name or 'sweep'}")
    try:  # before the slow work, not after it
        check_output_dir("out", out)
    except EvalError as exc:
        raise SweepError(str(exc)) from None
    corpus_section, corpus = _corpus(cfg)
    if model is not None:
        if tokenizer is None:
            raise SweepError("run_sweep: a model object needs its tokenizer (tokenizer=...)")
        fingerprint = model_fingerprint(model)
        labels = [model.config.model_type]
    else:
        fingerprint = ""
        labels = [model_label(m) for m in cfg.models]
    out.mkdir(parents=True, exist_ok=True)
    identity = _identity(cfg, corpus, fingerprint)
    refusal = SweepError(
        f"out: {str(out)!r} holds a sweep with other model / corpus / quality / speed settings; "
        "choose another --out (the grid and the caches may change between runs, not those)"
    )
    claim_folder(out / "sweep.json", identity, fingerprint, refusal)
    (out / "config.yaml").write_text(
        yaml.safe_dump(
            {
                **cfg.to_dict(),
                "resolved_caches": {s.name: s.settings for s in specs},
                "corpus_used": corpus.info,
            },
            sort_keys=False,
        )
    )
    store = RecordStore(out / "results.jsonl", key="id")
    grid = [(c, b) for c in sorted(cfg.grid.contexts) for b in sorted(cfg.grid.batches)]
    skipped = measured = 0
    model_configs: dict[str, Any] = {}
    for name, label in zip(cfg.models if model is None else [None], labels, strict=True):
        ids = [record_id(label, s.key, "quality", cfg.quality.prefix_len, 1) for s in specs]
        ids += [record_id(label, s.key, k, c, b) for s in specs for c, b in grid for k in ("memory", "speed")]
        todo = [i for i in ids if i not in store]
        skipped += len(ids) - len(todo)
        if not todo:
            logger.info("%s: every piece finished in an earlier run", label)
            if model is not None:
                model_configs[label] = model.config
            else:
                from kvquant.planning import load_config as plan_config

                model_configs[label] = plan_config(name)
            continue
        if model is None:
            m, tok = load_eval_model(cfg.eval_config(name, corpus_section))
        else:
            m, tok = model, tokenizer
        model_dir = out / "models" / safe_name(label)
        model_dir.mkdir(parents=True, exist_ok=True)
        write_json(model_dir / "env.json", environment(next(m.parameters()).device))
        check_buildable(specs, m, "caches: ", SweepError)
        run = _ModelRun(cfg, label, specs, store, model_dir, m, tok, corpus_section, corpus)
        try:
            run.quality()
            for context, batch in run.bar(grid, desc=f"{label} grid"):
                run.point(context, batch)
        finally:
            measured += run.measured
        model_configs[label] = m.config
        if model is None:
            del run, m, tok
            release_memory()
    report = build_report(cfg, specs, labels, store.records, model_configs, corpus.info, out)
    return SweepResult(out, **report, skipped=skipped, measured=measured)
