"""The harness's parts: config layering, corpora and windows, cache specs and byte counts, passkey
prompts, speed ratios."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from kvquant import KVQuantCache
from kvquant.config import preset_names
from kvquant.eval import EvalConfig, EvalError, cache_nbytes, load_config, resolve_specs, theoretical_bits
from kvquant.eval.caches import available_peers
from kvquant.eval.config import CorpusSection, parse_set
from kvquant.eval.corpus import ByteTokenizer, load_corpus, make_windows
from kvquant.eval.report import markdown_table
from kvquant.eval.retrieval import lost_and_gained, passkey_cases, passkey_prompt
from kvquant.eval.speed import prompt_tokens, with_ratios

# ------------------------------------------------------------------------------------------ config


def test_config_layers_defaults_yaml_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("quality: {prefix_len: 100, windows: 3}\ncaches: [int4]\n")
    cfg = load_config(path, {"quality.windows": 5, "speed.batch_sizes": [1, 2]})
    assert (cfg.quality.prefix_len, cfg.quality.windows, cfg.quality.score_len) == (100, 5, 64)
    assert cfg.caches == ["int4"] and cfg.speed.batch_sizes == [1, 2]
    assert load_config("smollm2-wikitext2").quality.prefix_len == 1024
    assert parse_set(["a.b=3", "c=[x, y]", "d=null"]) == {"a.b": 3, "c": ["x", "y"], "d": None}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"quality.prefix_len": 0}, "quality.prefix_len: invalid value 0"),
        ({"retrieval.lengths": [100, "huge"]}, "retrieval.lengths: invalid value 'huge'"),
        ({"nope": 1}, "unknown key 'nope'"),
        ({"model.dtype": "int8"}, "model.dtype: invalid value"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(EvalError, match=message):
        load_config(None, overrides)


def test_identity_ignores_the_cache_list():
    a, b = EvalConfig(), load_config(None, {"caches": ["int2x"], "output.dir": "elsewhere"})
    assert a.identity_hash() == b.identity_hash()
    assert a.identity_hash() != load_config(None, {"quality.windows": 3}).identity_hash()


# ------------------------------------------------------------------------------------------ corpus


def test_txt_corpus_is_the_file_as_stored(tmp_path):
    text = " = Title = \n\n First line .\n Second line .\n"
    path = tmp_path / "c.txt"
    path.write_text(text)
    c = load_corpus(CorpusSection(name=str(path)))
    assert c.text == text and c.info["join"] == "as stored"


def test_jsonl_corpus_joins_rows(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in ["one", "two"]) + "\n")
    assert load_corpus(CorpusSection(name=str(path), text_field="body")).text == "one\n\ntwo"
    with pytest.raises(EvalError, match="no column 'text'"):
        load_corpus(CorpusSection(name=str(path)))


def test_embedded_corpus_ships_and_is_long_enough():
    c = load_corpus(CorpusSection())
    assert 15_000 < c.info["chars"] < 300_000


def test_wikitext2_offline_falls_back_to_the_local_copy(tmp_path, monkeypatch, caplog):
    local = tmp_path / "wikitext-2-raw-test.txt"
    local.write_text(" = Robert Boulter = \n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KVQUANT_WIKITEXT2", str(local))
    c = load_corpus(CorpusSection(name="wikitext2"))
    assert c.text == " = Robert Boulter = \n" and c.info["source"] == str(local.resolve())
    assert "unreachable" in caplog.text


def test_windows_are_disjoint_and_spread():
    ids = torch.arange(1000)
    w = make_windows(ids, 60, 40, 3)
    assert w.shape == (3, 100)
    assert w[0, 0] == 0 and w[-1, -1] == 999  # first at the start, last at the end
    assert all(w[i, -1] < w[i + 1, 0] for i in range(2))
    with pytest.raises(EvalError, match="shorter than 11 window"):
        make_windows(ids, 60, 40, 11, "c")


# ------------------------------------------------------------------------------------------ caches


def test_specs_resolve_groups_dynamic_first():
    specs = resolve_specs(["int4,presets", "peers"])
    names = [s.name for s in specs]
    assert names[0] == "dynamic" and names.count("int4") == 1
    assert set(preset_names()) <= set(names) and set(available_peers()) <= set(names)
    assert "hf-fp8" in available_peers()  # transformers 5.24 has the fp8 backend
    with pytest.raises(EvalError, match="unknown cache or preset 'int3'"):
        resolve_specs(["int3"])
    with pytest.raises(EvalError, match="no such preset or YAML file"):
        resolve_specs(["missing.yaml"])


def test_byte_counts_follow_the_held_tensors(tiny):
    ids = torch.randint(3, 128, (1, 40))
    layers, heads, dim = 2, 2, 16
    dyn = DynamicCache(config=tiny.config)
    tiny(input_ids=ids, cache=dyn)
    assert cache_nbytes(dyn) == 40 * layers * heads * dim * 2 * 4  # K + V, fp32
    kv = KVQuantCache(tiny.config, "int8")
    tiny(input_ids=ids, cache=kv)
    assert cache_nbytes(kv) == kv.nbytes()
    fp8 = QuantizedCache(backend="fp8", config=tiny.config)
    tiny(input_ids=ids, cache=fp8)
    # fp8 codes (1 byte) + one fp32 scale per tensor, + the empty full-precision `keys` / `values`
    assert cache_nbytes(fp8) == 40 * layers * heads * dim * 2 + layers * 2 * 4
    if "hf-quanto-int4" in available_peers():
        q = QuantizedCache(backend="quanto", config=tiny.config, nbits=4)
        tiny(input_ids=ids, cache=q)
        # 4-bit packed codes + a scale and a shift (fp32) per 64 consecutive elements (4 tokens here)
        numel = 40 * heads * dim
        assert cache_nbytes(q) == layers * 2 * (numel // 2 + numel // 64 * 2 * 4)


def test_theoretical_bits(tiny):
    (dyn, int8, int4, kivi2, quanto) = resolve_specs(["int8", "int4", "kivi2", "hf-quanto-int4"])
    assert theoretical_bits(dyn, tiny) == 32.0  # the tiny model is fp32
    assert theoretical_bits(int8, tiny) == 8 + 16 / 16  # group 32 clipped to head_dim 16, fp16 scale
    assert theoretical_bits(int4, tiny) == 4 + 2 * 16 / 16  # asymmetric: scale + zero point
    # keys: a scale + zero per channel and 32 tokens; values: per token and 32 channels, clipped to 16
    assert theoretical_bits(kivi2, tiny) == ((2 + 2 * 16 / 32) + (2 + 2 * 16 / 16)) / 2
    assert theoretical_bits(quanto, tiny) == 4 + 2 * 32 / 64


# ------------------------------------------------------------------------------------------ retrieval, speed


def test_passkey_prompt_has_exact_length_and_the_key():
    tok = ByteTokenizer()
    for length in (400, 401, 777):
        ids, q = passkey_prompt(tok, length, "12345", 0.5)
        assert ids.numel() == length
        text = tok.decode(ids)
        assert text.count("12345") == 2 and text.endswith("The pass key is")
        assert tok.decode(ids[-q:]).startswith("\nWhat is the pass key?")
    cases = passkey_cases([400, 800], 2, 5, seed=0)
    assert cases == passkey_cases([400, 800], 2, 5, seed=0)  # same prompts for every cache
    assert all(len(c["key"]) == 5 for c in cases) and [c["depth"] for c in cases[:2]] == [0.25, 0.75]
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 100, "12345", 0.5)


def test_speed_helpers():
    assert prompt_tokens(torch.arange(5), 12, 2).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]] * 2
    rows = [{"context": 8, "batch": 1, "prefill_ms": 5.0, "decode_tok_s": 30.0}]
    ref = [{"context": 8, "batch": 1, "prefill_ms": 10.0, "decode_tok_s": 20.0}]
    (r,) = with_ratios(rows, ref)
    assert r["prefill_x"] == 2.0 and r["decode_x"] == 1.5


def test_bytes_at_16bit_count_full_precision_tokens_at_two_bytes(tiny):
    from kvquant.eval.caches import cache_nbytes_16bit

    ids = torch.randint(0, 100, (1, 30))
    quant = KVQuantCache(tiny.config, "int4")  # 4 sinks + 16 newest tokens in the model's fp32
    dyn = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(ids, cache=quant)
        tiny(ids, cache=dyn)
    parts = [layer.nbytes() for layer in quant.layers]
    fp = sum(p["tail"] + p["sink"] for p in parts)
    assert fp > 0
    assert cache_nbytes_16bit(quant) == cache_nbytes(quant) - fp // 2
    assert cache_nbytes_16bit(dyn) == cache_nbytes(dyn) // 2
    half = KVQuantCache(tiny.config, "int4")
    with torch.no_grad():
        tiny.to(torch.bfloat16)(ids, cache=half)
    tiny.to(torch.float32)
    assert cache_nbytes_16bit(half) == cache_nbytes(half) == cache_nbytes_16bit(quant)


def test_passkey_margin_is_the_lead_of_the_answers_first_token(tiny, byte_tok):
    from kvquant.eval.retrieval import answer, answer_first_token, passkey_prompt

    ids, q_len = passkey_prompt(byte_tok, 360, "123", 0.5)
    first = answer_first_token(byte_tok, "123")
    for build in (lambda: DynamicCache(config=tiny.config), lambda: KVQuantCache(tiny.config, "int4")):
        got, margin = answer(tiny, build(), ids, q_len, 3, first=first)
        assert (margin > 0) == (got[0] == first)
        again, lead = answer(tiny, build(), ids, q_len, 3, first=got[0])  # greedy's own first token
        assert again == got and lead >= 0
        if got[0] != first:
            assert margin < 0


def test_shared_prefill_passkey_gives_each_cache_its_own_answers(tiny, byte_tok):
    from kvquant.eval.retrieval import _FanOut, passkey_accuracy, passkey_accuracy_shared

    builds = {
        "dynamic": lambda: DynamicCache(config=tiny.config),
        "int4": lambda: KVQuantCache(tiny.config, "int4"),
        "tcq2-recent": lambda: KVQuantCache(tiny.config, "tcq2-recent"),
    }
    kw = {"lengths": [360, 400], "trials": 1, "digits": 3}
    seen = []
    shared = passkey_accuracy_shared(tiny, byte_tok, builds, on_answer=lambda n, a: seen.append(n), **kw)
    assert seen == list(builds) * 2  # one answer per cache per prompt, as each is known
    for name, build in builds.items():
        alone = passkey_accuracy(tiny, byte_tok, build, **kw)
        assert shared[name] == alone, name
    # the state a cache holds after the shared prefill is the one its own prefill leaves
    ids = torch.randint(0, 100, (1, 200))
    fanned, alone = KVQuantCache(tiny.config, "nuq2"), KVQuantCache(tiny.config, "nuq2")
    with torch.no_grad():
        tiny(input_ids=ids, cache=_FanOut(tiny.config, [fanned]), use_cache=True)
        tiny(input_ids=ids, cache=alone, use_cache=True)
    for a, b in zip(fanned.layers, alone.layers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.read_history(), b.read_history(), strict=True))


def _answers(*correct, seed=0, length=360):
    return [
        {"seed": seed, "length": length, "trial": t, "correct": c, "margin": 0.0}
        for t, c in enumerate(correct)
    ]


def test_lost_and_gained_match_prompt_by_prompt():
    ref = _answers(True, False, True) + _answers(True, seed=2)
    # same count (3 of 4) as the reference, but one lost (trial 2) and one gained (trial 1)
    assert lost_and_gained(_answers(True, True, False) + _answers(True, seed=2), ref) == (1, 1)
    # another seed's trial 0 is another prompt; a prompt the reference lacks counts neither way
    assert lost_and_gained(_answers(False, seed=2) + _answers(False, seed=3), ref) == (1, 0)
    assert lost_and_gained(ref, ref) == (0, 0)


def test_eval_table_counts_passkeys_lost_against_dynamic():
    def record(name, *correct):
        answers = _answers(*correct)
        acc = {"360": sum(correct) / len(correct)}
        return {"cache": name, "retrieval": {"accuracy": acc, "margin": {"360": 0.0}, "answers": answers}}

    md = markdown_table([record("dynamic", True, True, False), record("nuq2", False, True, True)])
    assert "passkey lost / gained vs dynamic" in md.splitlines()[0]
    row = next(line for line in md.splitlines() if line.startswith("| nuq2"))
    assert row.rstrip(" |").endswith("-1 / +1")
    # without a dynamic record there is nothing to compare against: no column
    assert "lost / gained" not in markdown_table([record("nuq2", True)])


def test_free_run_counts_in_the_run_identity_only_when_enabled():
    off, on = EvalConfig(), load_config(None, {"free_run.enabled": True})
    assert "free_run" not in off.identity() and on.identity()["free_run"]["tokens"] == 256
    assert off.identity_hash() != on.identity_hash()
    with pytest.raises(EvalError, match="free_run.tokens: invalid value 0"):
        load_config(None, {"free_run.tokens": 0})
