"""The launch configuration of the fused decode kernels (:mod:`slake.kernels.triton_decode`): how a step's rows
are cut into the first kernel's programs, the second kernel's warps and register limit, its blocks, and the
switches that time the kernels' parts and alternatives on a GPU (:func:`leaving_out`, ``python -m benchmarks
kernel-parts``; :func:`tuned`, ``python -m benchmarks kernel-tune``).

Plain Python, no Triton: every value is read when a step is launched (``triton_decode.fused_step``), so a change
made here, or within :func:`tuned`, takes effect at the next launch.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

__all__ = [
    "CACHED_LAUNCH", "COMBINE", "FREE_BLOCK", "HELD_STEP", "MIN_SPLIT", "POOL_GATHER", "PROJECTION_BLOCK", "RANK_TILE",
    "RECOMPUTE_BLOCK", "HELD_ORDER", "NEW_TOKEN_APART", "SHORT_KEYS", "SKIP_PARTS", "TARGET_PROGRAMS", "TUNABLE",
    "UNSPECIALIZED", "WIDE_BLOCK", "WIDE_ROW", "WIDE_SLOTS", "WIDE_WARPS",
    "evict_registers", "evict_warps", "key_span", "leaving_out", "left_out", "pow2", "ratio_parts", "split_size",
    "settings", "state_rows", "tuned",
]  # fmt: skip


def pow2(n: int, floor: int = 1) -> int:
    """The least power of two at least ``n`` and ``floor``."""
    return max(floor, 1 << max(int(n) - 1, 0).bit_length())


#: the kernels' runtime integers whose values follow the width of a layer's rows, marked ``do_not_specialize`` on
#: every kernel that takes them: the number of the first kernel's pieces (``S``), a dense store's block size (its
#: slots per row), and the row and head strides of the slots' metadata, 8-bit scales, per-head visibility and slot
#: weights. Triton's JIT specializes an integer argument on its value (equal to 1, a multiple of 16), so the layers
#: of one model, whose rows differ in width under per-layer budgets (CAKE, SLAKE, PyramidKV), compiled each kernel
#: once per combination these took: 10 and 8 compilations of SLAKE's two kernels over 32 layers' widths, now 7 and
#: 5 (what is left follows the powers of two the launch constants are rounded to; ``docs/gpu.md``), each seconds of
#: a GPU host's time before the first token. The usual rows (budget + 1 slots, not a multiple of 16) compile to the
#: same machine code as before. The row's width ``W`` is still specialized: it is the row stride of the logits'
#: scratch, whose loads the compiler can vectorize when it is a multiple of 16.
UNSPECIALIZED = ("S", "block_size", "m_sr", "m_sh", "s_sb", "s_sh", "s_sr", "hv_sr", "hv_sh", "hv_sg", "w_sr", "w_sh")

#: output channels of ``W_o`` per program of the projection kernel
PROJECTION_BLOCK = 64
#: the fewest slots one program of the first kernel reads (a power of two; a block of the slot loop, and the
#: smallest ``tl.dot`` operand a GPU takes is 16 wide)
MIN_SPLIT = 64
#: about how many programs the first kernel should run in all: enough to occupy a GPU's streaming multiprocessors
#: (an H100 has 132) when few rows and KV heads would leave most of them idle
TARGET_PROGRAMS = 256


#: the most slots the first kernel's search for the free slot reads at once (a power of two)
FREE_BLOCK = 2048
#: pieces the second kernel combines per group of loads in flight
COMBINE = 4
#: rows of at least this many slots (padded to a power of two) run the second kernel with more warps
WIDE_ROW = 1024
#: the second kernel's warps per program for those rows
WIDE_WARPS = 8
#: the most slots per row the second kernel holds in its vectors (a row's scores are one vector of a program, the
#: positional pooling sorts it in registers); the rows of a layer that evicts at decode wider than this (a budget of
#: 16K or more: a ratio of a long prompt) are read in blocks of :data:`WIDE_BLOCK` slots
#: (:mod:`slake.kernels.triton_wide`), with every rule
WIDE_SLOTS = 16384
#: slots per block of the second kernel's blockwise form, for rows wider than :data:`WIDE_SLOTS` (a power of two)
WIDE_BLOCK = 1024
#: slots per side of the tiles in which that form counts each slot's rank when the row's order must be made anew
RANK_TILE = 64
#: slots per block when the second kernel sums the victim's piece again (SLAKE): its float32 values tile is
#: ``RECOMPUTE_BLOCK x d``; at 64 x 128 it took 64 registers a thread at 4 warps, and the kernel spilled at the vLLM
#: pool's shape (8 rows, budget 128; ``tests/test_kernels_compile.py``). 32 until 2026-11-28: compiled with the
#: specialization Triton's JIT gives a launch (aligned pointers, strides of 1), SLAKE's kernel at batch 1 and budget
#: 1024 then took all 255 registers and spilled 8 bytes in bfloat16, 36 in float32; at 16, 192 and 202, no spill
RECOMPUTE_BLOCK = 16


#: parts of the second kernel that :func:`leaving_out` switches off, to time what each costs (``python -m benchmarks
#: kernel-parts``): the positional pooling's order by position (the held order's check, or the sort), SLAKE's fold
#: into the linear state, the re-summing of the victim's piece, the combination of the first kernel's pieces, and
#: the decode rule's attention signal. A step without one of them computes something else: for timing only.
SKIP_PARTS = {"sort": 1, "fold": 2, "recompute": 4, "combine": 8, "signal": 16}
_left_out = 0


@contextlib.contextmanager
def leaving_out(*parts: str) -> Iterator[None]:
    """Within the block, the fused steps launched (:func:`fused_step`) run their second kernel without ``parts``
    (names of :data:`SKIP_PARTS`), to time the rest; their results are not the step's. Restores the previous
    setting on exit."""
    global _left_out
    unknown = set(parts) - set(SKIP_PARTS)
    if unknown:
        raise ValueError(f"unknown kernel parts {sorted(unknown)}; known: {sorted(SKIP_PARTS)}")
    before = _left_out
    _left_out = before | sum(SKIP_PARTS[p] for p in set(parts))
    try:
        yield
    finally:
        _left_out = before


#: the launch constants :func:`tuned` may change (each is read when a step is launched)
TUNABLE = (
    "COMBINE", "RECOMPUTE_BLOCK", "WIDE_ROW", "WIDE_WARPS", "TARGET_PROGRAMS", "MIN_SPLIT", "SHORT_KEYS", "POOL_GATHER",
    "HELD_ORDER", "NEW_TOKEN_APART", "WIDE_SLOTS", "WIDE_BLOCK",
)  # fmt: skip


_SWITCHES = ("SHORT_KEYS", "POOL_GATHER", "HELD_ORDER", "NEW_TOKEN_APART")


@contextlib.contextmanager
def tuned(**values: int) -> Iterator[None]:
    """Within the block, the fused steps launched use other values of the launch constants named in
    :data:`TUNABLE` (``python -m benchmarks kernel-tune`` times the alternatives on a GPU); the step computes the
    same thing with any of them. Values are checked: ``COMBINE`` and ``TARGET_PROGRAMS`` positive, ``WIDE_WARPS``
    4, 8 or 16, the switches ``SHORT_KEYS``, ``POOL_GATHER``, ``HELD_ORDER`` and ``NEW_TOKEN_APART`` 0 or 1,
    ``WIDE_SLOTS`` any positive width, the others powers of two of at least 16 (a ``tl.dot`` operand's smallest
    width). Restores the previous values on exit."""
    unknown = set(values) - set(TUNABLE)
    if unknown:
        raise ValueError(f"unknown launch constants {sorted(unknown)}; tunable: {list(TUNABLE)}")
    for name, v in values.items():
        if name in _SWITCHES:
            if isinstance(v, bool) or v not in (0, 1):
                raise ValueError(f"{name} must be 0 or 1, got {v!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if name == "WIDE_WARPS" and v not in (4, 8, 16):
            raise ValueError(f"WIDE_WARPS must be 4, 8 or 16, got {v}")
        if name in ("RECOMPUTE_BLOCK", "WIDE_ROW", "MIN_SPLIT", "WIDE_BLOCK") and (v < 16 or v & (v - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    here = globals()
    before = {name: here[name] for name in values}
    here.update({k: bool(v) if k in _SWITCHES else v for k, v in values.items()})
    try:
        yield
    finally:
        here.update(before)


def evict_warps(padded_width: int) -> int:
    """Warps per program of the second kernel for rows padded to ``padded_width`` slots: :data:`WIDE_WARPS` (8) for
    wide rows, else 4.

    The second kernel runs one program per (row, KV head), which at batch 1 is 8 programs on a GPU of 132
    multiprocessors; a wide row's vectors (its slots' positions, scores and validity, its sort for the positional
    pooling) then hold 16 values per thread at 4 warps, which is what made the kernel spill registers at
    Llama-3-8B's shape and budget 1,024 (``tests/test_kernels_compile.py``). Twice the threads halve that and
    hide more of each program's memory latency."""
    return WIDE_WARPS if padded_width >= WIDE_ROW else 4


