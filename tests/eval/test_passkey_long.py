"""python -m kvquant.eval.passkey_long: bad --caches fail before the model loads."""

import pytest

from kvquant.eval import passkey_long


def test_two_caches_of_one_name_are_refused(tmp_path, capsys, monkeypatch):
    # answers are keyed by cache name: two YAMLs named alike would run one and report it under both
    for stem, fmt in (("a", "nuq4"), ("b", "int8")):
        (tmp_path / f"{stem}.yaml").write_text(f"key_format: {fmt}\nvalue_format: {fmt}\nname: same\n")
    monkeypatch.setattr(passkey_long, "load_eval_model", lambda cfg: pytest.fail("model loaded"))
    out = tmp_path / "answers.jsonl"
    with pytest.raises(SystemExit) as exc:
        passkey_long.main(["--caches", f"{tmp_path / 'a.yaml'},{tmp_path / 'b.yaml'}", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--caches" in err and "'same'" in err
    assert not out.exists()


def test_seed_picks_the_prompts(tmp_path, monkeypatch, tiny, byte_tok):
    # --seed 1: prompts the evaluation (seed 0) does not use, e.g. to choose a config on
    seen = {}

    def answers(model, tok, builds, **kw):
        seen.update(kw)
        return {}

    monkeypatch.setattr(passkey_long, "load_eval_model", lambda cfg: (tiny, byte_tok))
    monkeypatch.setattr(passkey_long, "passkey_accuracy_shared", answers)
    out = str(tmp_path / "answers.jsonl")
    assert passkey_long.main(["--caches", "int8", "--lengths", "360", "--seed", "1", "--out", out]) == 0
    assert seen["seed"] == 1 and seen["lengths"] == [360]
    assert passkey_long.main(["--caches", "int8", "--lengths", "360", "--out", out]) == 0
    assert seen["seed"] == 0
