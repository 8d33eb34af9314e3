"""What a sweep runs: the sweep YAML, as dataclasses validated field by field.

Layers, later wins: the dataclass defaults below -> a YAML file (a path, or the name of a
``configs/sweep_<name>.yaml`` shipped with the package, e.g. ``default``) -> overrides
(``{"grid.contexts": [256]}``, what ``--set`` and the CLI flags produce). Unknown keys and bad values
raise :class:`SweepError`, one line naming the field and what is allowed; the sections shared with
``kvquant eval`` (model dtype, quality, caches) are checked by its own validation.

Example:
    >>> cfg = load_sweep_config("default", {"grid.contexts": [128]})
    >>> cfg.grid.contexts, cfg.name
    ([128], 'default')
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.eval.caches import resolve_specs
from kvquant.eval.config import CorpusSection, EvalConfig, EvalError, _merge, _unflatten, read_yaml
from kvquant.eval.config import load_config as load_eval_config

ATTN = ("sdpa", "eager", "kvquant", "flash_attention_2")


class SweepError(EvalError):
    """Bad sweep input; the message names the field. The CLI prints it on one line, exit status 2."""


# ------------------------------------------------------------------------------------------ config


@dataclass
class SweepModel:
    dtype: str = "float32"  # float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    device_map: str | None = None
    attn_implementation: str = "sdpa"


@dataclass
class SweepCorpus:
    name: str = "embedded"  # as kvquant eval's corpus.name
    text_field: str = "text"
    join: str | None = None
    fallback: str | None = "embedded"  # used (with a warning) when `name` is a missing file


@dataclass
class SweepQuality:
    mode: str = "decode"
    prefix_len: int = 512
    score_len: int = 32
    windows: int = 2


@dataclass
class SweepGrid:
    contexts: list[int] = field(default_factory=lambda: [256, 1024, 2048])
    batches: list[int] = field(default_factory=lambda: [1])


@dataclass
class SweepSpeed:
    decode_tokens: int = 8
    warmup: int = 0  # extra discarded rounds; the memory run before them already warms every cache
    repeats: int = 1


@dataclass
class SweepCapacity:
    budget: str = "24GiB"  # accelerator memory for the max-concurrent-sequences plot
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    reserve: str = "10%"
    contexts: list[int] | None = None  # None: the grid's contexts (they are always included)


@dataclass
class SweepRecommend:
    max_kl: float | None = 0.01  # mean KL(DynamicCache || cache), nats per token
    max_dppl_pct: float | None = None  # Δppl vs DynamicCache, percent


@dataclass
class SweepConfig:
    name: str | None = None  # None: the YAML file's stem without "sweep_"
    models: list[str] = field(default_factory=lambda: ["smollm2"])
    model: SweepModel = field(default_factory=SweepModel)
    corpus: SweepCorpus = field(default_factory=SweepCorpus)
    caches: list[str] = field(default_factory=lambda: ["dynamic", "int8", "int4"])
    quality: SweepQuality = field(default_factory=SweepQuality)
    grid: SweepGrid = field(default_factory=SweepGrid)
    speed: SweepSpeed = field(default_factory=SweepSpeed)
    capacity: SweepCapacity = field(default_factory=SweepCapacity)
    recommend: SweepRecommend = field(default_factory=SweepRecommend)
    out: str | None = None  # None: runs/sweep-<name>
    seed: int = 0
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def eval_config(self, model_name: str, corpus: CorpusSection | None = None) -> EvalConfig:
        """The harness config of one model's quality pieces (speed, memory, retrieval off)."""
        c = corpus or CorpusSection(self.corpus.name, self.corpus.text_field, self.corpus.join)
        return load_eval_config(
            {
                "model": {"name": model_name, **dataclasses.asdict(self.model)},
                "corpus": dataclasses.asdict(c),
                "caches": list(self.caches),
                "quality": {**dataclasses.asdict(self.quality), "enabled": True},
                "memory": {"enabled": False},
                "speed": {"enabled": False},
                "retrieval": {"enabled": False},
                "seed": self.seed,
                "progress": self.progress,
            }
        )

    def validate(self) -> None:
        """Every field checked once; the first bad one raises :class:`SweepError` naming it."""
        from kvquant.planning import PlanError, dtype_bytes, parse_reserve, parse_size

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
        if self.model.attn_implementation not in ATTN:
            raise SweepError(
                f"model.attn_implementation: invalid value {self.model.attn_implementation!r}; "
                f"allowed: {', '.join(ATTN)}"
            )
        for name, values in (("grid.contexts", self.grid.contexts), ("grid.batches", self.grid.batches)):
            _positive_ints(name, values)
        if self.capacity.contexts is not None:
            _positive_ints("capacity.contexts", self.capacity.contexts)
        if self.corpus.fallback is not None and not isinstance(self.corpus.fallback, str):
            raise SweepError(
                f"corpus.fallback: invalid value {self.corpus.fallback!r}; allowed: a corpus name or null"
            )
        for key in ("max_kl", "max_dppl_pct"):
            v = getattr(self.recommend, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v):
                raise SweepError(f"recommend.{key}: invalid value {v!r}; allowed: a number or null")
        if self.recommend.max_kl is not None and self.recommend.max_kl < 0:
            raise SweepError(
                f"recommend.max_kl: invalid value {self.recommend.max_kl!r}; allowed: a number >= 0"
            )
        for key in ("name", "out"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise SweepError(f"{key}: invalid value {v!r}; allowed: a non-empty string or null")
        try:
            memory = parse_size(self.capacity.budget, "capacity.budget")
            parse_reserve(self.capacity.reserve, memory, "capacity.reserve")
            dtype_bytes(self.capacity.weights_dtype, "capacity.weights_dtype")
            dtype_bytes(self.capacity.kv_dtype, "capacity.kv_dtype")
        except PlanError as exc:
            raise SweepError(str(exc)) from None
        try:  # model.dtype, quality.*, caches: the harness's own checks and messages
            cfg = self.eval_config(self.models[0])
            for key, value, low in (
                ("speed.decode_tokens", self.speed.decode_tokens, 1),
                ("speed.warmup", self.speed.warmup, 0),
                ("speed.repeats", self.speed.repeats, 1),
            ):
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise SweepError(f"{key}: invalid value {value!r}; expected an integer >= {low}")
            resolve_specs(cfg.caches)
        except SweepError:
            raise
        except EvalError as exc:
            msg = " ".join(str(exc).split())
            if msg.startswith("cache"):  # "cache: unknown ..." / "cache 'x': ..." -> name the field
                msg = (
                    "caches: " + msg.split(":", 1)[1].strip()
                    if msg.startswith("cache:")
                    else f"caches: {msg}"
                )
            raise SweepError(msg) from None


def _positive_ints(name: str, values: Any) -> None:
    if not isinstance(values, list) or not values:
        raise SweepError(f"{name}: expected a non-empty list of positive integers, got {values!r}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SweepError(f"{name}: invalid value {v!r}; allowed: positive integers")


def _configs_dir():
    return importlib.resources.files("kvquant.configs")


def sweep_names() -> list[str]:
    """Names of the sweeps shipped in ``configs/`` (``sweep_<name>.yaml``)."""
    d = _configs_dir()
    return sorted(
        p.name[6:-5] for p in d.iterdir() if p.name.startswith("sweep_") and p.name.endswith(".yaml")
    )


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
        return _load(config, overrides)
    except SweepError:
        raise
    except EvalError as exc:  # unknown keys, bad YAML: the loader of kvquant eval says which
        raise SweepError(str(exc)) from None


def _load(config: Any, overrides: dict[str, Any] | None) -> SweepConfig:
    cfg = SweepConfig()
    if isinstance(config, SweepConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = _merge(cfg, config, "")
    elif config is not None:
        path = Path(config).expanduser()
        if not path.is_file() and str(config) in sweep_names():
            path = Path(str(_configs_dir() / f"sweep_{config}.yaml"))
        if not path.is_file():
            raise SweepError(
                f"config: no such file {str(config)!r}; shipped sweeps: {', '.join(sweep_names()) or 'none'}"
            )
        cfg = _merge(cfg, read_yaml(path), "")
        if cfg.name is None:
            cfg = dataclasses.replace(cfg, name=path.stem.removeprefix("sweep_"))
    if overrides:
        cfg = _merge(cfg, _unflatten(overrides), "")
    cfg.validate()
    return cfg
