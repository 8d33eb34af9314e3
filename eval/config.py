"""What ``kvquant eval`` runs: dataclass defaults -> YAML -> CLI flags.

An :class:`EvalConfig` is plain data, one section per part of the harness. Layers, later wins:

1. the dataclass defaults below (mirrored, with comments, in ``configs/eval/default.yaml``);
2. a YAML file (``--config path.yaml``, or the name of a file shipped in ``configs/eval/``);
3. CLI flags (``--prefix-len 1024``) and generic overrides (``--set speed.repeats=5``).

Example:
    >>> cfg = load_config("smollm2-wikitext2", overrides={"quality.windows": 4})
    >>> cfg.quality.prefix_len, cfg.quality.windows
    (1024, 4)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("decode", "simulated")
DTYPES = ("float32", "float16", "bfloat16")
TASKS = ("quality", "memory", "speed", "retrieval")


class EvalError(ValueError):
    """Bad input (unknown preset, missing file, too short a corpus, ...). The CLI prints the message on
    one line and exits with status 2."""


@dataclass
class ModelSection:
    name: str = "smollm2"  # "smollm2" (embedded), a Hugging Face id, or a local folder
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    device_map: str | None = None  # passed to from_pretrained (e.g. "auto"); overrides device
    attn_implementation: str = "sdpa"  # or "kvquant": fused decode over the quantized store


@dataclass
class CorpusSection:
    name: str = "embedded"  # "embedded", "wikitext2" (hub), or a local .txt / .jsonl / .json file
    text_field: str = "text"  # the column of a .jsonl / .json file
    join: str | None = None  # how rows are joined; None: "" for .txt (file as stored), "\n\n" otherwise


@dataclass
class QualitySection:
    enabled: bool = True
    mode: str = "decode"  # "decode" (cache in the loop) or "simulated" (one pass, K/V round-tripped)
    prefix_len: int = 512  # P tokens prefilled per window
    score_len: int = 64  # D tokens scored per window
    windows: int = 2  # non-overlapping windows of P + D tokens, evenly spaced over the corpus


@dataclass
class RetrievalSection:
    enabled: bool = True
    lengths: list[Any] = field(default_factory=lambda: [512, 1024, 2048])  # tokens; "max" = model limit
    trials: int = 3  # passkeys per length, at depths (i + 0.5) / trials
    digits: int = 5


@dataclass
class MemorySection:
    enabled: bool = True


@dataclass
class SpeedSection:
    enabled: bool = True
    context_lengths: list[int] = field(default_factory=lambda: [256, 1024])
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # more than [1] is meant for GPUs
    decode_tokens: int = 16
    warmup: int = 1
    repeats: int = 3  # the median of these is reported


@dataclass
class OutputSection:
    dir: str = "runs"
    name: str | None = None  # None: <model>-<corpus>-<mode>-<hash of the config>


@dataclass
class EvalConfig:
    model: ModelSection = field(default_factory=ModelSection)
    corpus: CorpusSection = field(default_factory=CorpusSection)
    # cache specs: "dynamic", kvquant preset names / YAML paths, "hf-quanto-int4", "hf-quanto-int2",
    # "hf-hqq-int4", "hf-fp8", and the groups "presets", "peers", "all". "dynamic" is always run first.
    caches: list[str] = field(default_factory=lambda: ["dynamic", "int8", "int4"])
    quality: QualitySection = field(default_factory=QualitySection)
    retrieval: RetrievalSection = field(default_factory=RetrievalSection)
    memory: MemorySection = field(default_factory=MemorySection)
    speed: SpeedSection = field(default_factory=SpeedSection)
    output: OutputSection = field(default_factory=OutputSection)
    seed: int = 0
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def identity(self) -> dict[str, Any]:
        """Everything that decides the numbers except the list of caches (and where output goes)."""
        d = self.to_dict()
        for key in ("caches", "output", "progress"):
            d.pop(key)
        return d

    def identity_hash(self, extra: str = "") -> str:
        blob = json.dumps(self.identity(), sort_keys=True) + extra
        return hashlib.sha1(blob.encode()).hexdigest()[:8]

    def validate(self) -> None:
        """Check values that need no model or corpus; raises :class:`EvalError`."""
        if self.model.dtype not in DTYPES:
            raise EvalError(f"model.dtype: invalid value {self.model.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.quality.mode not in MODES:
            raise EvalError(f"quality.mode: invalid value {self.quality.mode!r}; allowed: {', '.join(MODES)}")
        for name, value, low in (
            ("quality.prefix_len", self.quality.prefix_len, 1),
            ("quality.score_len", self.quality.score_len, 1),
            ("quality.windows", self.quality.windows, 1),
            ("retrieval.trials", self.retrieval.trials, 1),
            ("retrieval.digits", self.retrieval.digits, 1),
            ("speed.decode_tokens", self.speed.decode_tokens, 1),
            ("speed.warmup", self.speed.warmup, 0),
            ("speed.repeats", self.speed.repeats, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise EvalError(f"{name}: invalid value {value!r}; expected an integer >= {low}")
        for name, values in (
            ("speed.context_lengths", self.speed.context_lengths),
            ("speed.batch_sizes", self.speed.batch_sizes),
            ("retrieval.lengths", self.retrieval.lengths),
        ):
            if not isinstance(values, list) or not values:
                raise EvalError(f"{name}: expected a non-empty list, got {values!r}")
            for v in values:
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
                if not ok and not (name == "retrieval.lengths" and v == "max"):
                    allowed = (
                        "positive integers or 'max'" if name == "retrieval.lengths" else "positive integers"
                    )
                    raise EvalError(f"{name}: invalid value {v!r}; allowed: {allowed}")
        if not isinstance(self.caches, list) or not self.caches:
            raise EvalError(f"caches: expected a non-empty list of cache specs, got {self.caches!r}")

    @property
    def tasks(self) -> list[str]:
        return [t for t in TASKS if getattr(self, t).enabled]


# ------------------------------------------------------------------------------------------ loading


def _configs_dir():
    return importlib.resources.files("kvquant.configs") / "eval"


def config_names() -> list[str]:
    """Names of the eval configs shipped in ``configs/eval/``."""
    d = _configs_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in d.iterdir() if p.name.endswith(".yaml"))


def _merge(obj: Any, data: dict[str, Any], where: str) -> Any:
    """``obj`` (a dataclass) with ``data`` applied recursively; unknown keys raise."""
    if not isinstance(data, dict):
        raise EvalError(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    changes = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise EvalError(f"config: unknown key {path!r}; allowed: {', '.join(fields)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            changes[key] = _merge(current, value, path)
        else:
            changes[key] = value
    return dataclasses.replace(obj, **changes)


def _unflatten(overrides: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def read_yaml(spec: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file given by path or by the name of a config in ``configs/eval/``."""
    if isinstance(spec, str) and spec in config_names():
        text = (_configs_dir() / f"{spec}.yaml").read_text()
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise EvalError(
                f"config: no such file {str(spec)!r}; shipped configs: {', '.join(config_names()) or 'none'}"
            )
        text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise EvalError(f"config: {spec}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise EvalError(f"config: {spec}: expected a mapping at the top level")
    return data


def load_config(
    config: EvalConfig | dict[str, Any] | str | Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> EvalConfig:
    """Defaults, then ``config`` (an EvalConfig, a dict, a YAML path or shipped name), then
    ``overrides`` (``{"dotted.key": value}``); validated."""
    if isinstance(config, EvalConfig):
        cfg = config
    else:
        cfg = EvalConfig()
        if config is not None:
            data = config if isinstance(config, dict) else read_yaml(config)
            cfg = _merge(cfg, data, "")
    if overrides:
        cfg = _merge(cfg, _unflatten(overrides), "")
    cfg.validate()
    return cfg


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["speed.repeats=5", "caches=[int4, int8]"]`` -> ``{"speed.repeats": 5, ...}`` (values as YAML)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EvalError(f"--set: expected KEY=VALUE (e.g. speed.repeats=5), got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out
