"""Command-line flags derived from the config dataclasses: a new config field is a new flag.

:func:`add_config_flags` adds one flag per leaf field of :class:`~kvquant.eval.config.EvalConfig` or
:class:`~kvquant.eval.sweep_config.SweepConfig` (help, aliases and allowed values from the field's
metadata, see :func:`~kvquant.eval.config.opt`); :func:`config_overrides` turns the parsed flags into
the ``{"dotted.key": value}`` overrides the loaders take, for the flags given only, so the YAML and
the defaults stand otherwise. Plain argparse rather than a library (simple-parsing, tyro,
jsonargparse): no new dependency, and today's flag names stay valid as aliases.

Example:
    >>> parser = argparse.ArgumentParser(prog="kvquant eval")
    >>> add_config_flags(parser, EvalConfig)
    >>> load_config("default", config_overrides(parser.parse_args(["--windows", "4"]))).quality.windows
    4
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from kvquant.eval.config import TASKS, EvalConfig, EvalError


def config_fields(config: Any) -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """``(dotted key, field, type, default)`` of every leaf field of a config dataclass (a class, whose
    defaults are those of ``config()``, or an instance), sections flattened; ``X | None`` given as ``X``."""
    out = []
    defaults = config() if isinstance(config, type) else config
    hints = typing.get_type_hints(type(defaults))
    for f in dataclasses.fields(defaults):
        t, default = hints[f.name], getattr(defaults, f.name)
        if dataclasses.is_dataclass(t):
            out += [(f"{f.name}.{key}", *rest) for key, *rest in config_fields(default)]
            continue
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) is not list and len(args) == 1:  # X | None
            t = args[0]
        out.append((f.name, f, t, default))
    return out


def flag_type(t: Any):
    """argparse ``type`` for a field of type ``t``: lists are comma-separated, ints and floats parsed."""
    if typing.get_origin(t) is list:
        item = flag_type(typing.get_args(t)[0])

        def parse(text: str) -> list:
            try:
                return [item(x.strip()) for x in text.split(",") if x.strip()]
            except ValueError:
                kind = "integers" if item is int else "numbers" if item is float else "values"
                raise argparse.ArgumentTypeError(f"expected comma-separated {kind}, got {text!r}") from None

        return parse
    if t in (int, float):
        return t
    if t is Any:  # e.g. retrieval lengths: integers or words ("max")
        return lambda x: int(x) if x.lstrip("-").isdigit() else x
    return str


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type = EvalConfig, skip: tuple[str, ...] = ()
) -> None:
    """Add one flag per leaf field of ``cls`` (:class:`EvalConfig`, ``SweepConfig``), one argument group
    per section, derived from the dataclasses so that a new field is a new flag.

    Names: ``--<section>-<field>`` (``--quality-prefix-len``); a section's ``name`` is ``--<section>``
    (``--model``, ``--corpus``) and its ``enabled`` the switch ``--<section>`` / ``--no-<section>``
    (``--no-speed``); a top-level field is ``--<field>``. Where a field's name is unique it is also
    ``--<field>`` (``--prefix-len``), and the names in its metadata (:func:`opt`) are aliases
    (``--attn``, ``--speed-contexts``, ``--cache``, ``--budget-kl``). Booleans are ``--x`` / ``--no-x``;
    lists are comma-separated and a repeated flag adds to the list. ``skip``: dotted keys left out.
    A flag not given leaves its key out of :func:`config_overrides`, so the YAML / defaults stand.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_config_flags(p, EvalConfig)
        >>> config_overrides(p.parse_args(["--prefix-len", "1024", "--cache", "int4,int8", "--no-speed"]))
        {'caches': ['int4', 'int8'], 'quality.prefix_len': 1024, 'speed.enabled': False}
    """
    leaves = [x for x in config_fields(cls) if x[0] not in skip]
    names = [x[0].rsplit(".", 1)[-1] for x in leaves]
    groups: dict[str, Any] = {}
    for key, f, t, default in leaves:
        section, _, leaf = key.rpartition(".")
        primary = "--" + (section if section and leaf in ("name", "enabled") else key.replace(".", "-"))
        flags = [primary.replace("_", "-")]
        if section and names.count(leaf) == 1 and leaf not in ("name", "enabled"):
            flags.append("--" + leaf.replace("_", "-"))
        flags += [x for x in f.metadata.get("flags", ()) if x not in flags]
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        kw: dict[str, Any] = {"dest": key, "default": argparse.SUPPRESS}
        kw["help"] = f"{f.metadata.get('help') or key} (default: {shown})".replace("%", "%%")
        is_list = typing.get_origin(t) is list
        if t is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=flag_type(t), metavar=leaf.upper() + (",..." if is_list else ""))
            kw.update({"action": "extend"} if is_list else {})
            kw.update({"choices": f.metadata["choices"]} if f.metadata.get("choices") else {})
        if section not in groups:
            groups[section] = parser.add_argument_group(section) if section else parser
        groups[section].add_argument(*flags, **kw)


def config_overrides(args: argparse.Namespace, cls: type = EvalConfig) -> dict[str, Any]:
    """``{"dotted.key": value}`` of the flags :func:`add_config_flags` added that were given."""
    return {key: getattr(args, key) for key, *_ in config_fields(cls) if hasattr(args, key)}


def tasks_overrides(text: str) -> dict[str, Any]:
    """``--tasks quality,speed`` -> ``{"quality.enabled": True, "memory.enabled": False, ...}``."""
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in TASKS]
    if unknown:
        raise EvalError(f"--tasks: unknown task {unknown[0]!r}; allowed: {', '.join(TASKS)}")
    return {f"{t}.enabled": t in chosen for t in TASKS}
