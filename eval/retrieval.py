"""Long-context retrieval: passkey accuracy at several context lengths.

The prompt (the passkey test of Mohtashami & Jaggi, "Landmark Attention", 2023) is an instruction,
filler sentences repeated up to the context length, one needle sentence holding a random
``digits``-digit key at a depth of ``(i + 0.5) / trials`` of the filler, and a question. It is built
token by token to exactly ``L`` tokens. Keys and depths depend only on the seed, ``L`` and the trial,
so every cache sees the same prompts.

Through the cache: the haystack (everything before the question) is prefilled in one call, the
question in a second call (so it attends to the *stored*, quantized haystack, as a follow-up question
in a chat would), then ``digits + 2`` tokens are decoded greedily. A trial scores 1 when the first run
of digits in the answer equals the key.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

import torch

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer: Any, length: int, key: str, depth: float) -> tuple[torch.Tensor, int]:
    """``([length] prompt ids, number of question tokens at its end)``."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    intro, filler, needle, question = enc(INTRO), enc(FILLER), enc(NEEDLE.format(key=key)), enc(QUESTION)
    n_fill = length - len(intro) - len(needle) - len(question)
    if n_fill < len(filler):
        raise ValueError(f"passkey: context {length} is too short for the prompt (needs > {length - n_fill})")
    units, rest = divmod(n_fill, len(filler))
    before = round(depth * units)
    ids = intro + filler * before + needle + filler * (units - before) + filler[:rest] + question
    assert len(ids) == length
    return torch.tensor(ids, dtype=torch.long), len(question)


@torch.no_grad()
def answer(model: Any, cache: Any, ids: torch.Tensor, question_len: int, new_tokens: int) -> list[int]:
    """Greedy answer ids to prompt ``ids [L]``: haystack prefill, question call, then one token per step."""
    device = next(model.parameters()).device
    ids = ids.to(device)[None]
    model(input_ids=ids[:, :-question_len], cache=cache, use_cache=True, logits_to_keep=1)
    out = model(input_ids=ids[:, -question_len:], cache=cache, use_cache=True, logits_to_keep=1)
    got = []
    for _ in range(new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]
        got.append(int(nxt))
        out = model(input_ids=nxt, cache=cache, use_cache=True)
    return got


def passkey_cases(lengths: list[int], trials: int, digits: int, seed: int) -> list[dict[str, Any]]:
    cases = []
    for length in lengths:
        for t in range(trials):
            rng = random.Random(f"{seed}-{length}-{t}")
            key = str(rng.randrange(10 ** (digits - 1), 10**digits))
            cases.append({"length": length, "trial": t, "key": key, "depth": (t + 0.5) / trials})
    return cases


def passkey_accuracy(
    model: Any,
    tokenizer: Any,
    build_cache: Callable[[], Any],
    *,
    lengths: list[int],
    trials: int,
    digits: int = 5,
    seed: int = 0,
    progress: Callable | None = None,
) -> dict[str, Any]:
    """Accuracy per length (``{"accuracy": {L: acc}, "answers": [...]}``) for caches from ``build_cache``."""
    cases = passkey_cases(lengths, trials, digits, seed)
    answers = []
    for case in progress(cases, desc="passkey", leave=False) if progress else cases:
        ids, q_len = passkey_prompt(tokenizer, case["length"], case["key"], case["depth"])
        text = tokenizer.decode(
            answer(model, build_cache(), ids, q_len, digits + 2), skip_special_tokens=True
        )
        found = re.search(r"\d+", text)
        answers.append({**case, "answer": text, "correct": bool(found and found.group() == case["key"])})
    accuracy = {}
    for length in lengths:
        hits = [a["correct"] for a in answers if a["length"] == length]
        accuracy[str(length)] = sum(hits) / len(hits)
    return {"accuracy": accuracy, "answers": answers}
