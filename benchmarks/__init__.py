"""Micro-benchmarks of slake's vLLM plugin: tools for measuring, not part of the library (``pip install slake`` does
not install them). Run them from a checkout, with slake importable (``PYTHONPATH=src`` or an editable install)::

    python -m benchmarks pool-cpu --methods snapkv,slake            # the plugin's decode step, CPU time
    python -m benchmarks pool-gpu --methods snapkv,cake,slake        # the same step on a GPU, eager and graphed
    python -m benchmarks vllm-steps MODEL_DIR --methods snapkv,slake # vLLM's engine steps, plain and with the plugin

One command, one argument parser (:mod:`benchmarks.__main__`); every command prints one JSON line per measurement.
:mod:`benchmarks.pool` holds the random pool and its timings; ``slake bench --engine vllm`` (the user-facing
benchmark, :mod:`slake.engines.vllm.bench`) provides the engine-step timings that ``vllm-steps`` prints alone.
"""
