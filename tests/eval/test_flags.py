"""CLI flags derived from the config dataclasses (``add_config_flags`` / ``config_overrides``)."""

from __future__ import annotations

import argparse

import pytest

from kvquant.eval.config import EvalConfig, EvalError, load_config
from kvquant.eval.flags import add_config_flags, config_fields, config_overrides, tasks_overrides
from kvquant.eval.sweep_config import SweepConfig, load_sweep_config


def _parse(cls, argv):
    parser = argparse.ArgumentParser(prog="test", exit_on_error=False)
    add_config_flags(parser, cls)
    return config_overrides(parser.parse_args(argv), cls)


def test_the_eval_flags_of_today_map_to_the_same_keys():
    argv = [
        "--model",
        "m",
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "--device-map",
        "auto",
        "--attn",
        "eager",
    ]
    argv += ["--corpus", "c.txt", "--text-field", "body", "--cache", "int8,k8v4", "--cache", "int4"]
    argv += ["--mode", "simulated", "--prefix-len", "48", "--score-len", "12", "--windows", "2"]
    argv += ["--retrieval-lengths", "360,max", "--retrieval-trials", "1", "--speed-contexts", "32"]
    argv += ["--speed-batches", "1,8", "--decode-tokens", "2", "--warmup", "0", "--repeats", "1"]
    argv += ["--output-dir", "runs", "--run-name", "r", "--seed", "3", "--no-progress"]
    assert _parse(EvalConfig, argv) == {
        "model.name": "m",
        "model.dtype": "bfloat16",
        "model.device": "cpu",
        "model.device_map": "auto",
        "model.attn_implementation": "eager",
        "corpus.name": "c.txt",
        "corpus.text_field": "body",
        "caches": ["int8", "k8v4", "int4"],
        "quality.mode": "simulated",
        "quality.prefix_len": 48,
        "quality.score_len": 12,
        "quality.windows": 2,
        "retrieval.lengths": [360, "max"],
        "retrieval.trials": 1,
        "speed.context_lengths": [32],
        "speed.batch_sizes": [1, 8],
        "speed.decode_tokens": 2,
        "speed.warmup": 0,
        "speed.repeats": 1,
        "output.dir": "runs",
        "output.name": "r",
        "seed": 3,
        "progress": False,
    }
    assert _parse(EvalConfig, []) == {}  # flags not given leave the YAML / defaults alone


@pytest.mark.parametrize("cls", [EvalConfig, SweepConfig])
def test_every_field_has_a_flag_and_round_trips(cls):
    argv, expect = [], {}
    for key, _, t, default in config_fields(cls):
        section, _, leaf = key.rpartition(".")
        flag = "--" + (section if section and leaf in ("name", "enabled") else key.replace(".", "-"))
        flag = flag.replace("_", "-")
        if t is bool:
            argv.append(flag if not default else flag.replace("--", "--no-", 1))
            expect[key] = not default
        elif isinstance(default, list) or key == "capacity.contexts":
            argv += [flag, "7,9"]
            expect[key] = [7, 9] if key not in ("caches", "models") else ["7", "9"]
        else:
            value = {int: "5", float: "0.5"}.get(t, "x")
            argv += [flag, value]
            expect[key] = t(value) if t in (int, float) else value
    for key in ("model.dtype", "quality.mode"):  # fields with allowed values
        argv[argv.index("--" + key.replace(".", "-").replace("_", "-")) + 1] = (
            "float16" if "dtype" in key else "simulated"
        )
        expect[key] = "float16" if "dtype" in key else "simulated"
    assert _parse(cls, argv) == expect


def test_flags_feed_the_loaders():
    cfg = load_config(None, _parse(EvalConfig, ["--prefix-len", "100", "--no-speed", "--cache", "int4"]))
    assert cfg.quality.prefix_len == 100 and not cfg.speed.enabled and cfg.caches == ["int4"]
    argv = ["--budget-kl", "0.1", "--grid-contexts", "64,128", "--out", "o", "--decode-tokens", "4"]
    cfg = load_sweep_config("default", _parse(SweepConfig, argv))
    assert (cfg.recommend.max_kl, cfg.grid.contexts, cfg.out, cfg.speed.decode_tokens) == (
        0.1,
        [64, 128],
        "o",
        4,
    )
    assert cfg.quality.score_len == 32  # the YAML's own value stands


def test_help_shows_the_config_defaults_and_bad_values_are_refused():
    parser = argparse.ArgumentParser(prog="kvquant sweep")
    add_config_flags(parser, SweepConfig, skip=("name",))
    text = " ".join(parser.format_help().split())
    assert "--name" not in text and "--budget-kl" in text and "--capacity-reserve" in text
    assert "(default: 8)" in text and "(default: 10%)" in text  # the sweep's decode_tokens; a % in help
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'int8'"):
        _parse(EvalConfig, ["--dtype", "int8"])
    with pytest.raises(argparse.ArgumentError, match="expected comma-separated integers, got '1,x'"):
        _parse(EvalConfig, ["--speed-contexts", "1,x"])


def test_tasks_overrides():
    assert tasks_overrides("quality, speed") == {
        "quality.enabled": True,
        "memory.enabled": False,
        "speed.enabled": True,
        "retrieval.enabled": False,
        "free_run.enabled": False,
    }
    with pytest.raises(
        EvalError, match="--tasks: unknown task 'foo'; allowed: quality, memory, speed, retrieval"
    ):
        tasks_overrides("quality,foo")
