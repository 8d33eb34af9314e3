"""`kvquant tune`: the exact allocation, the decode-mode measurement (equal to the eval's), the
bits accounting (equal to the eval's), the tuner beating every uniform config on a tiny model whose
layers differ in sensitivity, and the CLI end to end with its input checks."""

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from transformers import DynamicCache

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.memory import layer_bytes
from kvquant.models import tiny_model
from kvquant.tools.cli import main
from kvquant.tools.commands.tune import _TUNE_MENU
from kvquant.tools.tune import (
    DEFAULT_BASE,
    MENU,
    allocate,
    build_config,
    check_pins,
    config_bits,
    decode_kl,
    prefill,
    probe_config,
    tensor_costs,
    tune,
)
from kvquant.tools.tune.costs import _layer_cfg
from kvquant.tools.tune.probes import _probe_batch

# a base the tiny windows (48 + 12 tokens) exercise in every tier
BASE = dataclasses.replace(DEFAULT_BASE, recent_length=8, sink_tokens=2, residual_length=2)
SMALL_MENU = ("tcq2", "tcq3", "nuq4")


@pytest.fixture(scope="module")
def skewed():
    """A tiny llama (4 layers) whose layers differ in sensitivity: layer 1's attention output is
    scaled up 6x, layer 3's down 4x."""
    model = tiny_model("llama", num_hidden_layers=4)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(6.0)
        model.model.layers[3].self_attn.o_proj.weight.mul_(0.25)
    return model


def _windows(seed: int) -> torch.Tensor:
    return torch.randint(4, 128, (2, 60), generator=torch.Generator().manual_seed(seed))


def test_allocate_is_the_exact_knapsack():
    rng = random.Random(0)
    for _ in range(30):
        items = [
            {f"o{j}": (rng.choice([0, 1, 2, 4]), rng.random()) for j in range(rng.randint(1, 3))}
            for _ in range(rng.randint(1, 5))
        ]
        budget = rng.uniform(0, 8)
        feasible = [
            combo
            for combo in itertools.product(*(list(o) for o in items))
            if sum(items[i][c][0] for i, c in enumerate(combo)) <= budget
        ]
        choice, met = allocate(items, budget_cost=budget)
        assert met == bool(feasible)
        if feasible:
            best = min(sum(items[i][c][1] for i, c in enumerate(combo)) for combo in feasible)
            assert sum(items[i][c][0] for i, c in enumerate(choice)) <= budget
            assert sum(items[i][c][1] for i, c in enumerate(choice)) == pytest.approx(best)
    items = [{"lo": (1, 0.5), "hi": (3, 0.1)}, {"lo": (1, 0.2), "hi": (3, 0.15)}]
    assert allocate(items, budget_kl=0.4) == (["hi", "lo"], True)  # the cheapest meeting the KL
    assert allocate(items, budget_kl=0.01) == (["hi", "hi"], False)
    with pytest.raises(ValueError, match="budget: give exactly one"):
        allocate(items)


def test_costs_add_up_and_bits_match_the_eval():
    ref, costs = tensor_costs(BASE, MENU, heads=2, head_dim=16, tokens=59)
    for k, v in itertools.product(MENU, MENU):  # a layer's bytes: one cost per tensor
        assert (
            layer_bytes(_layer_cfg(BASE, k, v), 59, 1, 2, 16, 2)["total"]
            == ref + costs["key"][k] + costs["value"][v]
        )
    assert costs["key"]["tcq2"] < costs["key"]["tcq3"] < costs["key"]["nuq4"] < costs["key"]["int8"]
    # int8 takes the recent window along (it has more bits than the window's nuq4)
    assert _layer_cfg(BASE, "int8", "tcq2").recent_key_format == "int8"
    assert _layer_cfg(BASE, "tcq3", "tcq2").recent_key_format == "nuq4"
    # the eval's bits @16-bit of a real cache after a window equal the tuner's count
    model = tiny_model("llama")
    cfg = build_config(BASE, {"key": ["tcq3", "int8"], "value": ["tcq2", "nuq4"]})
    cache = KVQuantCache(model.config, cfg)
    teacher_forced_logprobs(model, _windows(0)[:1], 48, cache)
    from kvquant.eval.caches import cache_nbytes_16bit

    held = 16 * cache_nbytes_16bit(cache) / (59 * 2 * 2 * 16 * 2 * 2)
    assert config_bits(cfg, model.config, 59) == pytest.approx(held)


