"""The capacity planner: bytes from the config alone equal what the cache really holds."""

import json
from functools import cache

import pytest
import torch

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.config import preset_names
from kvquant.memory import model_cache_bytes
from kvquant.models import tiny_config, tiny_model
from kvquant.planning import (
    PlanError,
    _KVModel,
    estimate_parameters,
    max_context,
    parse_reserve,
    parse_size,
    plan,
    tp_split,
)
from kvquant.tools.cli import main
from kvquant.tools.plan import format_table

# family name -> (tiny family, overrides)
VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-hd64": ("llama", {"head_dim": 64}),
    "llama-hd128": ("llama", {"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1}),
    "llama-hd256": ("llama", {"head_dim": 256, "num_attention_heads": 2, "num_key_value_heads": 1}),
    "mistral-sliding": ("mistral", {}),
    "gemma3-sliding": ("gemma3", {}),
}


@cache
def _model(variant):
    family, overrides = VARIANTS[variant]
    return tiny_model(family, **overrides)


def _run(model, preset, context, prefill):
    cache = KVQuantCache(model, preset, initial_capacity=8)  # the model: retrieval layers probed
    ids = torch.randint(3, 100, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :prefill], cache=cache)
        for t in range(prefill, context):
            model(input_ids=ids[:, t : t + 1], cache=cache)
    return cache


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("context,prefill", [(45, 41), (203, 200)])
def test_planned_bytes_equal_cache_nbytes(variant, context, prefill):
    model = _model(variant)
    rows = plan(model.config, "1GiB", context, kv_dtype=4, weights_dtype="fp32")
    by_name = {r["config"]: r for r in rows}
    assert set(by_name) == set(preset_names()) | {"reference"}
    for preset in preset_names():
        cache = _run(model, preset, context, prefill)
        row = by_name[preset]
        assert row["kv_bytes"] == cache.nbytes(), preset
        assert row["effective_bits"] == pytest.approx(cache.effective_bits()), preset
        assert row["bytes_per_token"] == pytest.approx(cache.nbytes() / context)
    assert by_name["reference"]["kv_bytes"] == by_name["none"]["kv_bytes"]
    assert by_name["reference"]["effective_bits"] == pytest.approx(32.0)


def test_planned_bytes_with_layer_overrides():
    model = _model("gemma3-sliding")
    quant = KVQuantConfig.from_dict(
        {
            **KVQuantConfig.from_preset("kivi2").to_dict(),
            "name": "mixed",
            "layer_overrides": {0: {"key_format": "int8", "key_axis": "token"}, -1: {"residual_length": 5}},
        }
    )
    cache = _run(model, quant, 77, 70)
    (row, _ref) = plan(model.config, "1GiB", 77, kv_dtype=4, weights_dtype="fp32", presets=[quant])
    assert row["kv_bytes"] == cache.nbytes()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("preset", ["int4", "kivi2", "none"])
def test_bytes_scale_linearly_with_batch(family, preset):
    kv = _KVModel(tiny_config(family), KVQuantConfig.from_preset(preset), 2)
    for t in (1, 17, 100, 300):
        assert kv.bytes(t, 5) == 5 * kv.bytes(t, 1)


