"""``kvquant demo`` times both caches alike and compares memory like with like (tiny model)."""

from __future__ import annotations

import re

from transformers import DynamicCache

import kvquant.tools.demo as demo
from kvquant.cache import KVQuantCache
from kvquant.models import tiny_model


def test_both_caches_are_warmed_up_and_timed_alike(monkeypatch, capsys):
    model = tiny_model("llama")

    class Tok:
        chat_template = None

        def __call__(self, text, return_tensors="pt"):
            import torch

            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])})()

        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    monkeypatch.setattr(demo, "load_model", lambda name: (model, Tok()))
    calls = []
    real = demo._generate

    def logged(model_, ids, cache, n):
        calls.append((type(cache).__name__, n))
        return real(model_, ids, cache, n)

    monkeypatch.setattr(demo, "_generate", logged)
    assert demo.run("tiny", "Hello there, a short prompt.", 4, "int4") == 0
    d, q = DynamicCache.__name__, KVQuantCache.__name__
    # an untimed warm-up each, then A B B A
    assert calls == [(d, 4), (q, 4), (d, 4), (q, 4), (q, 4), (d, 4)]
    out = capsys.readouterr().out
    # memory: both at 16 bits for the same positions; the ratio and the effective bits agree
    kib = re.search(r"DynamicCache: (\d+) KiB", out)
    ratio, bits = re.search(r"int4: \d+ KiB \(([\d.]+)x; ([\d.]+) effective bits", out).groups()
    assert kib and abs(16 * float(ratio) - float(bits)) < 0.02
    assert "16-bit model" in out and "this float32 model's own caches" in out


def test_demo_prints_the_shared_risk_warning(monkeypatch, capsys, tiny_model_dir):
    import kvquant.eval.preflight as preflight

    monkeypatch.setattr(preflight, "MAX_KL", 0.0)  # any logit change is "risky"
    assert demo.run(str(tiny_model_dir), "Hello there.", 4, "int4", check=True) == 0
    out = capsys.readouterr().out
    assert "preflight (kvquant check: 3 windows of 256 + 32 tokens of the embedded corpus)" in out
    warned = [line for line in out.splitlines() if line.startswith("warning: cache int4 is risky for ")]
    assert len(warned) == 1 and "mean KL" in warned[0]
    monkeypatch.setattr(preflight, "MAX_KL", 1e9)
    monkeypatch.setattr(preflight, "MIN_TOP1", 0.0)
    assert demo.run(str(tiny_model_dir), "Hello there.", 4, "int4") == 0
    assert "warning" not in capsys.readouterr().out
