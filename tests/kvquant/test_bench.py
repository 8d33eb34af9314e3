"""The CPU decode benchmark runs every contender (it reports speed; nothing here gates on time)."""

from kvquant.bench import _caches, decode_tokens_per_s
from kvquant.cli import build_parser
from kvquant.models import tiny_model


def test_every_contender_decodes_and_is_timed():
    model = tiny_model("llama")
    labels = []
    for label, factory, attn in _caches(model, ["int4"]):
        rate = decode_tokens_per_s(model, factory, attn, context=40, steps=2, repeats=1, warmup=1)
        assert rate > 0
        labels.append(label)
    model.set_attn_implementation("sdpa")
    assert labels[:3] == ["DynamicCache", "kvquant int4 (fused)", "kvquant int4 (dequant)"]


def test_bench_cli_parses_targets():
    args = build_parser().parse_args(["bench", "cpu", "--contexts", "1024,2048", "--presets", "int4,int8"])
    assert args.contexts == [1024, 2048] and args.presets == ["int4", "int8"]
