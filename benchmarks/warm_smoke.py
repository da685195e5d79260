"""A pytest plugin for the ``smoke`` part of ``python -m benchmarks.warm_cache build``: the tests a GPU session's
smoke step runs from ``tests/test_fused_decode.py`` (``benchmarks/gpu_session.sh``), run on the CPU with every
Triton launch compiled for sm_90 into Triton's cache instead of run.

Loaded with ``pytest -p benchmarks.warm_smoke`` in a process started with ``TRITON_CACHE_DIR`` set and
``TRITON_INTERPRET`` unset (:func:`benchmarks.warm_cache.build` starts it). At import, before any test module, the
process compiles for sm_90 instead of launching (:func:`benchmarks.warm_cache.compile_for_sm90`), with the device's
Triton key when ``SLAKE_WARM_WHEEL`` names its wheel (else this machine's). The tests then fail (their kernels
computed nothing); what they leave is the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.warm_cache import compile_for_sm90, device_triton_key

_wheel = os.environ.get("SLAKE_WARM_WHEEL")
compile_for_sm90(device_triton_key(Path(_wheel)) if _wheel else None)
