"""``kvquant export``: compressed-tensors checkpoints of static fp8 KV scales, and the engine-equivalent
cache that measures them."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

from kvquant import KVQuantConfig
from kvquant.engine_scales import FP8_E4M3_MAX, quantization_config, read_scales, reduce_scales
from kvquant.eval import EvalError, resolve_specs
from kvquant.eval.caches import engine_cache, engine_config
from kvquant.models import tiny_model
from kvquant.tools.calibrate import calibrate_static_scales
from kvquant.tools.cli import main
from kvquant.tools.export import (
    SCALES_FILE,
    _add_to_checkpoint,
    check_export,
    sglang_scales_json,
    write_export,
)

STRATEGIES = ["tensor", "attn_head"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=3)  # 4 query heads, 2 KV heads, head_dim 16


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 120, (1, 96), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def scales(model, ids):
    return calibrate_static_scales(model, ids, KVQuantConfig(key_format="fp8_e4m3", value_format="fp8_e4m3"))


@pytest.fixture(scope="module")
def exported(model, scales, tmp_path_factory):
    out = {}
    for strategy in STRATEGIES:
        folder = tmp_path_factory.mktemp(f"export-{strategy}")
        write_export(model, None, scales, "vllm", strategy, folder)
        out[strategy] = folder
    return out


def _amax(model, ids):
    """Per-(layer, KV head) max |k| and |v| of the full-precision cache: ``[L, H]`` each."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    k = torch.stack([layer.keys.abs().amax(dim=(0, 2, 3)) for layer in cache.layers])
    v = torch.stack([layer.values.abs().amax(dim=(0, 2, 3)) for layer in cache.layers])
    return k, v


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_config_parses_with_compressed_tensors(exported, strategy):
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = json.loads((exported[strategy] / "config.json").read_text())
    parsed = ct.QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.quant_method == "compressed-tensors" and parsed.config_groups == {}
    args = parsed.kv_cache_scheme
    assert isinstance(args, ct.QuantizationArgs)
    assert args.strategy == ct.QuantizationStrategy(strategy)
    assert (args.num_bits, args.type, args.dynamic, args.symmetric) == (
        8,
        ct.QuantizationType.FLOAT,
        False,
        True,
    )
    # what we write is what compressed-tensors' own model writes back for these fields
    dumped = args.model_dump(mode="json")
    assert {k: dumped[k] for k in config["quantization_config"]["kv_cache_scheme"]} == config[
        "quantization_config"
    ]["kv_cache_scheme"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scale_tensors_follow_the_scheme(model, ids, exported, strategy):
    """Names ``model.layers.{i}.self_attn.{k,v}_scale``, fp32, ``(1,)`` or ``(H, 1, 1)``, values the
    calibrated ``amax / 448`` (per tensor: the layer's largest head), in the file the checkpoint lists."""
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    amax_k, amax_v = _amax(model, ids)
    with safe_open(str(exported[strategy] / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
        assert {"model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight"} <= names
        scale_names = {n for n in names if n.endswith("_scale")}
        assert scale_names == {f"model.layers.{i}.self_attn.{w}_scale" for i in range(layers) for w in "kv"}
        for i in range(layers):
            for w, amax in (("k", amax_k), ("v", amax_v)):
                t = st.get_tensor(f"model.layers.{i}.self_attn.{w}_scale")
                assert t.dtype == torch.float32
                if strategy == "tensor":
                    assert t.shape == (1,) and t.item() == (amax[i].max() / FP8_E4M3_MAX).item()
                else:
                    assert t.shape == (heads, 1, 1)
                    assert torch.equal(t.flatten(), amax[i] / FP8_E4M3_MAX)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scales_round_trip(model, scales, exported, strategy, tmp_path):
    back = read_scales(exported[strategy])
    want = reduce_scales(scales, strategy)
    for part in ("keys", "values"):
        expect = want[part][:, :1] if strategy == "tensor" else want[part]
        assert torch.equal(back[part], expect)
    # --scales-only: the same tensors in kv_scales.safetensors, and the config fragment
    files = write_export(model, None, scales, "vllm", strategy, tmp_path, scales_only=True)
    assert sorted(files) == sorted([SCALES_FILE, "quantization_config.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    only = read_scales(tmp_path / SCALES_FILE)
    assert all(torch.equal(only[p], back[p]) for p in ("keys", "values"))
    fragment = json.loads((tmp_path / "quantization_config.json").read_text())
    assert fragment == {"quantization_config": quantization_config(strategy)}


def test_sharded_checkpoint_gets_a_scales_shard_in_its_index(model, scales, tmp_path):
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.is_file()
    from kvquant.engine_scales import scale_tensors

    tensors = scale_tensors(scales, "attn_head")
    _add_to_checkpoint(tmp_path, tensors)
    weight_map = json.loads(index.read_text())["weight_map"]
    assert {n: weight_map[n] for n in tensors} == dict.fromkeys(tensors, SCALES_FILE)
    back = read_scales(tmp_path)
    assert torch.equal(back["keys"], scales["keys"]) and torch.equal(back["values"], scales["values"])


def test_folder_loads_back_with_transformers(model, exported):
    """The checkpoint is a plain transformers folder: same weights, same logits (transformers itself
    does not serve the fp8 KV scheme; with compressed-tensors installed it reports the scale tensors
    as unexpected keys and loads the rest)."""
    from transformers import AutoModelForCausalLM

    for folder in exported.values():
        back = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        ours = dict(model.named_parameters())
        for name, p in back.named_parameters():
            assert torch.equal(p, ours[name]), name
        ids = torch.arange(3, 40)[None]
        with torch.no_grad():
            assert torch.equal(back(ids).logits, model(ids).logits)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_cache_stores_the_reference_fp8_codes_bit_for_bit(model, exported, strategy, dtype):
    """``engine-fp8:PATH`` stores ``float8_e4m3fn(x / scale)`` (fp32 division, saturated at 448) and
    every call reads back every token as stored, its own included."""
    heads, d = model.config.num_key_value_heads, model.config.head_dim
    cache = engine_cache(model.config, engine_config(exported[strategy]))
    scales = read_scales(exported[strategy])
    g = torch.Generator().manual_seed(1)
    sk = scales["keys"][0].expand(heads).view(1, heads, 1, 1)
    k = (torch.randn(2, heads, 37, d, generator=g) * 300 * sk).to(dtype)  # many beyond 448 * scale
    v = (torch.randn(2, heads, 37, d, generator=g)).to(dtype)
    k[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])  # zeros and subnormal-range values
    k_out, v_out = cache.update(k[:, :, :30], v[:, :, :30], 0)
    k_out, v_out = cache.update(k[:, :, 30:], v[:, :, 30:], 0)
    store = cache.layers[0].main.k_store
    ref = (k.float() / sk).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(store.codes[:, :, :37].view(torch.uint8), ref.view(torch.uint8))
    assert (ref.float().abs() == FP8_E4M3_MAX).any()  # saturation exercised
    assert torch.equal(k_out, (ref.float() * sk).to(dtype))  # the call's own tokens come back as stored
    sv = scales["values"][0].expand(heads).view(1, heads, 1, 1)
    ref_v = (v.float() / sv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(
        cache.layers[0].main.v_store.codes[:, :, :37].view(torch.uint8), ref_v.view(torch.uint8)
    )
    assert torch.equal(v_out, (ref_v.float() * sv).to(dtype))


def test_engine_spec_resolves_and_refuses(exported, tmp_path):
    (spec,) = [s for s in resolve_specs([f"engine-fp8:{exported['tensor']}"]) if s.kind != "dynamic"]
    assert spec.settings["reads"] == "stored" and spec.quant.scale_dtype == "float32"
    assert (spec.quant.sink_tokens, spec.quant.residual_length, spec.quant.recent_length) == (0, 0, 0)
    with pytest.raises(EvalError, match="no such checkpoint"):
        resolve_specs(["engine-fp8:/no/such/folder"])
    with pytest.raises(EvalError, match="no safetensors file"):
        resolve_specs([f"engine-fp8:{tmp_path}"])  # an empty folder
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(EvalError, match="holds no model.layers"):
        resolve_specs([f"engine-fp8:{tmp_path}"])


def test_sglang_json_and_per_head_refusal(scales, tmp_path):
    data = sglang_scales_json(scales, "llama", tp=2)
    per_layer = torch.maximum(scales["keys"].amax(1), scales["values"].amax(1))
    kv = data["kv_cache"]
    assert data["model_type"] == "llama" and kv["dtype"] == "float8_e4m3fn"
    assert sorted(kv["scaling_factor"]) == ["0", "1"]  # one map per TP rank
    for rank in kv["scaling_factor"].values():
        assert [rank[str(i)] for i in range(len(per_layer))] == per_layer.tolist()
    with pytest.raises(ValueError, match="--strategy: SGLang takes per-tensor"):
        check_export("sglang", "attn_head", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        check_export("vllm", "tensor", tmp_path / "full")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


@pytest.mark.parametrize("engine,strategy", [("vllm", "attn_head"), ("sglang", "tensor")])
def test_cli_export_writes_and_measures(capsys, tiny_model_dir, corpus, tmp_path, engine, strategy):
    out = tmp_path / "out"
    argv = ["export", engine, "--model", str(tiny_model_dir), "--corpus", str(corpus), "--tokens", "256"]
    argv += ["--strategy", strategy, "--out", str(out), "--measure-windows", "1", "--measure-prefix", "64"]
    rc = main([*argv, "--measure-tokens", "8"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "mean KL" in stdout and "top-1 agreement" in stdout and f"engine-fp8:{out}" in stdout
    assert ("FlashAttention 3" in stdout) == (strategy == "attn_head")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "kv_cache_scales.json").is_file() == (engine == "sglang")
    back = read_scales(out)
    assert back["keys"].shape[1] == (2 if strategy == "attn_head" else 1)


def test_cli_export_sglang_per_head_one_line(capsys, tmp_path):
    rc = main(["export", "sglang", "--strategy", "attn_head", "--out", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("kvquant export: error: --strategy: SGLang takes per-tensor fp8 KV scales only")