def test_bits_count_sliding_windows_as_the_eval_does():
    # gemma3: 3 sliding layers (window 8) + 1 full; after 59 positions the sliding ones hold their window
    from kvquant.eval.caches import cache_nbytes_16bit

    model = tiny_model("gemma3")
    cfg = dataclasses.replace(BASE, recent_length=4, sink_tokens=0)
    cache = KVQuantCache(model.config, cfg)
    teacher_forced_logprobs(model, _windows(0)[:1], 48, cache)
    text = model.config.get_text_config(decoder=True)
    fp16 = 59 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2 * 2
    held = 16 * cache_nbytes_16bit(cache) / fp16
    assert config_bits(cfg, model.config, 59) == pytest.approx(held)
    full = dataclasses.replace(model.config, layer_types=["full_attention"] * text.num_hidden_layers)
    assert config_bits(cfg, full, 59) > held  # the windows are what make it smaller


def test_decode_measurement_is_the_evals(skewed):
    ids = _windows(1)
    calib = prefill(skewed, ids, 48)
    cfg = build_config(BASE, {"key": ["tcq2", "nuq4", "tcq3", "tcq2"], "value": ["tcq3"] * 4})
    base = torch.cat(
        [teacher_forced_logprobs(skewed, w[None], 48, DynamicCache(config=skewed.config)) for w in ids]
    )
    test = torch.cat(
        [teacher_forced_logprobs(skewed, w[None], 48, KVQuantCache(skewed.config, cfg)) for w in ids]
    )
    from kvquant.eval.quality import kl_per_prediction

    assert torch.allclose(calib.reference, base, atol=1e-4)
    assert decode_kl(skewed, calib, cfg) == pytest.approx(
        kl_per_prediction(base, test).mean().item(), rel=1e-3
    )
    # the batched probes (several configs in one batch) equal one cache per probe
    jobs = [("key", "tcq2", 1), ("value", "tcq2", 1), ("key", "nuq4", 0)]
    batched = _probe_batch(skewed, calib, BASE, jobs)
    for (which, fmt, i), kl in zip(jobs, batched, strict=True):
        over = {j: {"key_format": "none", "value_format": "none"} for j in range(4)}
        one = dataclasses.replace(probe_config(BASE, which, fmt), layer_overrides={})
        over[i] = {
            f: getattr(one, f)
            for f in ("key_format", "value_format", "recent_key_format", "recent_value_format")
        }
        cfg = dataclasses.replace(
            BASE, recent_key_format="int8", recent_value_format="int8", layer_overrides=over
        )
        assert kl == pytest.approx(decode_kl(skewed, calib, cfg), rel=2e-2)  # batch-size rounding
    assert batched[0] > 0 and batched[0] > batched[2]


def test_probes_take_the_base_key_map(skewed, tmp_path):
    """A base with a key map: each probe's layer gets that layer's map (as a cache built from the
    config does), so the probe equals the cache's decode KL and differs from a probe without it."""
    from kvquant.tools.calibrate import calibrate_key_map

    calibrate_key_map(skewed, _windows(7).reshape(1, -1), BASE, tmp_path / "km.pt", window=60)
    mapped = dataclasses.replace(BASE, key_map=str(tmp_path / "km.pt"))
    calib = prefill(skewed, _windows(1), 48)
    job = ("key", "tcq2", 1)
    with_map, without = (
        _probe_batch(skewed, calib, mapped, [job])[0],
        _probe_batch(skewed, calib, BASE, [job])[0],
    )
    over = {j: {"key_format": "none", "value_format": "none"} for j in range(4)}
    one = dataclasses.replace(probe_config(mapped, *job[:2]), layer_overrides={})
    over[1] = {
        f: getattr(one, f) for f in ("key_format", "value_format", "recent_key_format", "recent_value_format")
    }
    cfg = dataclasses.replace(
        mapped, recent_key_format="int8", recent_value_format="int8", layer_overrides=over
    )
    assert with_map == pytest.approx(decode_kl(skewed, calib, cfg), rel=2e-2)
    assert with_map != pytest.approx(without, rel=1e-2)


