"""`kvquant tune`: the allocation rule on hand-made sensitivities, the whole search on a tiny model,
and the CLI end to end."""

import re

import pytest
import torch
import yaml

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.tools.cli import main
from kvquant.tools.tune import DEFAULT_BASE, LADDER, allocate, build_config, rung_bits, tune

BITS = {"lo": 2.0, "mid": 3.0, "hi": 4.0}
# layer 0 is sensitive, layer 1 barely, layer 2 in between
SENS = {"lo": [0.50, 0.02, 0.10], "mid": [0.10, 0.01, 0.03], "hi": [0.01, 0.005, 0.01]}


def test_allocate_meets_a_kl_budget_with_the_cheapest_upgrades():
    rungs, met = allocate(SENS, BITS, budget_kl=0.2)
    assert met and rungs == ["hi", "lo", "lo"]  # one upgrade, on the layer that gains most per bit
    assert sum(SENS[r][i] for i, r in enumerate(rungs)) <= 0.2
    rungs, met = allocate(SENS, BITS, budget_kl=0.08)
    assert met and rungs == ["hi", "lo", "mid"]
    rungs, met = allocate(SENS, BITS, budget_kl=1e-4)  # out of reach: everything on the top rung
    assert not met and rungs == ["hi", "hi", "hi"]


def test_allocate_within_a_bits_budget():
    rungs, met = allocate(SENS, BITS, budget_bits=2.0)
    assert met and rungs == ["lo", "lo", "lo"]
    rungs, met = allocate(SENS, BITS, budget_bits=8 / 3)  # room for two extra bits in total
    assert met and rungs == ["hi", "lo", "lo"]
    assert sum(BITS[r] for r in rungs) / 3 <= 8 / 3 + 1e-9
    _, met = allocate(SENS, BITS, budget_bits=1.5)  # below the cheapest rung
    assert not met
    with pytest.raises(ValueError, match="budget: give exactly one"):
        allocate(SENS, BITS)
    with pytest.raises(ValueError, match="budget: give exactly one"):
        allocate(SENS, BITS, budget_kl=0.1, budget_bits=3)


def test_rung_bits_and_config_building():
    assert rung_bits(DEFAULT_BASE, ("nuq4", "nuq2"), 64) == pytest.approx((4.25 + 2.25) / 2)
    assert rung_bits(DEFAULT_BASE, ("int4", "int4"), 64) == pytest.approx(4.5)  # scale + zero point
    cfg = build_config(DEFAULT_BASE, ["k4v4", "k2v2", "k2v2"], LADDER)
    assert (cfg.key_format, cfg.value_format) == LADDER["k2v2"]
    assert cfg.layer_overrides == {0: {"key_format": "nuq4", "value_format": "nuq4"}}
    assert cfg.for_layer(0, 3).key_format == "nuq4" and cfg.for_layer(2, 3).key_format == "nuq2"


def test_tune_on_a_tiny_model(tiny):
    ids = torch.randint(0, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    loose = tune(tiny, ids, budget_kl=1.0)
    assert loose.met and set(loose.rungs) == {"k2v2"}  # everything cheap meets a loose budget
    n = tiny.config.num_hidden_layers
    assert all(len(v) == n for v in loose.sensitivity.values())
    # per layer, 8-bit costs less KL than 2-bit (the measurement sees the bits)
    assert all(loose.sensitivity["k8v8"][i] < loose.sensitivity["k2v2"][i] for i in range(n))
    budget = min(loose.sensitivity["k2v2"]) * 0.5  # forces upgrades on every layer
    tight = tune(tiny, ids, budget_kl=budget)
    assert tight.met and tight.predicted_kl <= budget
    assert tight.format_bits > loose.format_bits
    KVQuantCache(tiny.config, tight.config)  # a config a cache accepts


def test_tune_cli_writes_a_loadable_config(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tuned.yaml"
    code = main(
        [
            "tune",
            "--model",
            str(tiny_model_dir),
            "--budget-bits",
            "3",
            "--window-len",
            "64",
            "--windows",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    cfg = KVQuantConfig.from_yaml(out)
    assert yaml.safe_load(out.read_text())["smoothing"] == "mean"
    assert "meets the budget" in text and f"wrote {out}" in text
    layers = sum(1 for line in text.splitlines() if re.match(r"\s*\d+\s+k\dv\d\s", line))
    assert layers == 2  # one table row per layer of the tiny llama
    assert cfg.name == "tuned"


def test_tune_cli_bad_input_is_one_line(tmp_path, capsys):
    code = main(["tune", "--budget-kl", "0.1", "--windows", "0", "--out", str(tmp_path / "x.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvquant tune: error: --windows: expected an integer >= 1")
    assert err.count("\n") == 1
    assert main(["tune", "--out", "x.yaml"]) == 2  # a budget is required
    assert "--budget-kl" in capsys.readouterr().err
