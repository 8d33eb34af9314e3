"""Key maps (kvquant.key_map): the fit, the file, the transform that applies them, the cache.

The map changes what the store holds, never what attention computes: every test of the plumbing
checks exactness (the query folded by ``M^-T`` scores ``M k`` as ``q`` scores ``k``). That the fit
minimizes the score error it targets is tested here; that a calibrated map lowers the decode-mode KL
on realistic structure is in ``test_outlier_robustness.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.eval.decode import teacher_forced_logprobs
from kvquant.key_map import fit_key_map, load_key_map, save_key_map, shipped_key_maps
from kvquant.tools.calibrate import calibrate_key_map
from kvquant.transforms import KeyTransform


def _spd(d: int, gen: torch.Generator, spread: float) -> torch.Tensor:
    """A random symmetric positive definite ``[D, D]`` with eigenvalues over ``spread`` decades."""
    u, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    e = 10 ** (spread * torch.rand(d, generator=gen, dtype=torch.float64))
    return (u * e) @ u.T


def _score_error(m: torch.Tensor, c: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``tr(M C M^T) tr(M^-T Q M^-1)``: the expected squared score error under map ``m``, up to a factor."""
    mi = torch.linalg.inv(m)
    return torch.trace(m @ c @ m.T) * torch.trace(mi.T @ q @ mi)


# ------------------------------------------------------------------------------------------ the fit


def test_fit_diagonal_case_and_identity():
    c = torch.diag(torch.tensor([4.0, 1.0]))[None]
    q = torch.diag(torch.tensor([1.0, 4.0]))[None]
    m = fit_key_map(c, q, exponent=1.0)[0]
    assert torch.allclose(m, torch.diag(torch.tensor([2**-0.5, 2**0.5])), atol=1e-3)
    assert torch.allclose(fit_key_map(c, q, exponent=0.0)[0], torch.eye(2), atol=1e-6)
    assert torch.allclose(fit_key_map(c, 3 * c, exponent=1.0)[0], torch.eye(2), atol=1e-3)  # proportional


def test_fit_is_the_least_score_error():
    """The exponent-1 map beats the identity and every small perturbation of itself; 0.75 lies between."""
    gen = torch.Generator().manual_seed(0)
    d = 16
    c, q = _spd(d, gen, 2.0), _spd(d, gen, 2.0)
    best = fit_key_map(c[None], q[None], exponent=1.0)[0].double()
    part = fit_key_map(c[None], q[None], exponent=0.75)[0].double()
    assert torch.allclose(best, best.T, atol=1e-5)
    assert abs(torch.linalg.det(best).item() - 1.0) < 1e-3
    e_best, e_id, e_part = (_score_error(m, c, q) for m in (best, torch.eye(d, dtype=torch.float64), part))
    assert e_best < e_part < e_id
    for _ in range(20):
        nudged = best + 0.02 * torch.randn(d, d, generator=gen, dtype=torch.float64)
        assert _score_error(nudged, c, q) >= e_best * (1 - 1e-6)


def test_fit_refuses_bad_input():
    with pytest.raises(ValueError, match="exponent"):
        fit_key_map(torch.eye(2)[None], torch.eye(2)[None], exponent=1.5)
    with pytest.raises(ValueError, match=r"c, q"):
        fit_key_map(torch.eye(2)[None], torch.eye(3)[None])


# ------------------------------------------------------------------------------------------ the transform


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("smoothing", ["none", "mean", "channel", "auto"])
def test_transform_with_a_map_keeps_scores_exact(rotation, smoothing):
    gen = torch.Generator().manual_seed(1)
    b, h, g, n, d = 2, 3, 2, 9, 64
    maps = torch.stack([fit_key_map(_spd(d, gen, 1.5)[None], _spd(d, gen, 1.5)[None])[0] for _ in range(h)])
    t = KeyTransform(rotation, smoothing, torch.float32, key_map=maps)
    k, v = torch.randn(b, h, n, d, generator=gen) + 3, torch.randn(b, h, n, d, generator=gen)
    t.fit(k)
    ks, vs = t.apply(k, v)
    back_k, back_v = t.undo(ks, vs)
    assert torch.allclose(back_k, k, atol=1e-4) and torch.allclose(back_v, v, atol=1e-5)
    assert not torch.allclose(ks, KeyTransform(rotation, smoothing, torch.float32).apply(k, v)[0], atol=1e-2)
    q = torch.randn(b, h * g, d, generator=gen)
    mean = torch.zeros(b, h, 1, d) if t.stats is None else t.stats[0].float()
    want = torch.einsum("bhgd,bhnd->bhgn", q.view(b, h, g, d), k - mean)
    got = torch.einsum("bhgd,bhnd->bhgn", t.fold_query(q).view(b, h, g, d), ks)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4)
    # the kernels' form: smoothing and map here, rotation in the op
    ks_nr, _ = t.apply(k, v, rotate=False)
    got_nr = torch.einsum("bhgd,bhnd->bhgn", t.fold_query(q, rotate=False).view(b, h, g, d), ks_nr)
    assert torch.allclose(got_nr, want, atol=1e-3, rtol=1e-4)


# ------------------------------------------------------------------------------------------ files


def _tiny(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _random_maps(layers: int, h: int, d: int, seed: int = 0) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        i: torch.stack([fit_key_map(_spd(d, gen, 1.0)[None], _spd(d, gen, 1.0)[None])[0] for _ in range(h)])
        for i in range(layers)
    }