def test_tuned_beats_every_uniform_config_on_held_out_windows(skewed):
    calib = prefill(skewed, _windows(2), 48)
    held_out = prefill(skewed, _windows(3), 48)
    lo = config_bits(build_config(BASE, {"key": ["tcq2"] * 4, "value": ["tcq2"] * 4}), skewed.config, 59)
    hi = config_bits(build_config(BASE, {"key": ["tcq3"] * 4, "value": ["tcq3"] * 4}), skewed.config, 59)
    budget = (lo + hi) / 2
    result = tune(
        skewed, calib, budget_bits=budget, base=BASE, formats=SMALL_MENU, measure="all", verify=False
    )
    assert result.met and result.bits <= budget + 1e-9
    assert result.bits == pytest.approx(config_bits(result.config, skewed.config, 59))
    # the sensitive layer gets the bits, the muted one the fewest
    rank = {"tcq2": 0, "tcq3": 1, "nuq4": 2}
    assert rank[result.formats["key"][1]] >= rank[result.formats["key"][3]]
    assert rank[result.formats["value"][1]] > rank[result.formats["value"][3]]
    tuned = decode_kl(skewed, held_out, result.config)
    for k, v in itertools.product(SMALL_MENU, SMALL_MENU):
        uniform = build_config(BASE, {"key": [k] * 4, "value": [v] * 4})
        if config_bits(uniform, skewed.config, 59) <= budget:
            assert tuned < decode_kl(skewed, held_out, uniform), (k, v)
    KVQuantCache(skewed.config, result.config)  # a config a cache accepts


def test_scaled_sensitivity_tracks_the_full_measurement(skewed):
    calib = prefill(skewed, _windows(4), 48)
    scaled = tune(skewed, calib, budget_bits=3.0, base=BASE, formats=SMALL_MENU, verify=False)
    full = tune(skewed, calib, budget_bits=3.0, base=BASE, formats=SMALL_MENU, measure="all", verify=False)
    for t in ("key", "value"):
        s, f = scaled.sensitivity[t]["tcq3"], full.sensitivity[t]["tcq3"]
        assert max(range(4), key=s.__getitem__) == max(range(4), key=f.__getitem__)  # same worst layer
        assert all(scaled.sensitivity[t]["nuq4"][i] < scaled.sensitivity[t]["tcq2"][i] for i in range(4))


def test_pins_are_kept_and_their_bytes_count(skewed):
    """A pinned tensor keeps its format (also one outside the menu), its bytes come out of the budget
    (a costly pin leaves the other tensors fewer bits), and the uniform configs checked against
    carry the pins too."""
    calib = prefill(skewed, _windows(2), 48)
    floor = build_config(BASE, {"key": ["tcq2", "tcq2", "tcq2", "int8"], "value": ["tcq2"] * 4})
    top = build_config(BASE, {"key": ["tcq3"] * 4, "value": ["tcq3"] * 4})
    budget = (config_bits(floor, skewed.config, 59) + config_bits(top, skewed.config, 59)) / 2
    free = tune(skewed, calib, budget_bits=budget, base=BASE, formats=SMALL_MENU, measure="all", verify=False)
    pins = {"key": {1: "tcq2", 3: "int8"}}
    sens = free.sensitivity
    pinned = tune(
        skewed, calib, budget_bits=budget, base=BASE, formats=SMALL_MENU, sensitivity=sens, pinned=pins
    )
    assert pinned.formats["key"][1] == "tcq2" and pinned.formats["key"][3] == "int8"
    assert pinned.met and pinned.bits <= budget + 1e-9
    assert pinned.bits == pytest.approx(config_bits(pinned.config, skewed.config, 59))
    rank = {"tcq2": 0, "tcq3": 1, "nuq4": 2}
    rest = [(t, i) for t in ("key", "value") for i in range(4) if (t, i) not in {("key", 1), ("key", 3)}]
    assert sum(rank[pinned.formats[t][i]] for t, i in rest) < sum(rank[free.formats[t][i]] for t, i in rest)
    layer3 = KVQuantCache(skewed.config, pinned.config).layers[3]
    assert layer3.config.key_format == "int8"
    assert all("with the pins" in name for name in pinned.measured if name != "tuned")
    assert "pinned keys: layer 1 tcq2, layer 3 int8" in pinned.summary()
    row3 = pinned.table().splitlines()[4]
    assert row3.startswith("    3  int8") and " - " in row3 and row3.endswith("pinned: key")


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        ({"query": {0: "int8"}}, "pinned: invalid tensor 'query'; allowed: key, value"),
        ({"key": {4: "int8"}}, "pinned: invalid key layer 4; allowed: 0..3"),
        ({"value": {0: "none"}}, "pinned: invalid value format 'none' at layer 0; allowed:"),
    ],
)
def test_bad_pins_name_the_field(pins, message):
    with pytest.raises(ValueError, match=message):
        check_pins(pins, 4)


