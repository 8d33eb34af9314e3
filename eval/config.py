"""What ``kvquant eval`` runs: dataclass defaults -> YAML -> CLI flags.

An :class:`EvalConfig` is plain data, one section per part of the harness. Layers, later wins:

1. the dataclass defaults below (mirrored, with comments, in ``configs/eval/default.yaml``);
2. a YAML file (``--config path.yaml``, or the name of a file shipped in ``configs/eval/``);
3. CLI flags (``--prefix-len 1024``) and generic overrides (``--set speed.repeats=5``).

The sections are shared: the sweep's config (:mod:`kvquant.eval.sweep_config`) is built from the same
section classes, loaded by the same :func:`load_yaml_config` and checked by the same ``check`` methods.
Each field's help text and flag aliases live in its metadata (:func:`opt`), from which
:mod:`kvquant.eval.flags` derives the command-line flags.

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
from typing import Any, TypeVar

import yaml

# (the checks are re-exported: kvquant.eval.config is where callers look for them)
from kvquant.eval.checks import (  # noqa: F401
    EvalError,
    attention_names,
    check_caches,
    check_choice,
    check_device,
    check_int,
    check_ints,
    check_output_dir,
)

MODES = ("decode", "simulated")
DTYPES = ("float32", "float16", "bfloat16")
TASKS = ("quality", "memory", "speed", "retrieval", "free_run")

C = TypeVar("C")


def opt(default: Any, help: str = "", *flags: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its ``--help`` text, extra flag names and allowed values as metadata."""
    meta = {"help": help, "flags": flags, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------------ sections


@dataclass
class Task:
    """A task the run can switch off (first key of its section)."""

    enabled: bool = opt(True, "run this task")


@dataclass
class _Named:
    name: str = opt("smollm2", "'smollm2' (embedded), a Hugging Face id, a local folder, or a .gguf file")


@dataclass
class RunSection:
    """How a model is loaded and run: ``kvquant eval``'s ``model`` section without the name, and the
    sweep's ``model`` section (which runs every one of its ``models`` so)."""

    dtype: str = opt("float32", "weights and activations", choices=DTYPES)
    device: str = opt("auto", "auto (cuda when available, else cpu), cpu, cuda, cuda:1 ...")
    device_map: str | None = opt(None, "passed to from_pretrained (e.g. auto); overrides device")
    attn_implementation: str = opt("sdpa", "sdpa, eager, or kvquant (fused decode over the store)", "--attn")

    def check(self, where: str) -> None:
        check_choice(f"{where}.dtype", self.dtype, DTYPES)
        if self.device_map is None:
            check_device(f"{where}.device", self.device)
        attn = self.attn_implementation
        if not isinstance(attn, str) or ("/" not in attn and attn not in attention_names()):
            allowed = ", ".join(attention_names())
            raise EvalError(f"{where}.attn_implementation: invalid value {attn!r}; allowed: {allowed}")


@dataclass
class ModelSection(RunSection, _Named):  # fields: name, then the run settings
    pass


@dataclass
class CorpusSection:
    name: str = opt("embedded", "embedded, wikitext2 (hub), or a local .txt / .jsonl / .json file")
    text_field: str = opt("text", "the column of a .jsonl / .json corpus")
    join: str | None = opt(None, 'how rows are joined; None: "" for .txt (as stored), "\\n\\n" otherwise')


@dataclass
class QualityProtocol:
    """The quality windows: the sweep's ``quality`` section, and ``kvquant eval``'s (plus ``enabled``)."""

    mode: str = opt(
        "decode", "decode (cache in the loop) or simulated (one pass, K/V round-tripped)", choices=MODES
    )
    prefix_len: int = opt(512, "P: tokens prefilled per window")
    score_len: int = opt(64, "D: tokens scored per window")
    windows: int = opt(2, "non-overlapping windows of P + D tokens, evenly spaced over the corpus")

    def check(self, where: str) -> None:
        check_choice(f"{where}.mode", self.mode, MODES)
        for key in ("prefix_len", "score_len", "windows"):
            check_int(f"{where}.{key}", getattr(self, key), 1)


@dataclass
class QualitySection(QualityProtocol, Task):  # fields: enabled, then the protocol
    pass


@dataclass
class RetrievalSection(Task):
    lengths: list[Any] = opt([512, 1024, 2048], "prompt tokens, e.g. 1024,4096,max (max: the model's limit)")
    trials: int = opt(3, "passkeys per length, at depths (i + 0.5) / trials")
    digits: int = opt(5, "digits of a passkey")

    def check(self, where: str) -> None:
        check_int(f"{where}.trials", self.trials, 1)
        check_int(f"{where}.digits", self.digits, 1)
        check_ints(f"{where}.lengths", self.lengths, also=("max",))


@dataclass
class FreeRunSection(Task):
    """Free-running generation (:mod:`kvquant.eval.free_run`): each cache generates greedily on its own
    and the full-precision model scores what it wrote. Off by default (``tokens`` decode steps per cache
    and prompt: about 10-20 s per cache on a 2-core CPU with the embedded model)."""

    enabled: bool = opt(False, "run this task (off by default)")
    tokens: int = opt(256, "greedy tokens each cache generates per prompt")
    prompt_len: int = opt(256, "prompt tokens, taken from the corpus")
    prompts: int = opt(1, "prompts, evenly spaced over the corpus")

    def check(self, where: str) -> None:
        for key in ("tokens", "prompt_len", "prompts"):
            check_int(f"{where}.{key}", getattr(self, key), 1)


@dataclass
class Timing:
    """How one speed point is timed: ``kvquant eval``'s speed section and the sweep's."""

    decode_tokens: int = opt(16, "greedy tokens decoded after each prefill")
    warmup: int = opt(1, "discarded runs")
    repeats: int = opt(3, "timed runs; the median is reported")

    def check(self, where: str) -> None:
        check_int(f"{where}.decode_tokens", self.decode_tokens, 1)
        check_int(f"{where}.warmup", self.warmup, 0)
        check_int(f"{where}.repeats", self.repeats, 1)


@dataclass
class _SpeedGrid:
    context_lengths: list[int] = opt([256, 1024], "prompt lengths, e.g. 256,1024", "--speed-contexts")
    batch_sizes: list[int] = opt(
        [1], "batch sizes, e.g. 1,8 (more than 1 is meant for GPUs)", "--speed-batches"
    )


@dataclass
class SpeedSection(Timing, _SpeedGrid, Task):  # fields: enabled, context_lengths, batch_sizes, timing
    def check(self, where: str) -> None:
        super().check(where)
        check_ints(f"{where}.context_lengths", self.context_lengths)
        check_ints(f"{where}.batch_sizes", self.batch_sizes)


@dataclass
class OutputSection:
    dir: str = opt("runs", "parent of the run folder")
    name: str | None = opt(
        None, "run folder name (None: <model>-<corpus>-<mode>-<hash of the config>)", "--run-name"
    )


CACHES_HELP = (
    "cache spec(s), repeatable or comma-separated: dynamic (always run first), a kvquant preset or YAML, "
    "hf-quanto-int4, hf-quanto-int2, hf-hqq-int4, hf-fp8, or the groups presets / peers / all"
)


@dataclass
class EvalConfig:
    model: ModelSection = field(default_factory=ModelSection)
    corpus: CorpusSection = field(default_factory=CorpusSection)
    caches: list[str] = opt(["dynamic", "int8", "int4"], CACHES_HELP, "--cache")
    quality: QualitySection = field(default_factory=QualitySection)
    retrieval: RetrievalSection = field(default_factory=RetrievalSection)
    free_run: FreeRunSection = field(default_factory=FreeRunSection)
    memory: Task = field(default_factory=Task)
    speed: SpeedSection = field(default_factory=SpeedSection)
    output: OutputSection = field(default_factory=OutputSection)
    seed: int = opt(0, "seed of the passkeys")
    progress: bool = opt(True, "progress bars")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def identity(self) -> dict[str, Any]:
        """Everything that decides the numbers except the list of caches (and where output goes). The
        ``free_run`` section counts only when enabled (runs made before it existed keep their folder)."""
        d = self.to_dict()
        for key in ("caches", "output", "progress"):
            d.pop(key)
        if not self.free_run.enabled:
            d.pop("free_run")
        return d

    def identity_hash(self, extra: str = "") -> str:
        blob = json.dumps(self.identity(), sort_keys=True) + extra
        return hashlib.sha1(blob.encode()).hexdigest()[:8]

    def validate(self) -> None:
        """Check values that need no model or corpus; raises :class:`EvalError`."""
        self.model.check("model")
        self.quality.check("quality")
        self.retrieval.check("retrieval")
        self.free_run.check("free_run")
        self.speed.check("speed")
        check_caches(self.caches)

    @property
    def tasks(self) -> list[str]:
        return [t for t in TASKS if getattr(self, t).enabled]


def cast(obj: Any, cls: type[C], **changes: Any) -> C:
    """A ``cls`` holding the fields of ``obj`` it shares (e.g. a sweep section as an eval section)."""
    shared = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
    return cls(**{**shared, **changes})


# ------------------------------------------------------------------------------------------ loading


def _configs_dir():
    return importlib.resources.files("kvquant.configs")


def shipped(folder: str = "eval", prefix: str = "") -> list[str]:
    """Names of the YAML files shipped in ``configs/<folder>`` whose name starts with ``prefix``."""
    d = _configs_dir() / folder if folder else _configs_dir()
    if not d.is_dir():
        return []
    files = [p.name for p in d.iterdir() if p.name.startswith(prefix) and p.name.endswith(".yaml")]
    return sorted(n[len(prefix) : -len(".yaml")] for n in files)


def config_names() -> list[str]:
    """Names of the eval configs shipped in ``configs/eval/``."""
    return shipped("eval")


def find_yaml(spec: str | Path, folder: str = "eval", prefix: str = "", what: str = "configs") -> Path:
    """The file ``spec`` names: a path, else the name of a config shipped in ``configs/<folder>``."""
    path = Path(spec).expanduser()
    if not path.is_file() and str(spec) in shipped(folder, prefix):
        path = Path(str(_configs_dir() / folder / f"{prefix}{spec}.yaml"))
    if not path.is_file():
        names = ", ".join(shipped(folder, prefix)) or "none"
        raise EvalError(f"config: no such file {str(spec)!r}; shipped {what}: {names}")
    return path


def read_yaml(spec: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file given by path or by the name of a config in ``configs/eval/``;
    :class:`EvalError` naming the file when it is not UTF-8 text, not valid YAML, empty or not a mapping
    (an empty file is an error, not the defaults: more likely a failed write than a wish)."""
    path = find_yaml(spec)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise EvalError(f"config: {spec}: not a UTF-8 text file (a binary file?)") from None
    except yaml.YAMLError as exc:
        raise EvalError(f"config: {spec}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        raise EvalError(f"config: {spec}: empty; expected a mapping of settings (see configs/)")
    if not isinstance(data, dict):
        raise EvalError(f"config: {spec}: expected a mapping at the top level, got a {type(data).__name__}")
    return data


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
        changes[key] = _merge(current, value, path) if dataclasses.is_dataclass(current) else value
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


def load_yaml_config(cls: type[C], config: Any, overrides: dict[str, Any] | None, read=read_yaml) -> C:
    """``cls()`` defaults, then ``config`` (a ``cls``, a dict, or what ``read`` turns into a dict), then
    ``overrides`` (``{"dotted.key": value}``); validated."""
    if isinstance(config, cls):
        cfg = config
    else:
        cfg = cls()
        if config is not None:
            cfg = _merge(cfg, config if isinstance(config, dict) else read(config), "")
    if overrides:
        cfg = _merge(cfg, _unflatten(overrides), "")
    cfg.validate()
    return cfg


def load_config(
    config: EvalConfig | dict[str, Any] | str | Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> EvalConfig:
    """Defaults, then ``config`` (an EvalConfig, a dict, a YAML path or shipped name), then
    ``overrides`` (``{"dotted.key": value}``); validated."""
    return load_yaml_config(EvalConfig, config, overrides)


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["speed.repeats=5", "caches=[int4, int8]"]`` -> ``{"speed.repeats": 5, ...}`` (values as YAML)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EvalError(f"--set: expected KEY=VALUE (e.g. speed.repeats=5), got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out
