"""A pytest plugin for the ``smoke`` part of ``python -m benchmarks.warm_cache build``: the tests a GPU session's
smoke step runs from ``tests/test_fused_decode.py`` (``benchmarks/gpu_session.sh``), run on the CPU with every
Triton launch compiled for sm_90 into Triton's cache instead of run.

Loaded with ``pytest -p benchmarks.warm_smoke`` in a process started with ``TRITON_CACHE_DIR`` set and
``TRITON_INTERPRET`` unset (:func:`benchmarks.warm_cache.build` starts it). At import, before any test module, the
process compiles for sm_90 instead of launching (:func:`benchmarks.warm_cache.compile_for_sm90`), with the Triton key
``SLAKE_WARM_KEY`` holds (the build's: the device's), else this machine's. The tests then fail (their kernels
computed nothing); what they leave is the cache.
"""

from __future__ import annotations

import os

from benchmarks.warm_cache import compile_for_sm90

compile_for_sm90(os.environ.get("SLAKE_WARM_KEY") or None, record_keys=True)