def test_tune_cli_writes_a_commented_loadable_config(tiny_model_dir, tmp_path, capsys):
    out, sens = tmp_path / "tuned.yaml", tmp_path / "sens.json"
    assert _TUNE_MENU == ",".join(MENU)
    args = ["tune", "--model", str(tiny_model_dir), "--budget-bits", "5", "--windows", "1"]
    args += ["--prefix-len", "40"]  # 47 tokens held: the full-precision tiers weigh, 4.2-5 bits
    args += ["--score-len", "8", "--formats", "tcq2,tcq3", "--sensitivity", str(sens), "--out", str(out)]
    args += ["--base", str(_write(tmp_path / "base.yaml", BASE)), "--no-progress"]
    code = main(args)
    text = capsys.readouterr().out
    assert code == 0, text
    cfg = KVQuantConfig.from_yaml(out)
    assert cfg.smoothing == "mean" and cfg.name == "tuned"
    assert "meets the budget" in text and f"wrote {out}" in text and "measured on the calibration" in text
    body = out.read_text()
    assert body.startswith("# kvquant tune --budget-bits 5.0") and "#     1  tcq" in body
    assert yaml.safe_load(body)["key_format"] in ("tcq2", "tcq3")
    assert set(json.loads(sens.read_text())) == {"key", "value"}
    args[args.index("5")] = "4.3"  # a tighter budget on the same measurements (reused, not redone)
    assert main(args + ["--no-verify"]) == 0
    assert "tcq2" in capsys.readouterr().out


def _small_tune(model_dir, budget: str) -> list[str]:
    """``kvquant tune`` on the tiny model, one window of 40 prefilled tokens."""
    return [
        "tune",
        "--model",
        str(model_dir),
        "--budget-bits",
        budget,
        "--windows",
        "1",
        "--prefix-len",
        "40",
    ]


def _write(path, cfg):
    cfg.to_yaml(path)
    return path


def test_tune_cli_pin_keeps_a_configs_layer_formats(tiny_model_dir, tmp_path, capsys):
    """``--pin FILE``: the layer_overrides' formats of a config (what ``kvquant calibrate --retrieval``
    writes) are kept in the tuned config and named in its header."""
    pin = _write(tmp_path / "r.yaml", dataclasses.replace(BASE, layer_overrides={1: {"key_format": "int8"}}))
    out = tmp_path / "tuned.yaml"
    args = _small_tune(tiny_model_dir, "6")
    args += ["--score-len", "8", "--formats", "tcq2,tcq3", "--out", str(out), "--no-progress", "--no-verify"]
    args += ["--base", str(_write(tmp_path / "base.yaml", BASE)), "--pin", str(pin)]
    assert main(args) == 0, capsys.readouterr().err
    cfg = KVQuantConfig.from_yaml(out)
    assert cfg.layer_overrides[1]["key_format"] == "int8"
    assert f"--pin {pin}" in out.read_text().splitlines()[0]
    capsys.readouterr()
    args[args.index(str(pin))] = "int4"  # a preset without layer_overrides: nothing to pin
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--pin: config 'int4' has no layer_overrides with a key_format or value_format" in err
    assert err.count("\n") == 1


