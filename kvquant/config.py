"""``KVQuantConfig``: what a cache stores, validated once, loadable from presets and YAML.

A config is a frozen dataclass. Keys and values pick their formats separately (``k8v4`` is a real
configuration). ``layer_overrides`` maps a layer index (negative counts from the end) to a dict of
fields that differ for that layer, e.g. ``{0: {"key_format": "int8"}, -1: {...}}``.

Example:
    >>> cfg = KVQuantConfig(key_format="int4", value_format="int4", residual_length=32)
    >>> cfg.for_layer(0, num_layers=30).key_format
    'int4'
    >>> KVQuantConfig.resolve("int8").key_format          # a preset name
    'int8'
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

# (the allowed values are re-exported: kvquant.config is where callers look for them)
from kvquant.config_checks import RETRIEVAL_UNITS, ROTATIONS, SMOOTHINGS, check_fields  # noqa: F401
from kvquant.formats import SCALE_DTYPES


def _dividing(group: int, head_dim: int) -> int:
    """The largest channel group <= ``group`` that divides ``head_dim``, a multiple of 8 if one does."""
    fits = [g for g in range(min(group, head_dim), 0, -1) if head_dim % g == 0]
    return next((g for g in fits if g % 8 == 0), fits[0])


@dataclass(frozen=True)
class KVQuantConfig:
    """How a :class:`~kvquant.KVQuantCache` stores keys and values.

    Attributes:
        key_format / value_format: one of ``none, int8, int4, int3, int2, fp8_e4m3, fp8_e5m2,
            nuq4, nuq3, nuq2, tcq3, tcq2`` (see :mod:`kvquant.formats`).
        key_axis: ``token`` (scales per token and channel group) or ``channel`` (KIVI: scales per
            channel over blocks of ``key_group_size`` tokens; the incomplete block stays in full
            precision until it fills).
        key_group_size / value_group_size: channels per scale (token axis; ``None`` = whole head,
            clipped to head_dim for narrower heads) or tokens per block (channel axis).
        rotation: ``none`` or ``hadamard`` (per-head Walsh-Hadamard before quantization).
        smoothing: keys only: ``none``, ``mean`` (subtract each channel's mean before quantizing,
            add it back after), ``channel`` (also divide by each channel's standard deviation) or
            ``auto`` (``channel`` for the heads whose channels' spreads differ widely, the largest
            >= 6x the median, as with QK-norm gains; ``mean`` for the others) or ``query`` (as
            ``auto``, but the heads it divides are divided by ``spread^(1-a) / query_rms^a``: the key
            channels the model's queries read most keep the finest steps; ``a`` 1/2 after a
            rotation, 1/4 without; the query sizes come from one probe of the model,
            :mod:`kvquant.query_scales`, when the cache is given the model, ``KVQuantCache(model,
            ...)``; with only its config the cache warns and smooths as ``auto``. In the other heads
            the queries' weighting cost passkey retrieval on SmolLM2, so they take the mean alone.
            Not with a ``key_map``, which weighs by the queries itself).
            The statistics are per (sequence, head), taken from the first tokens the layer
            quantizes (the prompt; sinks and padding excluded) and kept in the scale dtype; the
            round trip undoes them exactly. Keys carry large per-channel offsets (they cost range
            and are the same for every token, so attention ignores them); values do not gain
            (measured on SmolLM2: mean removal doubled the 2-bit value error), so they are left alone.
        sink_tokens: first tokens of each sequence kept in full precision.
        residual_length: most recent tokens kept in full precision before they are quantized.
        quantize_block: tokens the full-precision tail hands on together (token axis): they leave it
            once ``quantize_block`` of them have gathered past the ``residual_length`` newest, so a
            decode step quantizes (and moves tokens through the recent window) only every
            ``quantize_block`` steps, and the tail holds ``residual_length`` to ``residual_length +
            quantize_block - 1`` tokens. Each token is still quantized on its own: the codes are those
            of ``quantize_block=1``. The channel axis quantizes in blocks of ``key_group_size``
            tokens already (must be 1 there).
        recent_length: the next most recent tokens (after the residual window) kept in the finer
            ``recent_key_format`` / ``recent_value_format`` (token axis, the same group sizes); a
            token leaving this window is re-quantized from its recent codes into the main formats.
            Decoding attends mostly to recent tokens: on SmolLM2 (WikiText-2, 1k-token prefixes) 64
            tokens in ``nuq4`` ahead of ``nuq2``, with the residual cut from 8 to 4 tokens, took the
            mean KL from 0.152 to 0.111 for 0.06 more bits per element.
        scale_dtype: ``float16``, ``bfloat16`` or ``float32``.
        key_map: a key map (:mod:`kvquant.key_map`): the name of one shipped with kvquant
            (``smollm2``) or the path of a file from ``kvquant calibrate --key-map``. A calibrated
            ``[D, D]`` map per (layer, KV head) applied to the smoothed keys before the rotation, so
            that their quantization error falls where the model's queries look less; attention
            stays exact (the query is folded). Model-specific: calibrate one per model. From a YAML
            file, a relative path is taken from the file's folder.
        static_scales: path of a calibration file (``kvquant calibrate``) with per-(layer, head)
            scales; int8 / fp8 only. Codes then carry no per-token scales.
        retrieval_layers: keys and values of this many layers kept in ``retrieval_format``: the
            layers whose heads copy from far back, found by one probe of the model
            (:mod:`kvquant.retrieval_heads`) when the cache is given the model,
            ``KVQuantCache(model, ...)``; with only its config they cannot be found and every layer
            keeps its formats (a warning says so). Passkey retrieval at <= 3 bits fails on those
            layers' keys and values. A layer whose override sets ``key_format`` / ``value_format``
            keeps that one. 0: none (also in the cache's own config once resolved: its overrides
            then name the layers).
        retrieval_format: the key and value format of the retrieval layers (with channel-axis keys,
            one the channel axis can store, e.g. ``int4``).
        retrieval_unit: ``layer`` (whole layers, as above) or ``head``: the same number of KV heads
            as ``retrieval_layers`` layers hold (``retrieval_layers * kv_heads``), the best-scoring
            KV heads of any layer, so the bytes match and the finer format goes where the copying
            happens. Resolved into head overrides (``layer_overrides: {i: {heads: ...}}``).
        heads: ``{kv_head_index: {field: value}}``: overrides of single KV heads, in every layer at the
            top level, in one layer inside ``layer_overrides`` (merged head by head into the top
            level). A layer whose heads differ is stored as one sub-layer per group of alike heads
            (:class:`~kvquant.cache.head_split.HeadSplitLayer`), each attended by the fused decode.
        layer_overrides: ``{layer_index: {field: value}}``.
        name: a label (the preset name, when loaded from one).
    """

    key_format: str = "int8"
    value_format: str = "int8"
    key_axis: str = "token"
    key_group_size: int | None = None
    value_group_size: int | None = None
    rotation: str = "none"
    smoothing: str = "none"
    sink_tokens: int = 0
    residual_length: int = 0
    quantize_block: int = 1
    recent_length: int = 0
    recent_key_format: str = "nuq4"
    recent_value_format: str = "nuq4"
    scale_dtype: str = "float16"
    key_map: str | None = None
    static_scales: str | None = None
    retrieval_layers: int = 0
    retrieval_format: str = "nuq4"
    retrieval_unit: str = "layer"
    heads: dict[int, dict[str, Any]] = field(default_factory=dict)
    layer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    name: str = "custom"

    def __post_init__(self) -> None:
        check_fields(self)

    # ------------------------------------------------------------------------------------ derived

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    @property
    def tail_block(self) -> int:
        """Tokens that leave the full-precision tail together: ``key_group_size`` on the channel
        axis, else ``quantize_block``."""
        return self.key_group_size if self.key_axis == "channel" else self.quantize_block

    @property
    def is_passthrough(self) -> bool:
        return self.key_format == "none" and self.value_format == "none"

    def for_layer(self, layer_idx: int, num_layers: int) -> KVQuantConfig:
        """The config of one layer: this one with its override (if any) applied, without overrides
        (its ``heads`` merged, head by head and field by field, into the top-level ``heads``)."""
        over: dict[str, Any] = {}
        heads = {h: dict(f) for h, f in self.heads.items()}
        for idx, fields in self.layer_overrides.items():
            if idx % num_layers == layer_idx and -num_layers <= idx < num_layers:
                for h, head_fields in fields.get("heads", {}).items():
                    heads.setdefault(h, {}).update(head_fields)
                over.update({k: v for k, v in fields.items() if k != "heads"})
        return dataclasses.replace(self, layer_overrides={}, heads=heads, **over)

    def for_head(self, head: int) -> KVQuantConfig:
        """The config of one KV head of a layer config (:meth:`for_layer`): its head override (if any)
        applied, without head overrides.

        Example:
            >>> cfg = KVQuantConfig(key_format="nuq2", heads={1: {"key_format": "nuq4"}})
            >>> cfg.for_head(0).key_format, cfg.for_head(1).key_format
            ('nuq2', 'nuq4')
        """
        if self.layer_overrides:
            raise ValueError("layer_overrides: for_head takes one layer's config (for_layer first)")
        return dataclasses.replace(self, heads={}, **self.heads.get(head, {}))

    def head_groups(self, kv_heads: int) -> list[tuple[list[int], KVQuantConfig]]:
        """One layer's KV heads grouped by their config (:meth:`for_head`), in order of each group's
        first head: ``[(heads, config), ...]``; one group when no head differs. ``ValueError`` for a
        head override past ``kv_heads``.

        Example:
            >>> cfg = KVQuantConfig(key_format="nuq2", heads={1: {"key_format": "nuq4"}})
            >>> [(h, c.key_format) for h, c in cfg.head_groups(3)]
            [([0, 2], 'nuq2'), ([1], 'nuq4')]
        """
        extra = sorted(h for h in self.heads if h >= kv_heads)
        if extra:
            raise ValueError(
                f"heads: KV head {extra[0]} does not exist; this layer has {kv_heads} (allowed: "
                f"0 .. {kv_heads - 1})"
            )
        groups: dict[str, tuple[list[int], KVQuantConfig]] = {}
        for h in range(kv_heads):
            cfg = self.for_head(h)
            groups.setdefault(repr(cfg), ([], cfg))[0].append(h)
        return list(groups.values())

    def with_retrieval_layers(self, layers: list[int], num_layers: int) -> KVQuantConfig:
        """This config with the keys and values of ``layers`` (of ``num_layers``) in
        ``retrieval_format``, added to ``layer_overrides`` (a layer whose override sets ``key_format``
        or ``value_format`` keeps that one), and ``retrieval_layers`` 0: resolved, nothing left to
        probe for.

        Example:
            >>> cfg = KVQuantConfig(key_format="nuq2", retrieval_layers=1).with_retrieval_layers([18], 30)
            >>> cfg.layer_overrides
            {18: {'key_format': 'nuq4', 'value_format': 'nuq4'}}
        """
        over = {i: dict(fields) for i, fields in self.layer_overrides.items()}
        for field_name in ("key_format", "value_format"):
            pinned = {i % num_layers for i, f in self.layer_overrides.items() if field_name in f}
            for layer in layers:
                if layer not in pinned:
                    over.setdefault(layer, {})[field_name] = self.retrieval_format
        return dataclasses.replace(self, layer_overrides=over, retrieval_layers=0)

    def with_retrieval_heads(self, heads: list[tuple[int, int]], num_layers: int) -> KVQuantConfig:
        """This config with the keys and values of the KV heads ``heads`` (``(layer, kv_head)`` pairs,
        layers of ``num_layers``) in ``retrieval_format``, added as head overrides to
        ``layer_overrides`` (a layer or head whose override sets ``key_format`` or ``value_format``
        keeps that one), and ``retrieval_layers`` 0: resolved.

        Example:
            >>> cfg = KVQuantConfig(key_format="nuq2", retrieval_layers=1, retrieval_unit="head")
            >>> cfg.with_retrieval_heads([(18, 2), (17, 1)], 30).layer_overrides[18]
            {'heads': {2: {'key_format': 'nuq4', 'value_format': 'nuq4'}}}
        """
        over = {i: dict(fields) for i, fields in self.layer_overrides.items()}
        for layer, head in heads:
            layer_cfg = self.for_layer(layer, num_layers)
            pinned = {k for i, f in self.layer_overrides.items() if i % num_layers == layer for k in f}
            pinned |= set(layer_cfg.heads.get(head, {}))
            fields = {f: self.retrieval_format for f in ("key_format", "value_format") if f not in pinned}
            if fields:
                key = next((i for i in over if i % num_layers == layer), layer)
                layer_heads = {h: dict(f) for h, f in over.get(key, {}).get("heads", {}).items()}
                layer_heads.setdefault(head, {}).update(fields)
                over[key] = {**over.get(key, {}), "heads": layer_heads}
        return dataclasses.replace(self, layer_overrides=over, retrieval_layers=0)

    def with_key_map(self, key_map: str | None) -> KVQuantConfig:
        """This config with ``key_map`` set; ``smoothing: query`` becomes ``mean`` (a key map weighs
        the keys by the queries itself). ``kvquant calibrate --key-map`` measures with it for the map it
        writes, ``kvquant tune --key-map`` tunes with it.

        Example:
            >>> KVQuantConfig.resolve("nuq4").with_key_map("smollm2").smoothing
            'mean'
        """
        smoothing = "mean" if key_map is not None and self.smoothing == "query" else self.smoothing
        return dataclasses.replace(self, key_map=key_map, smoothing=smoothing)

    def group_sizes(self, head_dim: int) -> tuple[int, int]:
        """(key, value) group sizes for a head of ``head_dim`` channels (None -> head_dim). A
        channel group that does not divide the head becomes the largest one below it that does, a
        multiple of 8 where there is one (the kernels' lanes): ``int4`` (64) on head_dim 96 -> 48,
        on 80 -> 40, on 112 -> 56. (On the channel axis the key group counts tokens: kept.)"""
        kg = self.key_group_size if self.key_group_size is not None else head_dim
        vg = self.value_group_size if self.value_group_size is not None else head_dim
        if self.key_axis == "token":
            kg = _dividing(kg, head_dim)
        return kg, _dividing(vg, head_dim)

    # ------------------------------------------------------------------------------------ I/O

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVQuantConfig:
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a mapping of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"config: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(known))}"
            )
        data = dict(data)
        if "layer_overrides" in data and data["layer_overrides"] is None:
            data["layer_overrides"] = {}
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> KVQuantConfig:
        """A config from a YAML file holding a mapping of fields; ``ValueError`` naming the file when it
        is missing, a folder, not UTF-8 text, not valid YAML, empty, or not a mapping."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"config: {str(path)!r} is a folder, not a YAML file")
        if not path.is_file():
            raise ValueError(
                f"config: no such preset or YAML file {str(path)!r}; presets: {', '.join(preset_names())}"
            )
        data = _read_yaml(path)
        data.setdefault("name", path.stem)
        for f in ("key_map", "static_scales"):  # relative to the YAML file's folder, where it exists
            value = data.get(f)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                beside = path.parent / value
                if beside.exists():
                    data[f] = str(beside)
        return cls.from_dict(data)

    @classmethod
    def from_preset(cls, name: str) -> KVQuantConfig:
        """A shipped preset by name (an old name in :data:`PRESET_ALIASES` loads its preset, labelled
        with the name it was asked by)."""
        path = _presets_dir() / f"{PRESET_ALIASES.get(name, name)}.yaml"
        if not path.is_file():
            raise ValueError(f"preset: unknown preset {name!r}; allowed: {', '.join(preset_names())}")
        data = _read_yaml(Path(str(path)))
        data["name"] = name
        return cls.from_dict(data)

    @classmethod
    def resolve(cls, spec: KVQuantConfig | str | Path | dict[str, Any] | None) -> KVQuantConfig:
        """A config from a config, a preset name (tried first), a YAML path, or a dict."""
        if spec is None:
            return cls.from_preset("int4")
        if isinstance(spec, KVQuantConfig):
            return spec
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        if isinstance(spec, str) and is_preset(spec):
            return cls.from_preset(spec)
        if isinstance(spec, (str, Path)):
            return cls.from_yaml(spec)
        raise ValueError(
            f"config: expected a preset name, YAML path, dict or KVQuantConfig, got {type(spec).__name__}"
        )


def _read_yaml(path: Path) -> dict[str, Any]:
    """The mapping of fields in a config file; ``ValueError`` naming the file otherwise (an empty file
    is an error, not the defaults: it is more likely a failed write than a wish for int8)."""
    where = f"config: {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not a UTF-8 text file (a binary file?)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(exc).split())})") from None
    if data is None:
        raise ValueError(f"{where}: empty; expected a mapping of fields, e.g. 'key_format: int4'")
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: expected a mapping of fields (e.g. 'key_format: int4'), got a {type(data).__name__}"
        )
    return data


def _presets_dir():
    return importlib.resources.files("kvquant.configs") / "presets"


# Old preset names that still load: name -> the preset it now is. Not listed by preset_names().
PRESET_ALIASES = {
    "int4-rot": "int4",  # one recipe since 2026-12-07, when int4 took the rotation (README "Presets")
}


def is_preset(name: str) -> bool:
    """Whether ``name`` is a shipped preset or an alias of one."""
    return name in PRESET_ALIASES or name in preset_names()


def preset_names() -> list[str]:
    """Names of the presets shipped in ``configs/presets``."""
    d = _presets_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in d.iterdir() if p.name.endswith(".yaml"))
