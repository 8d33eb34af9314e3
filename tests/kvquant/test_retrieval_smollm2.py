"""On the embedded SmolLM2: the probe finds the layers passkey retrieval needs, and keeping their keys
and values finer brings back a passkey the low-bit cache loses. Marked `slow` (the real model, a 4k-token prefill)."""

import dataclasses

import pytest
import torch

from kvquant import KVQuantCache, KVQuantConfig
from kvquant.eval.retrieval import _FanOut, answer_first_token, answer_question, passkey_cases, passkey_prompt
from kvquant.models import load_model
from kvquant.retrieval_heads import retrieval_scores, top_layers

pytestmark = pytest.mark.slow


@torch.no_grad()
def test_probed_layers_bring_back_a_passkey_the_low_bit_keys_lose():
    """``tcq2-recent`` without its retrieval heads misses the evaluation's 4k prompt at depth 1/4
    (first-token margin -1.87, full precision +1.73); with the keys and values of the 12 probed KV heads
    (4 layers' worth; the best in layers 18, 17, 8, 14, the layers the preset kept whole until
    2026-12-07) in ``nuq4`` it answers (+1.47; the four whole layers: +1.40). The greedy passkey search,
    asking the model, had found layers 18 and 8."""
    model, tok = load_model()
    assert top_layers(retrieval_scores(model), 4) == [18, 17, 8, 14]
    preset = KVQuantConfig.resolve("tcq2-recent")
    assert preset.retrieval_layers == 4 and preset.retrieval_unit == "head"
    plain = KVQuantCache(model, dataclasses.replace(preset, retrieval_layers=0))
    probed = KVQuantCache(model, preset)
    assert probed.retrieval_heads[:4] == [(18, 2), (17, 1), (8, 0), (14, 1)]
    assert len(probed.retrieval_heads) == 12 and len(probed.retrieval_layers) == 11  # layer 23: two
    case = passkey_cases([4096], trials=6, digits=5, seed=0)[1]
    ids, q_len = passkey_prompt(tok, 4096, case["key"], case["depth"])  # [4096]
    model(input_ids=ids[None, :-q_len], cache=_FanOut(model.config, [plain, probed]), logits_to_keep=1)
    first = answer_first_token(tok, case["key"])
    got_plain, margin_plain = answer_question(model, plain, ids, q_len, 7, first=first)
    got_probed, margin_probed = answer_question(model, probed, ids, q_len, 7, first=first)
    assert case["key"] not in tok.decode(got_plain) and margin_plain < -1.0
    assert case["key"] in tok.decode(got_probed) and margin_probed > 1.0
