"""`kvquant tune --per-head`: the allocation over (layer, KV head) pairs on a tiny model whose KV
heads differ in sensitivity inside one layer, the per-head probe equal to a cache of that config, the
bits equal to the eval's, and the config stored as head-split layers."""

import dataclasses

import pytest
import torch

from kvquant import KVQuantCache
from kvquant.cache import HeadSplitLayer
from kvquant.models import tiny_model
from kvquant.tools.tune import DEFAULT_BASE, build_config, config_bits, decode_kl, prefill, tune
from kvquant.tools.tune.probes import _probe_batch

BASE = dataclasses.replace(DEFAULT_BASE, recent_length=8, sink_tokens=2, residual_length=2)
MENU = ("tcq2", "tcq3", "nuq4")


@pytest.fixture(scope="module")
def split_heads():
    """A tiny llama (4 layers, 2 KV heads of 2 query heads each) whose layer 1 reads KV head 0 eight
    times louder and KV head 1 twenty times softer (its o_proj's input columns scaled)."""
    model = tiny_model("llama", num_hidden_layers=4)
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        o = model.model.layers[1].self_attn.o_proj.weight  # [hidden, Hq * D]
        o[:, : 2 * d].mul_(8.0)
        o[:, 2 * d :].mul_(0.05)
    return model


def _windows(seed: int) -> torch.Tensor:
    return torch.randint(4, 128, (2, 60), generator=torch.Generator().manual_seed(seed))


def test_a_per_head_probe_is_the_decode_kl_of_that_head_alone(split_heads):
    calib = prefill(split_heads, _windows(1), 48)
    job = ("value", "tcq2", 1, 0)
    kl = _probe_batch(split_heads, calib, BASE, [job, ("value", "tcq2", 1, 1)])
    off = {
        "key_format": "none",
        "value_format": "none",
        "recent_key_format": "int8",
        "recent_value_format": "int8",
    }
    head = {"key_format": "none", "recent_key_format": "int8", "value_format": "tcq2"}
    cfg = dataclasses.replace(BASE, **off, layer_overrides={1: {"heads": {0: head}}})
    assert kl[0] == pytest.approx(decode_kl(split_heads, calib, cfg), rel=2e-2)
    assert kl[0] > 10 * kl[1]  # the loud head's values matter, the soft head's hardly


def test_per_head_tuning_gives_the_loud_head_the_bits_and_beats_the_per_layer_tuner(split_heads):
    calib = prefill(split_heads, _windows(2), 48)
    held_out = prefill(split_heads, _windows(3), 48)
    lo = config_bits(build_config(BASE, {"key": ["tcq2"] * 4, "value": ["tcq2"] * 4}), split_heads.config, 59)
    hi = config_bits(build_config(BASE, {"key": ["tcq3"] * 4, "value": ["tcq3"] * 4}), split_heads.config, 59)
    budget = (lo + hi) / 2
    kw = dict(budget_bits=budget, base=BASE, formats=MENU, measure="all", verify=False)
    heads = tune(split_heads, calib, per_head=True, **kw)
    layers = tune(split_heads, calib, **kw)
    assert heads.kv_heads == 2 and len(heads.formats["value"]) == 8  # unit i * 2 + h: layer i, head h
    rank = {"tcq2": 0, "tcq3": 1, "nuq4": 2}
    assert rank[heads.formats["value"][2]] > rank[heads.formats["value"][3]]  # layer 1: loud > soft
    assert heads.met and heads.bits <= budget + 1e-9
    assert heads.bits == pytest.approx(config_bits(heads.config, split_heads.config, 59))
    cache = KVQuantCache(split_heads.config, heads.config)
    assert isinstance(cache.layers[1], HeadSplitLayer)
    # (measured: 0.0038 against 0.0072; the per-layer tuner must give both heads of layer 1 one format)
    assert decode_kl(split_heads, held_out, heads.config) < 0.8 * decode_kl(
        split_heads, held_out, layers.config
    )
    assert " 1.0  " in heads.table() and "(per KV head)" in heads.summary()


def test_tune_cli_per_head_writes_head_rows_and_a_config_the_cache_takes(tiny_model_dir, tmp_path, capsys):
    from kvquant import KVQuantConfig
    from kvquant.models import load_model
    from kvquant.tools.cli import main

    out, sens = tmp_path / "tuned.yaml", tmp_path / "sens.json"
    base = tmp_path / "base.yaml"
    BASE.to_yaml(base)
    args = ["tune", "--model", str(tiny_model_dir), "--budget-bits", "4.6", "--windows", "1"]
    args += ["--prefix-len", "40", "--score-len", "8", "--formats", "tcq2,tcq3", "--measure", "scaled"]
    args += ["--base", str(base), "--per-head", "--no-verify", "--no-progress", "--sensitivity", str(sens)]
    assert main(args + ["--out", str(out)]) == 0, capsys.readouterr().out
    body = out.read_text()
    assert "--per-head" in body.splitlines()[0] and "per-head formats" in body
    assert "#   1.1  tcq" in body  # layer 1, KV head 1
    model, _ = load_model(str(tiny_model_dir))
    cache = KVQuantCache(model, KVQuantConfig.from_yaml(out))
    with torch.no_grad():
        model(input_ids=torch.randint(4, 100, (1, 30)), cache=cache)
    assert cache.get_seq_length() == 30
    # the measurements, one per (layer, head), are reused for another budget
    assert main(args + ["--out", str(tmp_path / "again.yaml")]) == 0
    assert "sensitivities reused" in (tmp_path / "again.yaml").read_text()