@pytest.mark.parametrize("family", ["llama", "llama-mha", "qwen2", "mistral", "gemma2", "gemma3"])
def test_parameter_estimate_matches_tiny_models(family):
    overrides = {"num_key_value_heads": 4} if family == "llama-mha" else {}
    family = family.split("-")[0]
    model = tiny_model(family, **overrides)
    assert estimate_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_hand_computed_budget():
    cfg = tiny_config("llama")  # 2 layers, 2 KV heads x 16, vocab 128, hidden 64, MLP 128, untied
    params = 2 * 128 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert params == 90432 == estimate_parameters(cfg)
    weights, reserve = params * 4, 1000
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x heads x head_dim x fp32
    available = per_token * 300 + 100
    memory = weights + reserve + available
    rows = plan(cfg, memory, 100, batch=2, weights_dtype="fp32", kv_dtype="fp32", reserve=reserve)
    ref = rows[-1]
    assert ref["config"] == "reference"
    assert ref["weights_bytes"] == weights and ref["available_bytes"] == available
    assert ref["kv_bytes"] == 100 * per_token == 51200
    assert ref["bytes_per_token"] == per_token
    assert ref["max_batch"] == available // (100 * per_token) == 3
    assert ref["max_context"] == available // (2 * per_token) == 150
    assert not ref["max_context_capped"]
    # batch 1 fits 300 tokens; more memory: capped at max_position_embeddings (512)
    (ref1,) = [
        r
        for r in plan(cfg, memory, 100, weights_dtype=4, kv_dtype=4, reserve=1000)
        if r["config"] == "reference"
    ]
    assert ref1["max_context"] == 300
    big = plan(cfg, "1GiB", 100, weights_dtype=4, kv_dtype=4, presets=["int4"])
    assert all(r["max_context"] == 512 and r["max_context_capped"] for r in big)
    assert "(cap)" in format_table(big, "tiny")


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize(
    "preset",
    [
        "int4",
        "kivi2",
        "kivi4",
        "k8v4",
        {
            "key_format": "int2",
            "value_format": "int4",
            "key_axis": "channel",
            "key_group_size": 5,
            "sink_tokens": 3,
            "residual_length": 7,
        },
        {
            "key_format": "int4",
            "value_format": "int4",
            "key_axis": "channel",
            "key_group_size": 16,
            "sink_tokens": 9,
            "residual_length": 2,
            "layer_overrides": {0: {"key_group_size": 3}},
        },
    ],
)
def test_max_context_is_the_prefix_peak_search(family, preset):
    """Bytes are not monotone in the context (KIVI blocks, sinks leaving windows): the max context is
    the largest t such that every context up to t fits, checked against brute force."""
    cfg = tiny_config(family)
    quant = KVQuantConfig.resolve(preset)
    kv = _KVModel(cfg, quant, 4)
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(cfg)
    windows = [k.get("sliding_window") for k in kwargs]
    curve = [model_cache_bytes(quant, types, windows, t, 1, 2, 16, 4) for t in range(513)]
    assert curve == [kv.bytes(t) for t in range(513)]
    peak, running = [], 0
    for b in curve:
        running = max(running, b)
        peak.append(running)
    for available in sorted({*curve[1::7], *(c - 1 for c in curve[1::11])}):
        expect = max(t for t in range(513) if peak[t] <= available)
        assert max_context(kv, available, 1, 512) == expect, available


def test_sizes_and_reserve():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("12345") == 12345
    assert parse_size("1.5 GiB") == 3 * 2**29
    assert parse_reserve("10%", 1000) == 100
    assert parse_reserve("4GiB", 1000) == 4 * 2**30
    for bad in ("80XB", "", "GiB", "-1"):
        with pytest.raises(PlanError, match="memory"):
            parse_size(bad, "memory")