def evict_registers(padded_width: int) -> int | None:
    """The register limit per thread of the second kernel (``maxnreg``) for rows padded to ``padded_width`` slots:
    255 for the wide rows of :func:`evict_warps` (what a multiprocessor's 64K registers give each thread of one
    program, at 16 warps 128), else ptxas's choice (None; the interpreter ignores it). With the
    positional pooling's two sorts (:func:`slake.kernels.triton_pooling.position_order`) ptxas chose 128 registers
    at 8 warps and spilled 36 bytes at Llama-3-8B's shape; one program per (row, KV head) leaves the
    multiprocessors' registers idle anyway at the batches where rows are this wide."""
    warps = evict_warps(padded_width)
    return min(255, 65536 // (32 * warps)) if warps >= 8 else None


def _switched_on(variable: str) -> bool:
    """A switch's value from the environment: on unless ``variable`` is ``0``, ``false``, ``off`` or ``no``."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "off", "no")


#: whether the kernels are launched through :mod:`slake.kernels.launch_cache` on a GPU (Triton binds a launch's
#: arguments once per key, not at every launch: ``docs/gpu.md`` measures what that saves); off, every launch goes
#: through ``kernel[grid](...)``. No effect in the interpreter. The environment variable ``SLAKE_CACHED_LAUNCH=0``
#: turns it off for a whole run (read when this module is imported).
CACHED_LAUNCH = _switched_on("SLAKE_CACHED_LAUNCH")
#: whether eager decoding holds each layer's fused step with its launch arguments and scratch made once
#: (:class:`slake.kernels.held_step.HeldStep`: the arguments' part of the launch key worked out once, CUDA tensors
#: passed to Triton's launcher as their addresses, the scratch shared by the layers); off, every step makes them
#: afresh (:func:`slake.kernels.triton_decode.fused_step`). ``SLAKE_HELD_STEP=0`` in the environment turns it off for
#: a whole run (read when this module is imported)
HELD_STEP = _switched_on("SLAKE_HELD_STEP")

#: whether the positional pooling sorts int32 keys where the positions allow (:func:`key_span`); off in tests, to
#: run the int64 sort on small positions, and in ``kernel-tune``'s variant that times what the short keys gain
SHORT_KEYS = True
#: whether the positional pooling ranks and shifts the scores in registers (``tl.gather``); off only to time the
#: pooling of before, through the row's scratch buffer in memory (``kernel-tune``)
POOL_GATHER = True
#: whether the positional pooling starts from the order of the row's slots that its previous step left, when that
#: proves to hold, instead of sorting the row again (:func:`slake.kernels.triton_pooling.held_lanes`; the engines keep
#: the order in an int32 tensor beside the slots' positions); off to time the sort (``kernel-tune``), or for a whole
#: run with ``SLAKE_HELD_ORDER=0`` in the environment (read when this module is imported)
HELD_ORDER = _switched_on("SLAKE_HELD_ORDER")
#: whether the second kernel's eviction holds the row's kept slots in vectors of ``pow2(W - 1)`` with the new token
#: apart, for every rule but CriticalKV's two stages (:func:`slake.kernels.triton_pooling.pooled_eviction`,
#: :func:`slake.kernels.triton_eviction.rule_eviction`: a row of budget + 1 slots is not padded to twice its width);
#: off, the row's slots padded to ``pow2(W)``, the new token among them, and the positional pooling put back in slot
#: order through the row's scratch buffer, as CriticalKV's two stages are, and sorted at every step
#: (``kernel-tune``'s variant, or ``SLAKE_NEW_TOKEN_APART=0`` in the environment for a whole run, read when this
#: module is imported)
NEW_TOKEN_APART = _switched_on("SLAKE_NEW_TOKEN_APART")


def key_span(padded_width: int) -> int:
    """The span of valid positions under which the positional pooling sorts int32 keys (the position less the
    row's lowest, times ``padded_width``, plus the slot: below ``2**31``), or 0 (never) when :data:`SHORT_KEYS`
    is off."""
    return (1 << 31) // int(padded_width) - 2 if SHORT_KEYS else 0


def state_rows(d: int, pieces: int) -> int:
    """Rows of the PTAA linear state's ``d x d`` block that each of a row's ``pieces`` first-kernel programs reads
    for the linear term: an even share, a power of two of at least 16 (the smallest ``tl.dot`` operand), so that
    the programs together cover every row once (the last ones may have none)."""
    return pow2(-(-int(d) // max(int(pieces), 1)), 16)


def ratio_parts(ratio: float) -> list[float]:
    """``ratio`` as three float32 values whose float64 sum is exactly ``ratio`` (a kernel's float arguments are
    float32; the two-stage rule computes ``floor(n * ratio)`` in float64, as the torch rule does)."""
    parts = []
    rest = float(ratio)
    for _ in range(3):
        parts.append(struct.unpack("f", struct.pack("f", rest))[0])  # rounded to float32
        rest -= parts[-1]
    if rest != 0.0 or (parts[0] + parts[1]) + parts[2] != float(ratio):
        raise ValueError(f"cannot split the ratio {ratio!r} into three float32 parts")
    return parts


def split_size(width: int, programs: int) -> int:
    """Slots per program of the first kernel for rows of ``width`` slots and ``programs`` (rows x KV heads): rows
    are split over several programs (flash-decoding) until about :data:`TARGET_PROGRAMS` run, never into pieces of
    fewer than :data:`MIN_SPLIT` slots. A power of two."""
    wanted = -(-TARGET_PROGRAMS // max(int(programs), 1))  # splits per row and KV head
    return pow2(-(-int(width) // wanted), MIN_SPLIT)


def settings() -> tuple:
    """Every launch constant and switch the fused step's launches read besides :func:`split_size`'s (which is
    called at every step), as one tuple: what a reused launch plan must match (``step_plan.launch_plan``), so that a
    change made here, by :func:`tuned` or :func:`leaving_out`, or by assigning a constant takes effect at the next
    step."""
    return (
        FREE_BLOCK, COMBINE, RECOMPUTE_BLOCK, WIDE_ROW, WIDE_WARPS, PROJECTION_BLOCK, SHORT_KEYS, POOL_GATHER,
        HELD_ORDER, NEW_TOKEN_APART, WIDE_SLOTS, WIDE_BLOCK, RANK_TILE, _left_out,
    )  # fmt: skip


def left_out() -> int:
    """The parts of the second kernel :func:`leaving_out` switches off now (a mask of :data:`SKIP_PARTS`; 0 in every
    real step)."""
    return _left_out
