"""``kvquant check``: the short preflight on a tiny model (numbers, bits, warning, exit status) and the
shared risk warning."""

from __future__ import annotations

import pytest

import kvquant.eval.preflight as preflight
from kvquant.eval.caches import resolve_spec, theoretical_bits
from kvquant.eval.corpus import ByteTokenizer
from kvquant.eval.preflight import risk_reasons, risk_warning
from kvquant.models import tiny_model
from kvquant.tools.cli import main

SMALL = ["--prefix-len", "40", "--tokens", "8", "--windows", "2"]


def test_risk_warning_bounds_and_numbers():
    fine = {"kl_mean": 0.02, "top1_agreement": 0.9, "delta_ppl_rel": 0.03, "tokens": 64}
    assert risk_reasons(fine) == [] and risk_warning(fine, "int4") is None  # the bounds themselves pass
    kl = {**fine, "kl_mean": 0.0201}
    assert risk_reasons(kl) == ["mean KL 0.0201 > 0.02"]
    top1 = {**fine, "top1_agreement": 0.89}
    w = risk_warning(top1, "k3v2", "smollm2")
    assert w.startswith("warning: cache k3v2 is risky for smollm2: top-1 89.0% < 90% (Δppl +3.0%, 64 tokens")
    assert risk_reasons({"kl_mean": float("nan")}) == []
    assert risk_reasons(fine, max_kl=0.01) == ["mean KL 0.0200 > 0.01"]


def test_preflight_numbers_on_a_tiny_model():
    model, tok = tiny_model("llama"), ByteTokenizer()
    same = preflight.preflight(model, tok, "none", prefix_len=40, score_len=8, windows=2)
    assert same["quality"]["kl_mean"] == 0.0 and same["quality"]["top1_agreement"] == 1.0
    assert same["quality"]["tokens"] == 16 and same["warning"] is None
    assert same["held_tokens"] == 47 and same["bits_16bit"] == pytest.approx(16.0)
    q = preflight.preflight(model, tok, "int4", prefix_len=40, score_len=8, windows=2)
    want = theoretical_bits(resolve_spec("int4"), model)  # 4 bits + scales of this tiny head size
    assert q["quality"]["kl_mean"] > 0 and q["bits_format"] == want and 4 < want < 8
    assert want < q["bits_16bit"] < 16  # the full-precision sink and tail tokens count


def test_cli_check_prints_and_exit_status(tiny_model_dir, capsys, monkeypatch):
    args = ["check", "--model", str(tiny_model_dir), *SMALL]
    assert main([*args, "--cache", "int4"]) == 0
    out = capsys.readouterr().out
    assert "2 window(s) of 40 prefilled + 8 teacher-forced tokens" in out
    assert "mean KL" in out and "over 16 tokens" in out and "the format alone " in out
    assert "ok: mean KL <= 0.02" in out and "warning" not in out

    monkeypatch.setattr(preflight, "MAX_KL", 0.0)  # int4 changes some logit: now "risky"
    assert main([*args, "--cache", "int4"]) == 0  # risky: warned, still 0 without --strict
    out = capsys.readouterr().out
    assert "warning: cache int4 is risky for " in out and "mean KL" in out and "> 0" in out
    assert main([*args, "--cache", "int4", "--strict"]) == 1
    assert main([*args, "--cache", "none", "--strict"]) == 0  # KL exactly 0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--cache", "nope"], "no such preset or YAML file 'nope'"),
        (["--cache", "int4", "--tokens", "1"], "--tokens: expected an integer >= 2"),
        (["--cache", "int4", "--windows", "5000"], "--windows: corpus"),
        (["--cache", "/no/such.yaml"], "--cache"),
    ],
)
def test_cli_check_bad_input_is_one_line_exit_2(tiny_model_dir, capsys, extra, needle):
    assert main(["check", "--model", str(tiny_model_dir), *extra]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("Loading weights")]  # HF's bar
    assert len(lines) == 1 and lines[0].startswith("kvquant check: error: ") and needle in lines[0], err
    assert "Traceback" not in err


def test_cli_check_context_beyond_the_model_is_one_line(tiny_model_dir, capsys):
    assert main(["check", "--model", str(tiny_model_dir), "--cache", "int4", "--prefix-len", "100000"]) == 2
    err = [
        x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("Loading weights")
    ]
    assert len(err) == 1 and "error: --prefix-len + --tokens: context of 100032 tokens is beyond" in err[0], (
        err
    )
