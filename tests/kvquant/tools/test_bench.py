"""The CPU decode benchmark runs every contender (it reports speed; nothing here gates on time)."""

import json

from kvquant.kernels.cpu import native_available
from kvquant.models import tiny_model
from kvquant.tools.bench import bench_cpu
from kvquant.tools.cli import build_parser


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
