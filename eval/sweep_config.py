"""What a sweep runs: the sweep YAML, as dataclasses validated field by field.

A :class:`SweepConfig` is made of ``kvquant eval``'s own sections (:mod:`kvquant.eval.config`): its
``model`` is a :class:`RunSection` applied to each of ``models``, its ``corpus`` a
:class:`CorpusSection` with a ``fallback``, its ``quality`` the :class:`QualityProtocol` and its
``speed`` the :class:`Timing` of the harness, with the sweep's own defaults; ``grid``, ``capacity``
and ``recommend`` are the sweep's. The shared sections are checked by their own ``check`` methods.

Layers, later wins: the dataclass defaults below -> a YAML file (a path, or the name of a
``configs/sweep_<name>.yaml`` shipped with the package, e.g. ``default``) -> overrides
(``{"grid.contexts": [256]}``, what ``--set`` and the CLI flags produce). Unknown keys and bad values
raise :class:`SweepError`, one line naming the field and what is allowed.

Example:
    >>> cfg = load_sweep_config("default", {"grid.contexts": [128]})
    >>> cfg.grid.contexts, cfg.name
    ([128], 'default')
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.eval.caches import resolve_specs
from kvquant.eval.config import (
    CACHES_HELP,
    CorpusSection,
    EvalConfig,
    EvalError,
    ModelSection,
    QualityProtocol,
    QualitySection,
    RetrievalSection,
    RunSection,
    SpeedSection,
    Task,
    Timing,
    cast,
    check_caches,
    check_choice,
    check_ints,
    find_yaml,
    load_yaml_config,
    opt,
    read_yaml,
    shipped,
)

ATTN = ("sdpa", "eager", "kvquant", "flash_attention_2")


class SweepError(EvalError):
    """Bad sweep input; the message names the field. The CLI prints it on one line, exit status 2."""


@dataclass
class SweepCorpus(CorpusSection):
    fallback: str | None = opt(
        "embedded", "used (with a warning) when `name` is a missing file; null: refuse"
    )

    def check(self, where: str) -> None:
        if self.fallback is not None and not isinstance(self.fallback, str):
            raise SweepError(
                f"{where}.fallback: invalid value {self.fallback!r}; allowed: a corpus name or null"
            )


@dataclass
class GridSection:
    contexts: list[int] = opt([256, 1024, 2048], "context lengths of the grid")
    batches: list[int] = opt([1], "batch sizes of the grid")

    def check(self, where: str) -> None:
        check_ints(f"{where}.contexts", self.contexts)
        check_ints(f"{where}.batches", self.batches)


@dataclass
class CapacitySection:
    budget: str = opt("24GiB", "accelerator memory for the max-concurrent-sequences plot")
    weights_dtype: str = opt("bf16", "dtype of the weights")
    kv_dtype: str = opt("bf16", "dtype of full-precision K/V")
    reserve: str = opt("10%", "activation reserve: a percentage or a size")
    contexts: list[int] | None = opt(
        None, "contexts of the plot (None: the grid's; they are always included)"
    )

    def check(self, where: str) -> None:
        from kvquant.planning import PlanError, dtype_bytes, parse_reserve, parse_size

        if self.contexts is not None:
            check_ints(f"{where}.contexts", self.contexts)
        try:
            memory = parse_size(self.budget, f"{where}.budget")
            parse_reserve(self.reserve, memory, f"{where}.reserve")
            dtype_bytes(self.weights_dtype, f"{where}.weights_dtype")
            dtype_bytes(self.kv_dtype, f"{where}.kv_dtype")
        except PlanError as exc:
            raise SweepError(str(exc)) from None


@dataclass
class RecommendSection:
    max_kl: float | None = opt(
        0.01, "quality budget: mean KL(DynamicCache || cache), nats/token", "--budget-kl"
    )
    max_dppl_pct: float | None = opt(None, "quality budget: Δppl vs DynamicCache, percent", "--budget-dppl")

    def check(self, where: str) -> None:
        for key in ("max_kl", "max_dppl_pct"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v):
                raise SweepError(f"{where}.{key}: invalid value {v!r}; allowed: a number or null")
        if self.max_kl is not None and self.max_kl < 0:
            raise SweepError(f"{where}.max_kl: invalid value {self.max_kl!r}; allowed: a number >= 0")


@dataclass
class SweepConfig:
    name: str | None = opt(None, "None: the YAML file's stem without 'sweep_'")
    models: list[str] = opt(["smollm2"], "'smollm2', Hugging Face ids or local folders")
    model: RunSection = field(default_factory=RunSection)
    corpus: SweepCorpus = field(default_factory=SweepCorpus)
    caches: list[str] = opt(["dynamic", "int8", "int4"], CACHES_HELP, "--cache")
    quality: QualityProtocol = field(default_factory=lambda: QualityProtocol(score_len=32))
    grid: GridSection = field(default_factory=GridSection)
    speed: Timing = field(default_factory=lambda: Timing(decode_tokens=8, warmup=0, repeats=1))
    capacity: CapacitySection = field(default_factory=CapacitySection)
    recommend: RecommendSection = field(default_factory=RecommendSection)
    out: str | None = opt(None, "output folder (None: runs/sweep-<name>); reruns resume")
    seed: int = opt(0, "seed")
    progress: bool = opt(True, "progress bars and messages")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def eval_config(self, model_name: str, corpus: CorpusSection | None = None) -> EvalConfig:
        """The harness config of one model's quality pieces (speed, memory, retrieval off)."""
        return EvalConfig(
            model=cast(self.model, ModelSection, name=model_name),
            corpus=cast(corpus or self.corpus, CorpusSection),
            caches=list(self.caches),
            quality=cast(self.quality, QualitySection, enabled=True),
            retrieval=RetrievalSection(enabled=False),
            memory=Task(enabled=False),
            speed=SpeedSection(enabled=False),
            seed=self.seed,
            progress=self.progress,
        )

    def validate(self) -> None:
        """Every field checked once; the first bad one raises :class:`SweepError` naming it."""
        try:
            self._validate()
        except SweepError:
            raise
        except EvalError as exc:
            raise SweepError(" ".join(str(exc).split())) from None

    def _validate(self) -> None:
        if not isinstance(self.models, list) or not self.models:
            raise SweepError(f"models: expected a non-empty list of model names, got {self.models!r}")
        for m in self.models:
            if not isinstance(m, str) or not m:
                raise SweepError(
                    f"models: invalid entry {m!r}; allowed: 'smollm2', an HF id or a local folder"
                )
        dev = self.model.device
        if not isinstance(dev, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", dev):
            raise SweepError(f"model.device: invalid value {dev!r}; allowed: auto, cpu, cuda, cuda:N")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise SweepError(
                f"model.device: {dev!r} asks for CUDA, but torch sees no CUDA device here; "
                "allowed on this machine: auto, cpu"
            )
        check_choice("model.attn_implementation", self.model.attn_implementation, ATTN)
        for key in ("name", "out"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise SweepError(f"{key}: invalid value {v!r}; allowed: a non-empty string or null")
        for where in ("model", "corpus", "quality", "grid", "speed", "capacity", "recommend"):
            getattr(self, where).check(where)
        check_caches(self.caches)
        try:
            resolve_specs(self.caches)
        except EvalError as exc:  # "cache: unknown ..." / "cache 'x': ..." -> name the field
            msg = " ".join(str(exc).split())
            raise SweepError(
                "caches: " + msg.split(":", 1)[1].strip() if msg.startswith("cache:") else f"caches: {msg}"
            ) from None


def sweep_names() -> list[str]:
    """Names of the sweeps shipped in ``configs/`` (``sweep_<name>.yaml``)."""
    return shipped("", "sweep_")


def _read_sweep(spec: str | Path) -> dict[str, Any]:
    path = find_yaml(spec, "", "sweep_", what="sweeps")
    data = read_yaml(path)
    data.setdefault("name", None)
    if data["name"] is None:
        data["name"] = path.stem.removeprefix("sweep_")
    return data


def load_sweep_config(
    config: SweepConfig | dict[str, Any] | str | Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> SweepConfig:
    """Defaults, then ``config`` (a SweepConfig, a dict, a YAML path, or a shipped name such as
    ``default`` for ``configs/sweep_default.yaml``), then ``overrides`` (``{"dotted.key": value}``).

    Example:
        >>> cfg = load_sweep_config("default", {"grid.contexts": [128]})
        >>> cfg.grid.contexts, cfg.name
        ([128], 'default')
    """
    try:
        return load_yaml_config(SweepConfig, config, overrides, read=_read_sweep)
    except SweepError:
        raise
    except EvalError as exc:  # unknown keys, bad YAML: the loader of kvquant eval says which
        raise SweepError(str(exc)) from None
