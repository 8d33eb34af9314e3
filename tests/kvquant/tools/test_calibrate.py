"""Static scales: calibrated per (layer, head), then codes carry no per-token scales."""

import pytest
import torch
from transformers import DynamicCache

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.models import tiny_model
from kvquant.tools.calibrate import calibrate_static_scales


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_static_scales_round_trip_and_save_bytes(tmp_path, fmt, rotation):
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 64), generator=torch.Generator().manual_seed(0))
    cfg = KVQuantConfig(key_format=fmt, value_format=fmt, rotation=rotation)
    path = tmp_path / "scales.pt"
    scales = calibrate_static_scales(model, ids, cfg, path, window=64)
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert scales["keys"].shape == (n_layers, n_heads) and (scales["keys"] > 0).all()

    static = KVQuantCache(
        model.config,
        KVQuantConfig(key_format=fmt, value_format=fmt, rotation=rotation, static_scales=str(path)),
    )
    dynamic = KVQuantCache(model.config, cfg)
    with torch.no_grad():
        for cache in (static, dynamic):
            model(input_ids=ids[:, :48], cache=cache)
    layer = static.layers[0]
    assert layer.main.k_store.scale is None and layer.main.k_store.static_scale.shape == (1, n_heads, 1, 1)
    assert static.nbytes() < dynamic.nbytes()  # no per-token scales
    k_static, _ = layer.read_history()
    k_dynamic, _ = dynamic.layers[0].read_history()
    # the calibration saw these tokens: nothing clips, error within half a step of the static scale
    with torch.no_grad():
        full = DynamicCache(config=model.config)
        model(input_ids=ids[:, :48], cache=full)
        ref = full.layers[0].keys
    # per head vector (the rotation is orthogonal, so bound the L2 norm): half a step per element for
    # int8, fp8's relative half-ulp (2**-4) plus its subnormal floor for fp8
    step = scales["keys"][0].view(1, -1, 1)
    d = ref.shape[-1]
    err = (k_static - ref).norm(dim=-1)  # [B, H, T]
    if fmt == "int8":
        bound = d**0.5 * step / 2 * 1.01
    else:
        bound = ref.norm(dim=-1) * 2**-4 * 1.01 + d**0.5 * step * 2**-9
    assert (err <= bound + 1e-6).all()
    assert k_dynamic.shape == k_static.shape


def test_static_scales_reject_int4():
    with pytest.raises(ValueError, match="key_format"):
        calibrate_static_scales(
            tiny_model("llama"),
            torch.zeros(1, 8, dtype=torch.long),
            KVQuantConfig(key_format="int4", value_format="int4"),
        )


def test_static_scales_are_measured_on_the_stored_keys_smoothing_included():
    """With smoothing the cache stores ``k - mean``: the calibrated key scales are those keys' maxima,
    not the raw keys' (calibration once rotated but did not smooth)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 64), generator=torch.Generator().manual_seed(0))
    plain = KVQuantConfig(key_format="int8", value_format="int8")
    smoothed = KVQuantConfig(key_format="int8", value_format="int8", smoothing="mean")
    raw = calibrate_static_scales(model, ids, plain, window=64)["keys"]
    centred = calibrate_static_scales(model, ids, smoothed, window=64)["keys"]
    with torch.no_grad():
        full = DynamicCache(config=model.config)
        model(input_ids=ids, cache=full)
    k = full.layers[0].keys.float()  # [1, H, T, D]
    want = (k - k.mean(dim=2, keepdim=True)).abs().amax(dim=(0, 2, 3)) / 127
    torch.testing.assert_close(centred[0], want, rtol=2e-3, atol=1e-6)
    assert not torch.allclose(centred[0], raw[0])


def test_cli_writes_a_key_map_a_cache_takes(tiny_model_dir, tmp_path, capsys):
    from kvquant.key_map import load_key_map
    from kvquant.models import load_model
    from kvquant.tools.cli import main

    out = tmp_path / "km.pt"
    argv = ["calibrate", "--key-map", "--model", str(tiny_model_dir), "--cache", "tcq3v2-recent"]
    assert main(argv + ["--tokens", "400", "--out", str(out)]) == 0
    assert f"use it as `key_map: {out}`" in capsys.readouterr().out
    model, _ = load_model(str(tiny_model_dir))
    maps = load_key_map(str(out))
    assert sorted(maps) == list(range(model.config.num_hidden_layers))
    cache = KVQuantCache(model.config, {"key_format": "nuq4", "value_format": "nuq4", "key_map": str(out)})
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 40)), cache=cache, use_cache=True)
    assert cache.layers[0].transform.key_map is maps[0]  # the loaded map itself, shared


def test_cli_writes_a_retrieval_config_a_cache_takes(tiny_model_dir, tmp_path, capsys):
    from kvquant.config import KVQuantConfig
    from kvquant.models import load_model
    from kvquant.tools.cli import main

    out = tmp_path / "ret.yaml"
    argv = ["calibrate", "--retrieval", "--model", str(tiny_model_dir), "--cache", "int4", "--length", "360"]
    argv += ["--trials", "2", "--max-layers", "1", "--tolerance", "1e-6", "--protect-format", "int8"]
    assert main(argv + ["--out", str(out)]) == 0
    assert f"use it as --cache {out}" in capsys.readouterr().out
    text = out.read_text()
    assert text.startswith("# kvquant calibrate --retrieval --cache int4 --length 360")
    cfg = KVQuantConfig.resolve(str(out))
    base = KVQuantConfig.resolve("int4")
    assert cfg.name == "ret" and cfg.key_format == base.key_format and cfg.smoothing == base.smoothing
    assert len(cfg.layer_overrides) <= 1
    assert all(o == {"key_format": "int8"} for o in cfg.layer_overrides.values())
    layers = "none" if not cfg.layer_overrides else str(list(cfg.layer_overrides))
    assert f"retrieval layers (keys in int8): {layers}" in text
    model, _ = load_model(str(tiny_model_dir))
    cache = KVQuantCache(model.config, cfg)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 40)), cache=cache, use_cache=True)


def test_cli_writes_the_retrieval_count_a_cache_takes(tiny_model_dir, tmp_path, capsys):
    import dataclasses

    from kvquant.config import KVQuantConfig
    from kvquant.models import load_model
    from kvquant.tools.cli import main

    out = tmp_path / "count.yaml"
    argv = ["calibrate", "--retrieval-count", "--model", str(tiny_model_dir), "--cache", "int4"]
    argv += ["--length", "360", "--trials", "2", "--max-layers", "1", "--out", str(out)]
    assert main(argv) == 0
    cfg = KVQuantConfig.resolve(str(out))
    assert f"wrote {out}: retrieval_layers {cfg.retrieval_layers}" in capsys.readouterr().out
    text = out.read_text()
    assert text.startswith(
        "# kvquant calibrate --retrieval-count --cache int4 --length 360 --trials 2 --max-layers 1"
    )
    assert "full precision" in text and "; 0: " in text and ", 1: " in text  # both counts scored
    assert cfg.retrieval_layers in (0, 1)
    base = KVQuantConfig.resolve("int4")
    assert dataclasses.replace(cfg, name="int4", retrieval_layers=0) == base
    model, _ = load_model(str(tiny_model_dir))
    assert len(KVQuantCache(model, cfg).retrieval_layers) == cfg.retrieval_layers