def _cli(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def config_json(tmp_path):
    tiny_config("gemma3").save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def test_cli_table_lists_every_preset_and_reference(capsys, config_json):
    rc, out, err = _cli(capsys, "--model", config_json, "--memory", "1GiB", "--context", "300")
    assert rc == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    labels = [line.split("|")[1].strip() for line in rows]
    assert labels == [*preset_names(), "fp16/bf16 (bf16)"]
    assert "activation reserve" in out and "(10%)" in out


def test_cli_json(capsys, config_json):
    rc, out, _ = _cli(capsys, "--model", config_json, "--memory", "1GiB", "--context", "64", "--json")
    assert rc == 0
    data = json.loads(out)
    assert [r["config"] for r in data["rows"]] == [*preset_names(), "reference"]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--presets", "int4,bogus"], "--presets"),
        (["--memory", "80XB"], "--memory"),
        (["--memory", "1KiB"], "--memory"),  # weights exceed memory
        (["--model", "/no/such/config.json"], "--model"),
        (["--reserve", "x%"], "--reserve"),
        (["--weights-dtype", "fp5"], "--weights-dtype"),
        (["--context", "0"], "--context"),
    ],
)
def test_cli_errors_exit_2(capsys, config_json, argv, flag):
    base = {"--model": config_json, "--memory": "1GiB", "--context": "64"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    rc, out, err = _cli(capsys, *[x for kv in base.items() for x in kv])
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith(f"kvquant plan: error: {flag}:")


# ------------------------------------------------------------------------------------------ --tp


@pytest.mark.parametrize(
    "heads,kv,tp,per_device,replication",
    [(4, 2, 1, 2, 1), (4, 2, 2, 1, 1), (8, 2, 4, 1, 2), (8, 2, 8, 1, 4), (8, 8, 4, 2, 1)],
)
def test_tp_split_partitions_or_replicates_kv_heads(heads, kv, tp, per_device, replication):
    cfg = tiny_config(
        "llama", num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, hidden_size=16 * heads
    )
    split = tp_split(cfg, tp)
    assert (split["kv_heads_per_device"], split["kv_replication"]) == (per_device, replication)
    # every KV head is held somewhere, and each as many times as it is replicated
    assert per_device * tp == kv * replication


@pytest.mark.parametrize(
    "heads,kv,tp,text",
    [
        (4, 2, 3, "attention heads"),
        (12, 6, 4, "do not divide the model's 6 KV heads"),
        (12, 4, 6, "multiple"),
    ],
)
def test_tp_split_refuses_what_engines_refuse(heads, kv, tp, text):
    cfg = tiny_config(
        "llama", num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, hidden_size=16 * heads
    )
    with pytest.raises(PlanError, match=text):
        tp_split(cfg, tp)


@pytest.mark.parametrize("heads,kv,tp", [(4, 4, 2), (8, 2, 4)])
def test_plan_per_device_bytes(heads, kv, tp):
    """KV bytes per device are those of the KV heads one device holds (a one-device plan of a model
    with that many KV heads, for every preset); the weights split over the devices."""
    cfg = tiny_config(
        "llama", num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, hidden_size=16 * heads
    )
    held = max(1, kv // tp)
    one = tiny_config(
        "llama", num_attention_heads=heads, num_key_value_heads=held, head_dim=16, hidden_size=16 * heads
    )
    kw = dict(weights_dtype="fp32", reserve="0%")
    rows = plan(cfg, "1GiB", 300, tp=tp, **kw)
    ref, single = plan(one, "1GiB", 300, **kw), plan(cfg, "1GiB", 300, **kw)
    for r, q, s in zip(rows, ref, single, strict=True):
        assert r["config"] == q["config"] == s["config"]
        assert r["kv_bytes"] == q["kv_bytes"], r["config"]
        assert r["kv_bytes"] * kv == s["kv_bytes"] * held, r["config"]
        assert (r["tp"], r["kv_heads_per_device"]) == (tp, held)
        assert r["max_batch"] >= s["max_batch"]
    assert rows[0]["weights_bytes"] == -(-estimate_parameters(cfg) * 4 // tp)


def test_cli_tp_table_says_per_device_and_replication(capsys, tmp_path):
    tiny_config(
        "llama", num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=128
    ).save_pretrained(tmp_path)
    rc, out, err = _cli(
        capsys, "--model", str(tmp_path / "config.json"), "--memory", "1GiB", "--context", "64", "--tp", "4"
    )
    assert rc == 0, err
    assert "memory per device" in out and "1 of 2 KV heads per device" in out
    assert "replicated on 2 devices" in out and "KV bytes / seq per device" in out


@pytest.mark.parametrize("tp,text", [("0", "--tp: expected an integer >= 1"), ("3", "--tp: 3 devices")])
def test_cli_bad_tp_exit_2(capsys, config_json, tp, text):
    rc, out, err = _cli(capsys, "--model", config_json, "--memory", "1GiB", "--context", "64", "--tp", tp)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvquant plan: error: {text}"), err
