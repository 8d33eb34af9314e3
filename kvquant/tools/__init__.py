"""Tools above the library and the harness: the ``kvquant`` command and what its subcommands run.

``cli`` (the console script), ``demo``, ``plan`` (capacity table; the arithmetic is
:mod:`kvquant.planning`), ``tune`` (per-layer mixed precision), ``calibrate`` (static scales),
``bench`` (CPU decode and prefill speed of every preset), ``bench_kernels`` (the GPU kernel benchmark)
and ``gpu_check`` (``make gpu-check``). Tools may import the library and the harness
(:mod:`kvquant.eval`); neither imports tools.

Example::

    from kvquant.tools.plan import plan
    from kvquant.models import tiny_config

    rows = plan(tiny_config("llama"), memory_bytes="1GiB", context=256, presets=["int4"])
"""
