"""The GPUs the fused kernels are compiled for ahead of time (``tests/kernel_aot.py``,
``tests/test_kernels_compile.py``): what each allows a kernel. Plain data, importable anywhere (``kernel_aot``
itself switches Triton out of its interpreter when imported, so a test process must not import it)."""

from __future__ import annotations

#: the most shared memory one program may use on each target, in bytes (CUDA's opt-in maximum per block; AMD's
#: LDS per workgroup): a T4, an A100, consumer Ampere and Ada, Hopper, Blackwell's B200 and consumer parts, MI200,
#: MI300, MI350
SHARED_LIMITS = {
    75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376,
    "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840,
}  # fmt: skip
