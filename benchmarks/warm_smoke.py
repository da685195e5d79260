"""A pytest plugin for the ``smoke`` part of ``python -m benchmarks.warm_cache build``: the tests a GPU session's
smoke step runs from ``tests/test_fused_decode.py`` (``benchmarks/gpu_session.sh``), run on the CPU with every
Triton launch compiled for sm_90 into Triton's cache instead of run.

Loaded with ``pytest -p benchmarks.warm_smoke`` in a process started with ``TRITON_CACHE_DIR`` set and
``TRITON_INTERPRET`` unset (:func:`benchmarks.warm_cache.build` starts it). At import, before any test module: Triton's
key becomes the device's (``SLAKE_WARM_WHEEL``: its Triton wheel, else this machine's), its driver one that reports
sm_90 (:func:`benchmarks.warm_cache.sm90_driver`), the fused kernels and the tests' probe kernels are imported
compiled, not interpreted, and every ``kernel[grid](...)`` becomes Triton's ``warmup`` of that launch: the JIT
specializes and compiles it as on the GPU, and nothing runs. The tests then fail (their kernels computed nothing);
what they leave is the cache. The launch cache is off (``SLAKE_CACHED_LAUNCH=0``: it would call a compiled kernel's
launcher), and half-precision keys take the low-precision products, as on a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ["SLAKE_CACHED_LAUNCH"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import triton.runtime.cache as triton_cache  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from benchmarks.warm_cache import device_triton_key, sm90_driver  # noqa: E402

_wheel = os.environ.get("SLAKE_WARM_WHEEL")
if _wheel:
    _key = device_triton_key(Path(_wheel))
    triton_cache.triton_key = lambda: _key
driver.set_active(sm90_driver())


def _warmup(self, grid):  # noqa: ANN001, ANN202
    return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)


JITFunction.__getitem__ = _warmup

import kernel_probes  # noqa: E402, F401  (the tests' probe kernels, compiled)
from slake.cache import fused_step  # noqa: E402
from slake.kernels import compile_log, triton_decode, triton_dense  # noqa: E402, F401

if os.environ.get(compile_log.ENV):  # what the smoke part compiles, logged too
    compile_log.install(os.environ[compile_log.ENV])
fused_step.half_precision_dots = lambda device, keys_dtype: keys_dtype in (torch.float16, torch.bfloat16)
triton_dense.half_precision_dots = fused_step.half_precision_dots
# the kernel modules are imported compiled; from now on slake.kernels.load() returns them as they are
os.environ["TRITON_INTERPRET"] = "1"