def test_tune_cli_key_map_reaches_the_base_and_the_config(tiny_model_dir, tmp_path, capsys):
    """``--key-map``: the tuned config keeps the map (its probes measured with it) and says so."""
    from transformers import AutoConfig

    from kvquant.key_map import save_key_map

    c = AutoConfig.from_pretrained(tiny_model_dir)
    d = c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    maps = {
        i: torch.eye(d) + 0.1 * torch.randn(c.num_key_value_heads, d, d, generator=g)
        for i in range(c.num_hidden_layers)
    }
    save_key_map(tmp_path / "km.pt", maps)
    out = tmp_path / "tuned.yaml"
    args = _small_tune(tiny_model_dir, "5")
    args += ["--score-len", "8", "--formats", "tcq2,tcq3", "--out", str(out), "--no-progress", "--no-verify"]
    args += ["--base", str(_write(tmp_path / "base.yaml", BASE)), "--key-map", str(tmp_path / "km.pt")]
    assert main(args) == 0, capsys.readouterr().err
    cfg = KVQuantConfig.from_yaml(out)
    assert Path(cfg.key_map) == tmp_path / "km.pt" and cfg.sink_tokens == BASE.sink_tokens
    assert f"--key-map {tmp_path / 'km.pt'}" in out.read_text().splitlines()[0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget-kl", "0.1", "--windows", "0"], "--windows: expected an integer >= 1"),
        (["--budget-bits", "3", "--formats", "tcq2,int9"], "--formats: invalid value 'int9'"),
        (["--budget-bits", "3", "--formats", "none"], "--formats: invalid value 'none'"),
        (["--budget-bits", "3", "--score-len", "1"], "--score-len: expected an integer >= 2"),
        (["--budget-bits", "0"], "--budget-bits"),
        (["--budget-bits", "3", "--measure", "some"], "--measure"),
        (["--budget-bits", "3", "--key-map", "no-such-map.pt"], "--key-map: key_map: no such key map file"),
        (["--budget-bits", "3", "--key-map", ""], "--key-map: key_map"),
    ],
)
def test_tune_cli_bad_input_is_one_line(tmp_path, capsys, extra, message):
    code = main(["tune", *extra, "--out", str(tmp_path / "x.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("kvquant tune: error:")
    assert err.count("\n") == 1


def test_tune_cli_needs_a_budget(capsys):
    assert main(["tune", "--out", "x.yaml"]) == 2
    assert "--budget-kl" in capsys.readouterr().err


def test_a_tuned_mix_decodes_on_the_fused_cpu_path():
    """Every format the tuner picks, mixed per layer and tensor, is read by the fused kernels: the
    `kvquant` attention gives the log-probs of the dequantizing path."""
    import kvquant

    cfg = build_config(
        BASE, {"key": ["tcq2", "nuq4", "int8", "nuq3"], "value": ["tcq3", "nuq2", "tcq2", "int8"]}
    )
    ids = _windows(5)[:1]
    model = tiny_model("llama", num_hidden_layers=4)
    plain = teacher_forced_logprobs(model, ids, 48, KVQuantCache(model.config, cfg))
    kvquant.enable(model)
    cache = KVQuantCache(model.config, cfg)
    fused = teacher_forced_logprobs(model, ids, 48, cache)
    assert cache.uses_views()
    assert torch.allclose(plain, fused, atol=2e-3)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs" / "tuned").glob("*.yaml")))
def test_shipped_tuned_configs_load_and_meet_their_budget(path):
    """``configs/tuned/smollm2-<B>bit.yaml``: a cache on SmolLM2's geometry accepts it and it holds at
    most B bits @16-bit at the end of a tuning window (1,087 positions)."""
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64
    )
    budget = float(path.stem.split("-")[1].removesuffix("bit").replace("p", "."))
    cfg = KVQuantConfig.from_yaml(path)
    KVQuantCache(smollm2, cfg)
    assert budget - 0.05 <= config_bits(cfg, smollm2, 1087) <= budget + 1e-9


def test_the_base_loses_its_retrieval_layers_the_tuner_places_every_layer():
    from kvquant.tools.tune import check_base

    assert KVQuantConfig.resolve("tcq2-recent").retrieval_layers == 4
    assert check_base("tcq2-recent").retrieval_layers == 0
