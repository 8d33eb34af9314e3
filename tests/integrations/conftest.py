"""Fixtures of the integration tests: local lm-eval tasks (``dataset_path: json``, offline) written
into a temporary include_path, and a runner that returns each request's raw responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

# Contexts longer than int4's 20 full-precision tokens (4 sinks + 16 newest), so that a quantized
# cache holds part of every context and its numbers differ from the full-precision ones.
MC_DOCS = [
    {
        "question": "France is a country in Western Europe. Its largest city lies on the river Seine and is "
        "also the seat of its government. Question: Which city is the capital of France? Answer:",
        "choices": [" Paris", " London", " Rome"],
        "answer": 0,
    },
    {
        "question": "On the Celsius scale, pure water boils at one hundred degrees at sea level, and it turns "
        "to ice at a lower temperature. Question: At how many degrees does water freeze? Answer:",
        "choices": [" zero", " fifty", " one hundred"],
        "answer": 0,
    },
    {
        "question": "Eight planets go around the Sun. The four outer ones are giants made mostly of gas, and "
        "the biggest of them has a great red spot. Question: Which is the largest planet? Answer:",
        "choices": [" Jupiter", " Mercury", " the Moon"],
        "answer": 0,
    },
]
GEN_DOCS = [
    {"question": "The days of the week are Monday, Tuesday, Wednesday, Thursday,", "answer": " Friday"},
    {"question": "Counting from one: one, two, three, four, five, six, seven,", "answer": " eight"},
]
TEXT_DOCS = [
    {
        "text": "The river rises in the hills north of the town and flows south through farmland, "
        "where it is joined by two smaller streams before it reaches the sea. In the nineteenth "
        "century its banks held mills and a small port, and today a path follows it for most of its length."
    }
]

TASKS = {
    "kvq_mc": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "kvq_gen": {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 4, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    },
    "kvq_ppl": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    },
}
DOCS = {"kvq_mc": MC_DOCS, "kvq_gen": GEN_DOCS, "kvq_ppl": TEXT_DOCS}


def write_tasks(folder: Path) -> Path:
    """Write the three tasks (YAML + JSONL) into ``folder``; returns it (an lm-eval include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, spec in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[name]))
        cfg = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **spec,
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def run_tasks(model: str, model_args: str, include_path: Path, tasks: list[str]) -> dict[str, Any]:
    """``{task: [raw responses of each doc]}`` and ``{"results": ...}`` of one lm-eval run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvquant.integrations.lm_eval_model  # noqa: F401  (registers "kvquant")

    manager = TaskManager(include_path=str(include_path), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
    )
    responses = {t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in tasks}
    return {"results": out["results"], **responses}


@pytest.fixture(scope="session")
def lm_tasks(tmp_path_factory) -> Path:
    """An lm-eval include_path holding the tasks ``kvq_mc``, ``kvq_gen`` and ``kvq_ppl``."""
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


@pytest.fixture
def run_lm_eval():
    """:func:`run_tasks`: ``run_lm_eval(model, model_args, include_path, tasks)``."""
    return run_tasks