def test_file_round_trip_and_errors(tmp_path):
    maps = _random_maps(2, 2, 32)
    path = tmp_path / "km.pt"
    save_key_map(path, maps, {"model": "tiny"})
    got = load_key_map(str(path))
    assert sorted(got) == [0, 1] and all(torch.allclose(got[i], maps[i], atol=2e-3) for i in got)
    with pytest.raises(ValueError, match="key_map: no such key map file"):
        load_key_map(str(tmp_path / "missing.pt"))
    torch.save({"keys": torch.ones(2, 2)}, tmp_path / "scales.pt")
    with pytest.raises(ValueError, match="not a kvquant key map file"):
        load_key_map(str(tmp_path / "scales.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a kvquant key map file"):
        load_key_map(str(tmp_path / "junk.pt"))
    singular = {0: torch.zeros(2, 32, 32), 1: maps[1]}
    save_key_map(tmp_path / "singular.pt", singular)
    with pytest.raises(ValueError, match="layer 0's map is not finite and invertible"):
        load_key_map(str(tmp_path / "singular.pt"))


def test_shipped_map_loads_for_the_embedded_shapes():
    assert "smollm2" in shipped_key_maps()
    maps = load_key_map("smollm2")
    assert sorted(maps) == list(range(30)) and all(tuple(m.shape) == (3, 64, 64) for m in maps.values())


def test_config_and_cache_refuse_a_map_that_does_not_fit(tmp_path):
    model = _tiny()
    with pytest.raises(ValueError, match="key_map"):
        KVQuantConfig(key_map="")
    save_key_map(tmp_path / "one.pt", {0: _random_maps(1, 2, 32)[0]})
    with pytest.raises(ValueError, match="has no map for layer 1"):
        KVQuantCache(
            model.config,
            KVQuantConfig(key_format="nuq4", value_format="nuq4", key_map=str(tmp_path / "one.pt")),
        )
    save_key_map(tmp_path / "wide.pt", _random_maps(2, 2, 64))
    cache = KVQuantCache(
        model.config, KVQuantConfig(key_format="nuq4", value_format="nuq4", key_map=str(tmp_path / "wide.pt"))
    )
    with pytest.raises(ValueError, match=r"key_map: this layer's map is \(2, 64, 64\)"):
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 8)), cache=cache, use_cache=True)


def test_yaml_key_map_is_read_beside_the_yaml(tmp_path, monkeypatch):
    save_key_map(tmp_path / "km.pt", _random_maps(2, 2, 32))
    (tmp_path / "cfg.yaml").write_text("key_format: nuq4\nvalue_format: nuq4\nkey_map: km.pt\n")
    monkeypatch.chdir(tmp_path.parent)
    cfg = KVQuantConfig.resolve(str(tmp_path / "cfg.yaml"))
    assert cfg.key_map == str(tmp_path / "km.pt")
    KVQuantCache(_tiny().config, cfg)  # found from another folder


# ------------------------------------------------------------------------------------------ the cache


@pytest.fixture(scope="module")
def tiny_with_map(tmp_path_factory):
    model = _tiny()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    path = tmp_path_factory.mktemp("km") / "km.pt"
    base = KVQuantConfig(key_format="nuq4", value_format="nuq4", rotation="hadamard", smoothing="mean",
                         sink_tokens=2, residual_length=4)  # fmt: skip
    maps = calibrate_key_map(model, ids, base, path, window=128)
    return model, ids, base, str(path), maps


def test_calibrated_maps_have_the_model_shapes(tiny_with_map):
    model, _, _, path, maps = tiny_with_map
    assert sorted(maps) == [0, 1]
    for m in maps.values():
        assert tuple(m.shape) == (2, 32, 32)
        assert torch.allclose(torch.linalg.det(m.double()), torch.ones(2, dtype=torch.float64), atol=1e-3)
        assert not torch.allclose(m, torch.eye(32).expand(2, 32, 32), atol=1e-2)  # it does something
    assert sorted(load_key_map(path)) == [0, 1]


def test_passthrough_with_a_map_equals_dynamic_cache(tiny_with_map):
    """``none`` stores ``M k`` in fp32: the map round trip alone, exact within fp32."""
    model, ids, _, path, _ = tiny_with_map
    cfg = KVQuantConfig(key_format="none", value_format="none", smoothing="mean", rotation="hadamard",
                        sink_tokens=2, residual_length=4, key_map=path)  # fmt: skip
    base = teacher_forced_logprobs(model, ids[:, :96], 64, DynamicCache(config=model.config))
    test = teacher_forced_logprobs(model, ids[:, :96], 64, KVQuantCache(model.config, cfg))
    assert (base - test).abs().max() < 1e-4


@pytest.mark.parametrize("preset", ["nuq4", "tcq3v2-recent", "int4"])
def test_fused_decode_with_a_map_equals_the_dequantizing_path(tiny_with_map, preset):
    import kvquant

    model, ids, _, path, _ = tiny_with_map
    cfg = KVQuantConfig.resolve(preset).with_key_map(path)
    prompt = ids[:, :80]
    out = {}
    for attn in ("sdpa", "kvquant"):
        if attn == "kvquant":
            kvquant.enable(model)
        else:
            model.set_attn_implementation("sdpa")
        out[attn] = model.generate(
            prompt, cache=KVQuantCache(model.config, cfg), max_new_tokens=12, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    model.set_attn_implementation("sdpa")
    assert torch.equal(out["sdpa"].sequences, out["kvquant"].sequences)
    for a, b in zip(out["sdpa"].logits, out["kvquant"].logits, strict=True):
        assert ((a - b).abs().max() / a.abs().max()) < 1e-4
