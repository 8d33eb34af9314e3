"""The ``kvquant`` subcommands: one module each (``harness`` holds ``eval`` and ``sweep``, which share
their dataclass-derived flags), each with a ``register(sub)`` that adds its parser and sets
``func`` to the function that runs it. The heavy imports (torch, transformers, the harness) happen
inside those functions, so ``kvquant --help`` stays fast.

A new subcommand is one new module here, listed in :data:`MODULES` (the order of ``kvquant --help``).
"""

from __future__ import annotations

from kvquant.tools.commands import bench, calibrate, check, demo, export, harness, plan, tune

MODULES = (demo, check, harness, bench, plan, calibrate, export, tune)
