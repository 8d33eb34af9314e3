"""Long-context retrieval: passkey accuracy at several context lengths.

The prompt (the passkey test of Mohtashami & Jaggi, "Landmark Attention", 2023) is an instruction,
filler sentences repeated up to the context length, one needle sentence holding a random
``digits``-digit key at a depth of ``(i + 0.5) / trials`` of the filler, and a question. It is built
token by token to exactly ``L`` tokens. Keys and depths depend only on the seed, ``L`` and the trial,
so every cache sees the same prompts.

:func:`passkey_accuracy_shared` gives the same answers for several caches at the cost of one haystack
prefill per prompt (the long part at 4k-8k tokens on a CPU): the prefill runs once through a
DynamicCache that hands every ``update`` call, with its arguments, to each cache as well. A cache's
prefill returns the call's own full-precision keys / values (nothing is stored before it), so the
forward is the same under every cache and each cache receives exactly the calls it would receive on
its own; then each cache answers alone (question call, greedy decode).

Through the cache: the haystack (everything before the question) is prefilled in one call, the
question in a second call (so it attends to the *stored*, quantized haystack, as a follow-up question
in a chat would), then ``digits + 2`` tokens are decoded greedily. A trial scores 1 when the first run
of digits in the answer equals the key.

Three trials per length are a coarse signal, so each answer also records ``margin``: at the question
call, the logit of the true answer's first token less the largest other logit (> 0: greedy starts the
answer; the failures seen start another sentence there). ``passkey_accuracy*`` report its mean per
length as ``margin`` next to ``accuracy``: it moves before the accuracy does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

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
def answer(
    model: Any, cache: Any, ids: torch.Tensor, question_len: int, new_tokens: int, *, first: int | None = None
) -> list[int] | tuple[list[int], float]:
    """Greedy answer ids to prompt ``ids [L]``: haystack prefill, question call, then one token per step
    (with ``first``, also the margin: see :func:`answer_question`)."""
    device = next(model.parameters()).device
    model(input_ids=ids.to(device)[None, :-question_len], cache=cache, use_cache=True, logits_to_keep=1)
    return answer_question(model, cache, ids, question_len, new_tokens, first=first)


@torch.no_grad()
def answer_question(
    model: Any, cache: Any, ids: torch.Tensor, question_len: int, new_tokens: int, *, first: int | None = None
) -> list[int] | tuple[list[int], float]:
    """:func:`answer` after its haystack prefill (``cache`` holds ``ids[:-question_len]``). With ``first``
    (the true answer's first token id) returns ``(ids, margin)``: at the question call, that token's logit
    less the largest other logit."""
    device = next(model.parameters()).device
    ids = ids.to(device)[None]
    out = model(input_ids=ids[:, -question_len:], cache=cache, use_cache=True, logits_to_keep=1)
    margin = None if first is None else token_margin(out.logits[0, -1], first)
    got = []
    for _ in range(new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]
        got.append(int(nxt))
        out = model(input_ids=nxt, cache=cache, use_cache=True)
    return got if first is None else (got, margin)


def token_margin(logits: torch.Tensor, token: int) -> float:
    """``logits [V]``: ``logits[token]`` less the largest other logit."""
    logits = logits.float()
    others = torch.cat([logits[:token], logits[token + 1 :]])
    return float(logits[token] - others.max())


def answer_first_token(tokenizer: Any, key: str) -> int:
    """The id the true answer starts with after the question (``" <key>."``)."""
    return tokenizer.encode(f" {key}.", add_special_tokens=False)[0]


class _FanOut(DynamicCache):
    """A DynamicCache whose every ``update`` is also made, with the same arguments, on each of ``caches``."""

    def __init__(self, config: Any, caches: list[Any]):
        super().__init__(config=config)
        self.caches = caches

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        for cache in self.caches:
            cache.update(key_states, value_states, layer_idx, *args, **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _score(text: str, key: str) -> bool:
    found = re.search(r"\d+", text)
    return bool(found and found.group() == key)


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
    """Accuracy and mean first-token margin per length (``{"accuracy": {L: acc}, "margin": {L: m},
    "answers": [...]}``) for caches from ``build_cache``."""
    cases = passkey_cases(lengths, trials, digits, seed)
    answers = []
    for case in progress(cases, desc="passkey", leave=False) if progress else cases:
        ids, q_len = passkey_prompt(tokenizer, case["length"], case["key"], case["depth"])
        first = answer_first_token(tokenizer, case["key"])
        got, margin = answer(model, build_cache(), ids, q_len, digits + 2, first=first)
        text = tokenizer.decode(got, skip_special_tokens=True)
        answers.append({**case, "answer": text, "correct": _score(text, case["key"]), "margin": margin})
    return _summary(answers, lengths)


def lost_and_gained(answers: list[dict[str, Any]], reference: list[dict[str, Any]]) -> tuple[int, int]:
    """Prompts the reference answered and ``answers`` missed (lost), and the reverse (gained): the
    same accuracy can hide a lost prompt and a gained one. Answers are matched by seed (0 where
    absent), length and trial; prompts the reference lacks count neither way.

    Example:
        >>> ref = [{"length": 4096, "trial": 0, "correct": True}, {"length": 4096, "trial": 1, "correct": False}]
        >>> got = [{"length": 4096, "trial": 0, "correct": False}, {"length": 4096, "trial": 1, "correct": True}]
        >>> lost_and_gained(got, ref)
        (1, 1)
    """
    ref = {_prompt_key(a): a["correct"] for a in reference}
    lost = sum(ref.get(_prompt_key(a)) is True and not a["correct"] for a in answers)
    gained = sum(ref.get(_prompt_key(a)) is False and a["correct"] for a in answers)
    return lost, gained


def _prompt_key(answer: dict[str, Any]) -> tuple[int, int, int]:
    return answer.get("seed", 0), answer["length"], answer["trial"]


def _accuracy(answers: list[dict[str, Any]], lengths: list[int]) -> dict[str, float]:
    accuracy = {}
    for length in lengths:
        hits = [a["correct"] for a in answers if a["length"] == length]
        accuracy[str(length)] = sum(hits) / len(hits)
    return accuracy


def _mean_margin(answers: list[dict[str, Any]], lengths: list[int]) -> dict[str, float]:
    out = {}
    for length in lengths:
        m = [a["margin"] for a in answers if a["length"] == length]
        out[str(length)] = sum(m) / len(m)
    return out


def _summary(answers: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    return {
        "accuracy": _accuracy(answers, lengths),
        "margin": _mean_margin(answers, lengths),
        "answers": answers,
    }


@torch.no_grad()
def passkey_accuracy_shared(
    model: Any,
    tokenizer: Any,
    builds: dict[str, Callable[[], Any]],
    *,
    lengths: list[int],
    trials: int,
    digits: int = 5,
    seed: int = 0,
    on_answer: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """:func:`passkey_accuracy` of every cache of ``builds`` (name -> factory), one haystack prefill per
    prompt (see the module docstring). ``on_answer(name, answer)`` is called as each answer is known
    (prompts in order of ``lengths``, then trials). Returns ``{name: {"accuracy": ..., "margin": ...,
    "answers": ...}}``.

    Example:
        >>> builds = {"dynamic": lambda: DynamicCache(config=model.config),
        ...           "nuq2": lambda: KVQuantCache(model, "nuq2")}
        >>> passkey_accuracy_shared(model, tok, builds, lengths=[4096], trials=3)["nuq2"]["accuracy"]
    """
    device = next(model.parameters()).device
    answers: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    for case in passkey_cases(lengths, trials, digits, seed):
        ids, q_len = passkey_prompt(tokenizer, case["length"], case["key"], case["depth"])
        caches = {name: build() for name, build in builds.items()}
        model(
            input_ids=ids.to(device)[None, :-q_len],
            cache=_FanOut(model.config, list(caches.values())),
            use_cache=True,
            logits_to_keep=1,
        )
        first = answer_first_token(tokenizer, case["key"])
        for name, cache in caches.items():
            got, margin = answer_question(model, cache, ids, q_len, digits + 2, first=first)
            text = tokenizer.decode(got, skip_special_tokens=True)
            record = {**case, "answer": text, "correct": _score(text, case["key"]), "margin": margin}
            answers[name].append(record)
            if on_answer is not None:
                on_answer(name, record)
        del caches
    return {name: _summary(a, lengths) for name, a in answers.items()}
