"""``kvquant plan``: the capacity table printed by the command.

The arithmetic (bytes per sequence from a model config, max batch, max context) is
:mod:`kvquant.planning`, re-exported here so that ``from kvquant.tools.plan import plan`` reads as the
command does.

Example:
    >>> from kvquant.models import tiny_config
    >>> from kvquant.tools.plan import format_table, plan
    >>> rows = plan(tiny_config("llama"), memory_bytes="1GiB", context=256, presets=["int4"])
    >>> print(format_table(rows, model="tiny llama").splitlines()[3])
    | config | KV bytes / seq @ 256 | bytes / token | bits / elem | max batch @ 256 | max context @ batch 1 |
"""

from __future__ import annotations

from typing import Any

from kvquant.planning import (
    DEFAULT_RESERVE,
    DTYPE_BYTES,
    PlanError,
    budget,
    dtype_bytes,
    estimate_parameters,
    human_bytes,
    load_config,
    max_batch,
    max_context,
    parse_reserve,
    parse_size,
    plan,
    tp_split,
)

__all__ = [
    "DEFAULT_RESERVE",
    "DTYPE_BYTES",
    "PlanError",
    "budget",
    "dtype_bytes",
    "estimate_parameters",
    "format_table",
    "load_config",
    "max_batch",
    "max_context",
    "parse_reserve",
    "parse_size",
    "plan",
    "tp_split",
]


def format_table(rows: list[dict[str, Any]], model: str = "") -> str:
    """The plan as a markdown table, with the budget stated above it."""
    r0 = rows[0]
    tp = r0.get("tp", 1)
    per = " per device" if tp > 1 else ""
    head = [
        f"model: {model}  ({r0['parameters']:,} parameters, max_position_embeddings "
        f"{r0['max_position_embeddings']})",
        f"memory{per} {human_bytes(r0['memory_bytes'])} = weights {human_bytes(r0['weights_bytes'])} ({r0['weights_dtype']}) "
        f"+ activation reserve {human_bytes(r0['reserve_bytes'])} ({r0['reserve']}) "
        f"+ KV budget {human_bytes(r0['available_bytes'])}",
        "",
        f"| config | KV bytes / seq{per} @ {r0['context']} | bytes / token{per} | bits / elem "
        f"| max batch @ {r0['context']} | max context @ batch {r0['batch']} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    capped = False
    mpe = r0["max_position_embeddings"]
    if tp > 1:
        rep = r0["kv_replication"]
        head.insert(
            2,
            f"tensor parallel over {tp} devices: {r0['kv_heads_per_device']} of {r0['kv_heads']} KV heads "
            f"per device"
            + (
                f" (each KV head replicated on {rep} devices, as engines do when tp > KV heads)"
                if rep > 1
                else ""
            )
            + "; weights split evenly (estimate); max batch / context are the deployment's",
        )
    if mpe and r0["context"] > mpe:
        head.insert(
            2, f"warning: context {r0['context']} exceeds the model's max_position_embeddings ({mpe})"
        )
    for r in rows:
        ctx = f"{r['max_context']:,}"
        if r["max_context_capped"]:
            ctx += " (cap)"
            capped = True
        mb = "unbounded" if r["max_batch"] < 0 else f"{r['max_batch']:,}"
        head.append(
            f"| {r['label']} | {r['kv_bytes']:,} ({human_bytes(r['kv_bytes'])}) | {r['bytes_per_token']:,.1f} "
            f"| {r['effective_bits']:.2f} | {mb} | {ctx} |"
        )
    notes = [
        "",
        "Max batch / max context use the peak KV bytes over all contexts up to the one given "
        "(a sequence passes through them); weights are estimated from the config.",
    ]
    if capped:
        notes.append(
            f"(cap): limited by the model's max_position_embeddings ({r0['max_position_embeddings']}), "
            "not by memory."
        )
    return "\n".join(head + notes)
