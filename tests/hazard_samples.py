"""Small Triton kernels with and without a memory hazard inside a program, for ``tests/test_kernel_hazards.py``.

Run as a script in its own process (Triton decides when a kernel is defined whether it is interpreted, so this module
is imported with ``TRITON_INTERPRET`` unset): each sample is compiled for an H100 (``sm_90``, no GPU needed), some
for an MI300X too (``gfx942``, whose loads and stores become buffer operations), and :func:`kernel_hazards.hazards`
read off its Triton GPU IR. Prints one JSON object:
each sample's name and the kinds of the hazards found, sorted, or ``"error: ..."`` where the analysis refused it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import kernel_hazards  # noqa: E402


@triton.jit
def store_then_shifted_load(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(p + i, i.to(tl.float32))
    x = tl.load(p + i + 1, mask=i + 1 < B, other=0.0)  # the element another thread stored
    tl.store(q + i, x)


@triton.jit
def store_barrier_load(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(p + i, i.to(tl.float32))
    tl.debug_barrier()
    x = tl.load(p + i + 1, mask=i + 1 < B, other=0.0)
    tl.store(q + i, x)


@triton.jit
def load_then_reversed_store(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(p + i)
    tl.store(p + B - 1 - i, x)  # over an element another thread may not have read yet


@triton.jit
def load_reduce_store(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(p + i)
    tl.store(p + B - 1 - i, x + tl.sum(x, 0))  # the sum exists once every thread's load returned


@triton.jit
def load_branch_store(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(p + i)
    if tl.sum(x, 0) > 0:  # the branch is taken once every thread's load returned
        tl.store(p + B - 1 - i, tl.full([B], 1.0, tl.float32))


@triton.jit
def read_modify_write(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(p + i, tl.load(p + i) * 2.0)  # each element read and written by the thread that holds it


@triton.jit
def _compact(p, n, B: tl.constexpr, BARRIERS: tl.constexpr):
    """The order buffer's compaction (``triton_wide._drop_evicted``): positive entries moved to the front, a block at
    a time, with or without its barriers."""
    i = tl.arange(0, B)
    kept = tl.sum(tl.zeros([B], tl.int32), 0)
    for i0 in range(0, n, B):
        x = tl.load(p + i0 + i, mask=i0 + i < n, other=0.0)
        keep = (x > 0).to(tl.int32)
        at = kept + tl.cumsum(keep, 0) - keep  # the sum carried from earlier blocks settles none of this block
        if BARRIERS:
            tl.debug_barrier()
        tl.store(p + at, x, mask=keep != 0)
        if BARRIERS:
            tl.debug_barrier()
        kept += tl.sum(keep, 0)


@triton.jit
def loop_compaction(p, q, n, B: tl.constexpr):
    _compact(p, n, B, False)


@triton.jit
def loop_compaction_with_barriers(p, q, n, B: tl.constexpr):
    _compact(p, n, B, True)


@triton.jit
def two_atomics(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.atomic_add(p + i, 1.0, sem="relaxed")
    tl.atomic_add(p + B - 1 - i, 1.0, sem="relaxed")


@triton.jit
def atomic_then_load(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.atomic_add(p + i, 1.0, sem="relaxed")
    tl.store(q + i, tl.load(p + B - 1 - i))


@triton.jit
def scalar_store_then_load(p, q, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(p, 1.0)  # by one thread
    tl.store(q + i, tl.load(p + i))


@triton.jit
def scalar_read_modify_write(p, q, n, B: tl.constexpr):
    x = tl.load(p)  # by every thread
    tl.store(p, x + 1.0)  # by one, maybe before another thread's load


@triton.jit
def replicated_read_modify_write(p, q, n, B: tl.constexpr):
    i = tl.arange(0, 16)  # 16 elements over 128 threads: each held by 8 of them, stored by one
    tl.store(p + i, tl.load(p + i) + 1.0)


@triton.jit
def block_pointer(p, q, n, B: tl.constexpr):
    ptr = tl.make_block_ptr(p, shape=(n,), strides=(1,), offsets=(0,), block_shape=(B,), order=(0,))
    tl.store(q + tl.arange(0, B), tl.load(ptr, boundary_check=(0,)))


@triton.jit
def pointer_from_an_integer(p, q, n, B: tl.constexpr):
    address = p.to(tl.uint64, bitcast=True) + 4
    tl.store(q + tl.arange(0, B), tl.load(address.to(tl.pointer_type(tl.float32), bitcast=True)))


SAMPLES = (
    store_then_shifted_load, store_barrier_load, load_then_reversed_store, load_reduce_store, load_branch_store,
    read_modify_write, loop_compaction, loop_compaction_with_barriers, two_atomics, atomic_then_load,
    scalar_store_then_load, scalar_read_modify_write, replicated_read_modify_write, block_pointer,
    pointer_from_an_integer,
)  # fmt: skip


#: the samples compiled for an MI300X too, whose Triton turns loads and stores into buffer operations
AMD_SAMPLES = (store_then_shifted_load, load_then_reversed_store, read_modify_write, loop_compaction,
               loop_compaction_with_barriers, two_atomics)  # fmt: skip


def main() -> None:
    signature = {"p": "*fp32", "q": "*fp32", "n": "i32", "B": "constexpr"}
    report = {}
    for target, samples, suffix in ((GPUTarget("cuda", 90, 32), SAMPLES, ""),
                                    (GPUTarget("hip", "gfx942", 64), AMD_SAMPLES, "@gfx942")):  # fmt: skip
        for fn in samples:
            source = triton.compiler.ASTSource(fn, signature, {"B": 256})
            ttgir = triton.compile(source, target=target).asm["ttgir"]
            name = fn.__name__ + suffix
            try:
                report[name] = sorted(h.kind for h in kernel_hazards.hazards(ttgir))
            except ValueError as e:
                report[name] = f"error: {e}"
            if suffix:  # whether Triton made buffer operations of its accesses
                report[name + " buffer"] = "amdg.buffer_" in ttgir
    print(json.dumps(report))


if __name__ == "__main__":
    main()
