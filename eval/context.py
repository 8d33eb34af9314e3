"""What every cache's evaluation in one run shares (:class:`EvalContext`: model, tokenizer, windows,
the DynamicCache baseline computed once) and each task of one cache's record: quality, memory,
speed, retrieval, free run. :func:`kvquant.eval.runner.run_eval` builds one per run; the sweep one
per model.

Example:
    >>> ctx = EvalContext(cfg, model, tok, windows, ids, [1024], run_dir, bar)
    >>> record = ctx.evaluate(resolve_specs(["int4"])[0])       # {"cache": "int4", "quality": ...}
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from functools import partial
from typing import Any

import torch

from kvquant.eval.caches import CacheSpec, resolve_specs
from kvquant.eval.config import Timing, cast
from kvquant.eval.decode import simulated_logprobs, teacher_forced_logprobs
from kvquant.eval.free_run import continuation_nll, free_run_numbers, greedy_continuations
from kvquant.eval.memory import measure_memory
from kvquant.eval.quality import compare
from kvquant.eval.retrieval import passkey_accuracy
from kvquant.eval.speed import measure_speed, with_ratios

logger = logging.getLogger("kvquant.eval")


def progress_bar(iterable, *, enabled: bool, **kwargs):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, dynamic_ncols=True, **kwargs)


class EvalContext:
    """What every cache's evaluation shares: model, tokenizer, windows, the baseline."""

    def __init__(self, cfg, model, tokenizer, windows, ids, retrieval_lengths, run_dir, bar, prompts=None):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.windows, self.ids, self.retrieval_lengths = windows, ids, retrieval_lengths
        self.run_dir, self.bar = run_dir, bar
        self.session = uuid.uuid4().hex[:12]
        self._baseline: torch.Tensor | None = None
        self.prompts: torch.Tensor | None = prompts  # [P, prompt_len] free-run prompts (None: task off)
        self._free_ref: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------------------------- quality

    def logprobs(self, spec: CacheSpec) -> torch.Tensor:
        """``[W, D, V]`` log-probs of the scored tokens of every window through ``spec``."""
        q, out = self.cfg.quality, []
        for i, window in enumerate(self.windows):
            cache = spec.build(self.model)
            if q.mode == "decode":
                steps = partial(self.bar, desc=f"{spec.name} window {i}", leave=False)
                out.append(
                    teacher_forced_logprobs(self.model, window[None], q.prefix_len, cache, progress=steps)
                )
            else:
                out.append(simulated_logprobs(self.model, window[None], q.prefix_len, cache))
        return torch.cat(out)

    def baseline(self) -> torch.Tensor:
        if self._baseline is not None:
            return self._baseline
        path = self.run_dir / "baseline_logprobs.pt"
        tokens_sha = hashlib.sha1(self.windows.numpy().tobytes()).hexdigest()
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("tokens_sha") == tokens_sha and saved.get("mode") == self.cfg.quality.mode:
                self._baseline = saved["logprobs"]
                logger.info("baseline: reusing %s", path)
                return self._baseline
        self._baseline = self.logprobs(resolve_specs(["dynamic"])[0])
        torch.save(
            {"logprobs": self._baseline, "tokens_sha": tokens_sha, "mode": self.cfg.quality.mode}, path
        )
        return self._baseline

    def quality(self, spec: CacheSpec) -> dict[str, Any]:
        q = self.cfg.quality
        base = self.baseline()
        test = base if spec.kind == "dynamic" else self.logprobs(spec)
        out = compare(base, test, self.windows[:, q.prefix_len :])
        return {**out, **{k: getattr(q, k) for k in ("mode", "windows", "prefix_len", "score_len")}}

    # ---------------------------------------------------------------------------------- free run

    def free_run(self, spec: CacheSpec) -> dict[str, Any]:
        """:mod:`kvquant.eval.free_run` numbers of ``spec`` against DynamicCache's own continuation
        (generated and scored once per run)."""
        n = self.cfg.free_run.tokens

        def generate(s: CacheSpec) -> torch.Tensor:
            bar = partial(self.bar, desc=f"{s.name} free run", leave=False)
            return greedy_continuations(self.model, self.prompts, lambda: s.build(self.model), n, bar)

        if self._free_ref is None:
            ref = generate(resolve_specs(["dynamic"])[0])
            self._free_ref = (ref, continuation_nll(self.model, self.prompts, ref))
        ref, ref_nll = self._free_ref
        got = ref if spec.kind == "dynamic" else generate(spec)
        return free_run_numbers(self.model, self.prompts, ref, got, reference_nll=ref_nll)

    # ---------------------------------------------------------------------------------- speed

    def speed(self, spec: CacheSpec) -> dict[str, Any]:
        """Speed of ``spec``, its runs interleaved with a DynamicCache's (the reference, same process)."""
        s = self.cfg.speed
        builds = {"dynamic": lambda: resolve_specs(["dynamic"])[0].build(self.model)}
        if spec.kind != "dynamic":
            builds["test"] = lambda: spec.build(self.model)
        grid = {"context_lengths": s.context_lengths, "batch_sizes": s.batch_sizes}
        timing = dataclasses.asdict(cast(s, Timing))  # decode_tokens, warmup, repeats
        rows = measure_speed(self.model, builds, self.ids, **grid, **timing, progress=self.bar)
        own = rows["test"] if spec.kind != "dynamic" else rows["dynamic"]
        return {
            "rows": with_ratios(own, rows["dynamic"]),
            "reference_rows": rows["dynamic"],
            "reference": "DynamicCache, runs interleaved with this cache's in the same process",
        }

    # ---------------------------------------------------------------------------------- all

    def evaluate(self, spec: CacheSpec) -> dict[str, Any]:
        cfg = self.cfg
        start = time.perf_counter()
        record: dict[str, Any] = {
            "cache": spec.name,
            "key": spec.key,
            "kind": spec.kind,
            "settings": spec.settings,
            "session": self.session,
        }
        if cfg.quality.enabled:
            record["quality"] = self.quality(spec)
        if cfg.memory.enabled:
            record["memory"] = measure_memory(self.model, spec, self.windows[0], cfg.quality.prefix_len)
        if cfg.speed.enabled:
            record["speed"] = self.speed(spec)
        if cfg.retrieval.enabled:
            record["retrieval"] = passkey_accuracy(
                self.model,
                self.tokenizer,
                lambda: spec.build(self.model),
                lengths=self.retrieval_lengths,
                trials=cfg.retrieval.trials,
                digits=cfg.retrieval.digits,
                seed=cfg.seed,
                progress=self.bar,
            )
        if cfg.free_run.enabled:
            record["free_run"] = self.free_run(spec)
        record["seconds"] = time.perf_counter() - start
        return record
