"""python -m kvquant.eval.passkey_long: bad --caches fail before the model loads."""

import json

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


def _answer(trial, correct, margin, length=360):
    return {"length": length, "trial": trial, "key": "12345", "depth": 0.5, "answer": "", "correct": correct,
            "margin": margin}  # fmt: skip


def test_seeds_are_pooled_and_recorded(tmp_path, monkeypatch, capsys, tiny, byte_tok):
    # --seed 0,2: each prompt set runs in turn; every line says its seed; the table counts both sets
    calls = []

    def answers(model, tok, builds, *, seed, on_answer, **kw):
        calls.append(seed)
        out = {}
        for name in builds:
            got = [
                _answer(0, True, 1.0),
                _answer(1, name == "dynamic" or seed == 2, 0.5 if seed == 2 else -0.5),
            ]
            for a in got:
                on_answer(name, a)
            out[name] = {"answers": got}
        return out

    monkeypatch.setattr(passkey_long, "load_eval_model", lambda cfg: (tiny, byte_tok))
    monkeypatch.setattr(passkey_long, "passkey_accuracy_shared", answers)
    out = tmp_path / "answers.jsonl"
    args = ["--caches", "dynamic,int8", "--lengths", "360", "--seed", "0,2", "--out", str(out)]
    assert passkey_long.main(args) == 0
    assert calls == [0, 2]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["cache"], r["seed"]) for r in lines[:2]] == [("dynamic", 0), ("dynamic", 0)]
    assert {r["seed"] for r in lines} == {0, 2} and len(lines) == 8
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| int8"))
    # int8 missed trial 1 of seed 0 only: 3 of 4, one prompt lost against dynamic, none gained
    assert [c.strip() for c in row.strip("|").split("|")] == ["int8", "3/4", "+0.50", "-1 / +0"]


def test_summary_counts_lost_and_gained_prompt_by_prompt():
    answers = {
        "dynamic": [_answer(0, True, 1.0), _answer(1, False, -0.2), _answer(2, True, 0.1)],
        "x": [_answer(0, True, 1.0), _answer(1, True, 0.3), _answer(2, False, -0.4)],
    }
    head, rows = passkey_long.summary_table(answers, [360])
    assert head[-1] == "vs dynamic @360 (lost / gained)"
    # same accuracy (2/3), different prompts: one lost, one gained
    assert rows[1] == ["x", "2/3", "+0.30", "-1 / +1"]
    head, rows = passkey_long.summary_table({"x": answers["x"]}, [360])
    assert len(head) == 3 and rows == [["x", "2/3", "+0.30"]]


def test_bad_seed_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(passkey_long, "load_eval_model", lambda cfg: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as exc:
        passkey_long.main(["--caches", "int8", "--seed", "0,x", "--out", str(tmp_path / "a.jsonl")])
    assert exc.value.code == 2
    assert "--seed" in capsys.readouterr().err


def test_runs_as_a_module(tmp_path):
    # python -m kvquant.eval.passkey_long reaches main (its flags are checked before the model loads)
    import subprocess
    import sys

    out = tmp_path / "a.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "kvquant.eval.passkey_long",
        "--caches",
        "int8",
        "--seed",
        "x",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--seed" in proc.stderr
