"""The CPU decode benchmark runs every contender (it reports speed; nothing here gates on time)."""

import json

import pytest
import torch
from transformers import DynamicCache

from kvquant.cache import KVQuantCache
from kvquant.config import KVQuantConfig, preset_names
from kvquant.kernels.cpu import native_available
from kvquant.models import tiny_model
from kvquant.tools.bench import bench_cpu, preset_backends, resolve_presets
from kvquant.tools.cli import build_parser, main


def test_every_contender_decodes_and_is_timed(tmp_path):
    model = tiny_model("llama")
    rows = bench_cpu(
        model=model, contexts=(40,), presets=("int4",), steps=2, repeats=1, warmup=0, out_dir=tmp_path
    )
    labels = [r["cache"] for r in rows]
    assert labels[:3] == ["DynamicCache", "kvquant int4 (fused)", "kvquant int4 (dequant)"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert (tmp_path / "bench_cpu.json").is_file() and (tmp_path / "bench_cpu.md").is_file()
    meta = json.loads((tmp_path / "bench_cpu.json").read_text())["meta"]
    assert meta["native_cpu_kernel"] == native_available()
    quanto = next(r for r in rows if r["cache"] == "QuantizedCache quanto int4")
    assert quanto["vs_quanto_int4"] == 1.0  # the column the CPU target is read from
    assert "vs quanto int4" in (tmp_path / "bench_cpu.md").read_text()


def test_bench_cli_parses_targets():
    args = build_parser().parse_args(["bench", "cpu", "--contexts", "1024,2048", "--presets", "int4,int8"])
    assert args.contexts == [1024, 2048] and args.presets == ["int4", "int8"]


# ------------------------------------------------------------------------------------------ every preset


def test_two_presets_give_every_contender_a_row_and_a_prefill_ratio(tmp_path, capsys):
    presets = ("int4", "tcq2-recent")
    rows = bench_cpu(
        model=tiny_model("llama"), contexts=(24, 40), presets=presets, steps=1, repeats=1, warmup=0,
        prefill=16, out_dir=tmp_path,
    )  # fmt: skip
    want = {"DynamicCache"} | {f"kvquant {p} ({m})" for p in presets for m in ("fused", "dequant")}
    for context in (24, 40):
        labels = {r["cache"] for r in rows if r["context"] == context}
        assert want <= labels
    assert [r["context"] for r in rows] == sorted(r["context"] for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["prefill_tokens"] == 16 and r["prefill_ms"] > 0
        assert r["prefill_vs_dynamic"] > 0 and r["context_prefill_ms"] > 0
    dyn = [r for r in rows if r["cache"] == "DynamicCache"]
    assert all(r["prefill_vs_dynamic"] == 1.0 and r["vs_dynamic"] == 1.0 for r in dyn)
    fused = next(r for r in rows if r["cache"] == "kvquant tcq2-recent (fused)")
    backends = preset_backends(KVQuantConfig.resolve("tcq2-recent"), 2, 16)
    assert fused["backend"] == f"{backends['decode']} / {backends['quantize']}"
    deq = next(r for r in rows if r["cache"] == "kvquant int4 (dequant)")
    assert deq["backend"].startswith("sdpa (dequantized) / ")
    data = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert data["meta"]["presets"] == list(presets) and data["meta"]["prefill_tokens"] == 16
    assert [s["segment"] for s in data["meta"]["backends"]["tcq2-recent"]["segments"]] == ["main", "recent"]
    assert len(data["rows"]) == len(rows)
    md = (tmp_path / "bench_cpu.md").read_text()
    assert "prefill 16 time vs DynamicCache" in md and "vs DynamicCache @40" in md
    assert sum(line.startswith("| kvquant ") for line in md.splitlines()) == 4  # one line per contender
    assert md in capsys.readouterr().out


def test_no_prefill_column_and_no_dequant_drop_their_parts_and_decode_continues_one_cache():
    rows = bench_cpu(
        model=tiny_model("llama"), contexts=(24,), presets=("int8",), steps=3, repeats=2, warmup=1,
        prefill=0, dequant=False,
    )  # fmt: skip
    assert not any("(dequant)" in r["cache"] for r in rows)
    assert all(r["prefill_ms"] is None and r["prefill_vs_dynamic"] is None for r in rows)
    assert all(r["context_end"] == 24 + (1 + 2) * 3 for r in rows)  # one prefill, three rounds on it
    fused = next(r for r in rows if r["cache"] == "kvquant int8 (fused)")
    assert len(fused["vs_dynamic_rounds"]) == 2  # each timed round against the DynamicCache run before it
    assert fused["vs_dynamic"] == pytest.approx(sum(fused["vs_dynamic_rounds"]) / 2)  # (the median of two)


def test_decode_rounds_are_interleaved_over_caches_filled_once():
    from kvquant.eval.speed import measure_decode

    model = tiny_model("llama")
    order, made = [], []

    class Recording(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == 0:
                order.append((self.name, key_states.shape[2]))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def build(name):
        def make():
            made.append(name)
            cache = Recording(config=model.config)
            cache.name = name
            return cache

        return make

    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    rows = measure_decode(
        model, {"a": build("a"), "b": build("b")}, ids, decode_tokens=2, warmup=1, repeats=2
    )
    assert made == ["a", "b"]  # one cache each, filled once
    assert order[:2] == [("a", 10), ("b", 10)]  # the prefills
    assert [n for n, _ in order[2:]] == ["a", "a", "b", "b"] * 3  # rounds of 2 steps, interleaved
    assert all(q == 1 for _, q in order[2:])
    for row in rows.values():
        assert row["repeats"] == 2 and row["context_end"] == 16 and row["decode_tok_s"] > 0


def test_paired_decode_runs_the_reference_before_each_cache_at_the_same_context(monkeypatch):
    from kvquant.eval import speed

    model = tiny_model("llama")
    order = []

    class Recording(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == 0:
                order.append((self.name, self.get_seq_length()))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def build(name):
        def make():
            cache = Recording(config=model.config)
            cache.name = name
            return cache

        return make

    # each timed round: the reference 1 s per step, "a" 0.5 s, "b" 2 s (a fake clock)
    per_step = {"ref": 1.0, "a": 0.5, "b": 2.0}
    real = speed._timed_decode

    def timed(model, cache, nxt, steps, device):
        nxt, _ = real(model, cache, nxt, steps, device)
        return nxt, per_step[cache.name] * steps

    monkeypatch.setattr(speed, "_timed_decode", timed)
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    builds = {"ref": build("ref"), "a": build("a"), "b": build("b")}
    rows = speed.measure_decode(model, builds, ids, decode_tokens=2, warmup=1, repeats=2, paired_with="ref")
    decode = order[3:]  # after the three prefills
    assert [n for n, _ in decode] == (["ref"] * 2 + ["a"] * 2 + ["ref"] * 2 + ["b"] * 2) * 3
    for r in range(3):  # the reference starts each paired run at the round's context
        round_ = decode[8 * r : 8 * r + 8]
        assert round_[0][1] == round_[2][1] == round_[4][1] == round_[6][1] == 10 + 2 * r
    assert rows["a"]["paired_x"] == pytest.approx(2.0) and rows["b"]["paired_x"] == pytest.approx(0.5)
    assert rows["a"]["paired_rounds"] == pytest.approx([2.0, 2.0])  # the two timed rounds
    assert rows["ref"]["paired_x"] == 1.0 and rows["ref"]["paired_rounds"] == []
    assert rows["ref"]["context_end"] == 16
    with pytest.raises(ValueError, match="paired_with: 'nope'"):
        speed.measure_decode(model, builds, ids, decode_tokens=1, warmup=0, repeats=1, paired_with="nope")


def test_a_sliding_window_reference_is_not_cropped_and_its_ratio_is_of_the_median_rounds():
    from kvquant.eval.speed import measure_decode

    model = tiny_model("gemma3")  # sliding_window 8: past it, transformers' crop cannot restore
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    builds = {
        "ref": lambda: DynamicCache(config=model.config),
        "int8": lambda: KVQuantCache(model.config, "int8"),
    }
    rows = measure_decode(model, builds, ids, decode_tokens=2, warmup=0, repeats=2, paired_with="ref")
    assert rows["ref"]["context_end"] == rows["int8"]["context_end"] == 16  # each ran its own 2 rounds
    assert rows["int8"]["paired_rounds"] == []
    want = rows["int8"]["decode_tok_s"] / rows["ref"]["decode_tok_s"]
    assert rows["int8"]["paired_x"] == pytest.approx(want)


def test_preset_backends_follow_the_device_and_the_segments():
    cfg = KVQuantConfig.resolve("int4")
    assert preset_backends(cfg, 2, 64, "cuda")["decode"] == "triton"  # described, not run: no GPU needed
    assert preset_backends(cfg, 2, 64, "cpu")["decode"] in ("cpu", "chunked")
    assert len(preset_backends(cfg, 2, 64)["segments"]) == 1
    recent = preset_backends(KVQuantConfig.resolve("tcq3v2-recent"), 2, 64)["segments"]
    assert [s["segment"] for s in recent] == ["main", "recent"]


def test_all_means_every_shipped_preset():
    assert resolve_presets(["all"]) == preset_names()
    assert resolve_presets(None) == preset_names() and "none" in preset_names()
    assert resolve_presets(["int4", "all"])[0] == "int4"


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--steps", "-1"], "--steps"),
        (["--contexts", "0"], "--contexts"),
        (["--repeats", "0"], "--repeats"),
        (["--prefill", "-5"], "--prefill"),
        (["--presets", "int4,nosuchpreset"], "--presets"),
    ],
)
def test_bad_bench_flags_exit_2_with_one_line(flags, flag, capsys):
    assert main(["bench", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvquant bench: error: {flag}")
