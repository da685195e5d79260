"""The positional pooling of SnapKV's, CAKE's and SLAKE's decode rule inside the fused decode kernels' second kernel
(:mod:`slake.kernels.triton_decode`): a row's slots ranked by position, each slot's score pooled over its
neighbours in that order, and the victim among them.

Two forms:

* **The new token apart** (:func:`pooled_eviction`, the form every real step of these rules takes): a row of ``W``
  slots holds, during a step, the ``W - 1`` slots it kept and the new token. The program's vectors hold the kept
  ones only (``lanes``, ``pow2(W - 1)`` wide) and the new token is a scalar beside them. A row's width is its budget
  plus one (the slot the next token is written into), so at the budgets people choose (128, 1,024: powers of two)
  the row's vectors are half as wide as the row padded to a power of two would be (1,025 slots pad to 2,048), and
  the program runs about half the instructions (``docs/gpu.md``). The new token's slot is not a lane: the lane of
  that number holds the row's last slot, ``W - 1`` (``lane_slots``), so lanes ``0 .. W - 2`` cover every other slot.
* **Slot order** (:func:`position_order`, :func:`pool_by_position`): the row padded to ``pow2(W)`` with the new token
  among its slots, for CriticalKV's two stages, which need the pooled scores back in slot order, and for the pooling
  of before (through memory, ``launch_config.POOL_GATHER`` off), kept to time.

Both compute what the torch rule computes (:mod:`slake.methods.snapkv`'s pooling over ``avg_pool1d``/``max_pool1d``
of the scores in position order, ``argmin`` over the slots): the interpreter tests hold them to the torch step."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels.triton_eviction import lane_argmin
from slake.kernels.triton_rules import lane_signal
from slake.kernels.triton_slots import lane_guard, row_lanes, settle_row

__all__ = [
    "held_lanes",
    "lane_victim",
    "listed_lanes",
    "pool_by_position",
    "pool_lanes",
    "pooled_eviction",
    "position_order",
]


@triton.jit
def position_order(pos, valid, wmask, ids, M: tl.constexpr, KEY_SPAN: tl.constexpr):
    """The entries of a row's vectors in position order, as the ids they carry (``ids``, each below ``M``, a power
    of two): ``order[i]`` is the id of rank ``i``; the valid entries come first, by position and then by id, then
    the invalid ones and those outside ``wmask``, by id (a permutation of ``ids``).

    One sort of keys that carry the id in their low bits. The keys are int32 when the valid positions span fewer
    than ``KEY_SPAN`` (:func:`slake.kernels.launch_config.key_span` of ``M``: ``2**31 / M - 2``, a million tokens
    at ``M`` = 2,048; the key is the position less the lowest valid one), int64 otherwise: a 64-bit sort is emulated
    with twice the registers and shuffles of a 32-bit one (at Llama-3-8B's shape and 1,025 slots, 1,050 shuffles
    against 570, ``tests/kernel_aot.py``)."""
    lo = tl.min(tl.where(valid, pos, 1 << 60), 0)
    hi = tl.max(tl.where(valid, pos, -(1 << 60)), 0)
    if hi - lo < KEY_SPAN:
        rel = tl.where(valid, pos - lo, KEY_SPAN).to(tl.int32)
        order = tl.sort(tl.where(wmask, rel, KEY_SPAN + 1) * M + ids, 0) % M
    else:
        key = tl.where(valid, pos, 1 << 40)
        order = (tl.sort(tl.where(wmask, key, (1 << 40) + 1) * M + ids, 0) % M).to(tl.int32)
    return order


@triton.jit
def pool_by_position(scores, valid, order, count, base, W, sw, wmask, BW: tl.constexpr, POOL_K: tl.constexpr,
                     POOL_MAX: tl.constexpr, IN_REGISTERS: tl.constexpr):  # fmt: skip
    """SnapKV's pooling of ``scores`` (slot order, the new token among the slots; 0 where a slot is empty) over each
    slot's ``POOL_K`` neighbours in position order (``order``, :func:`position_order` of the slots), average or
    maximum, with the row's ends padded as ``avg_pool1d``/``max_pool1d`` pad them (a neighbour past an end adds 0
    to the average, nothing to the maximum).

    ``IN_REGISTERS``: the ranking and the shifts are gathers within the program (``tl.gather``), and the pooled
    scores come back in rank order (entry ``i`` belongs to slot ``order[i]``). Only the first ``count`` ranks (the
    valid slots) are read from ``order``; the ranks after them are empty slots, whose score is 0 whichever they are.
    Otherwise (the pooling of before, kept to time one against the other: ``launch_config.POOL_GATHER``) they go
    through the row's scratch buffer in global memory (``base``, ``2 * BW`` floats), three store-barrier-load round
    trips, and come back in slot order."""
    if IN_REGISTERS:
        ranked = tl.where(sw < count, tl.gather(tl.where(valid, scores, 0.0), order, 0), 0.0)
    else:
        tl.store(base + sw, tl.where(valid, scores, 0.0))
        tl.debug_barrier()
        ranked = tl.load(base + order, mask=order < W, other=0.0)
        tl.debug_barrier()  # the buffer's halves are apart, but a check by argument cannot tell (kernel_hazards.py)
        tl.store(base + BW + sw, ranked)
        tl.debug_barrier()
    pad = float("-inf") if POOL_MAX else 0.0
    pooled = tl.full([BW], pad, tl.float32)
    for t in tl.static_range(POOL_K):
        j = sw + (t - POOL_K // 2)
        inside = (j >= 0) & (j < W)
        if IN_REGISTERS:
            got = tl.where(inside, tl.gather(ranked, tl.minimum(tl.maximum(j, 0), BW - 1), 0), pad)
        else:
            got = tl.load(base + BW + j, mask=inside, other=pad)
        pooled = tl.maximum(pooled, got) if POOL_MAX else pooled + got
    if not POOL_MAX:
        pooled = pooled / POOL_K
    if not IN_REGISTERS:
        tl.debug_barrier()
        tl.store(base + order, pooled, mask=order < W)
        tl.debug_barrier()
        pooled = tl.load(base + sw, mask=wmask, other=0.0)
    return pooled


@triton.jit
def listed_lanes(order_ptr, meta, m_ss, pos, valid, sw, newslot, newest, held, L, BW: tl.constexpr):
    """Whether the order the kernel left at ``order_ptr`` after the row's previous step still holds, and the order
    it gives: ``(holds, order)``, ``order`` the lanes of the row's ``held`` kept slots by position in its first
    ``held`` ranks (0 after them), as :func:`position_order` ranks them when ``holds``.

    A row's order changes little from one step to the next: the new token (``newslot``, at position ``newest``)
    comes last, and the step's victim leaves. The buffer lists slots; it is trusted only when it proves itself: its
    first ``held`` entries are slots of valid lanes (not the new token's, none past the row's last slot ``L``) in
    strictly increasing positions, all below ``newest``. Those are then ``held`` distinct valid lanes, which is all
    of them, in the one order a sort by position gives; so any content (a new row's, a step of the torch path's,
    another request's in the vLLM pool) is safe. The check is three gathers and two reductions over the lanes."""
    listed = sw < held
    buf = tl.load(order_ptr + meta + sw * m_ss, mask=listed, other=0)
    fits = (buf >= 0) & (buf <= L) & (buf != newslot)
    lane = tl.where(buf == L, newslot, buf)  # the row's last slot is in the new token's lane
    lane = tl.minimum(tl.maximum(lane, 0), BW - 1)
    bpos = tl.gather(pos, lane, 0)
    bvalid = tl.gather(valid.to(tl.int32), lane, 0)
    after = tl.gather(bpos, tl.minimum(sw + 1, BW - 1), 0)
    each = (~listed) | (fits & (bvalid != 0) & ((sw >= held - 1) | (bpos < after)))
    last = tl.max(tl.where(listed, bpos, -1), 0)
    holds = (tl.min(each.to(tl.int32), 0) == 1) & (last < newest)
    return holds, tl.where(listed, lane, 0)


@triton.jit
def _sorted_lanes(pos, valid, lmask, lslot, newslot, newest, L, BW: tl.constexpr, KEY_SPAN: tl.constexpr):
    """The lanes by position (:func:`position_order` of the lanes, ties by slot) and the new token's rank among the
    row's valid slots: ``(order, rank)``."""
    slots = position_order(pos, valid, lmask, lslot, 2 * BW, KEY_SPAN)  # slots below W <= 2 BW
    order = tl.where(slots == L, newslot, slots)  # slot -> lane
    before = valid & ((pos < newest) | ((pos == newest) & (lslot < newslot)))
    return order, tl.sum(before.to(tl.int32), 0)


@triton.jit
def held_lanes(order_ptr, meta, m_ss, pos, valid, lmask, lslot, sw, newslot, newest, held, L, BW: tl.constexpr,
               KEY_SPAN: tl.constexpr, HELD: tl.constexpr):  # fmt: skip
    """The lanes of the row's kept slots in position order (their first ``held`` ranks) and the new token's rank
    among all the row's valid slots: ``(order, rank)``. With ``HELD``, the order the row's previous step left when it
    holds (:func:`listed_lanes`; the new token then ranks last), else a sort of the lanes, a bitonic network of
    ``log2(BW) (log2(BW) + 1) / 2`` stages."""
    if HELD:
        holds, listed = listed_lanes(order_ptr, meta, m_ss, pos, valid, sw, newslot, newest, held, L, BW)
        if holds:
            order = listed
            rank = held
        else:
            order, rank = _sorted_lanes(pos, valid, lmask, lslot, newslot, newest, L, BW, KEY_SPAN)
    else:
        order, rank = _sorted_lanes(pos, valid, lmask, lslot, newslot, newest, L, BW, KEY_SPAN)
    return order, rank


@triton.jit
def pool_lanes(scores, new_score, valid, order, held, rank, W, L, sw, BW: tl.constexpr, POOL_K: tl.constexpr,
               POOL_MAX: tl.constexpr):  # fmt: skip
    """SnapKV's pooling (:func:`pool_by_position`) with the new token apart: ``(pooled, new_pooled)``, ``pooled`` in
    the lanes' rank order (entry ``i`` belongs to lane ``order[i]``; the first ``held`` are the kept slots, the next
    ones the row's empty slots after the new token, in the rank order of the whole row), ``new_pooled`` the new
    token's.

    The row's ranks are the lanes' with the new token inserted at ``rank``: lane rank ``i`` is the row's rank ``i``
    before it, ``i + 1`` after it."""
    ranked = tl.where(sw < held, tl.gather(tl.where(valid, scores, 0.0), order, 0), 0.0)
    pad = float("-inf") if POOL_MAX else 0.0
    at = sw + (sw >= rank).to(tl.int32)  # each lane rank's rank in the row
    pooled = tl.full([BW], pad, tl.float32)
    for t in tl.static_range(POOL_K):
        j = at + (t - POOL_K // 2)
        src = j - (j > rank).to(tl.int32)
        got = tl.where(j == rank, new_score, tl.gather(ranked, tl.minimum(tl.maximum(src, 0), BW - 1), 0))
        got = tl.where((j >= 0) & (j < W), got, pad)
        pooled = tl.maximum(pooled, got) if POOL_MAX else pooled + got
    # the new token's neighbours: the row's ranks rank - K // 2 .. rank - K // 2 + K - 1 but its own, lane ranks
    # rank - K // 2 .. rank - K // 2 + K - 2, inside the row (a lane rank i >= rank is row rank i + 1 < W)
    near = (sw >= rank - POOL_K // 2) & (sw <= rank - POOL_K // 2 + POOL_K - 2) & (sw < L)
    if POOL_MAX:
        new_pooled = tl.maximum(new_score, tl.max(tl.where(near, ranked, float("-inf")), 0))
    else:
        pooled = pooled / POOL_K
        new_pooled = (new_score + tl.sum(tl.where(near, ranked, 0.0), 0)) / POOL_K
    return pooled, new_pooled


@triton.jit
def lane_victim(pooled, new_pooled, guard, new_guarded, order, oslot, held, newslot, W, sw):
    """The slot ``argmin`` would pick from the row's pooled scores in slot order (the first lowest, guarded slots at
    ``+inf``): among the lanes' ranks (``pooled``; the first ``held`` are kept slots, ``guard`` in lane order,
    ``oslot`` each rank's slot) and the new token (``new_pooled``, ``new_guarded``), the lowest score, ties to the
    lowest slot, so that they go where the torch step's ``argmin`` sends them, not to the oldest position. When
    every slot is guarded, slot 0, as ``argmin`` over a row of ``+inf``."""
    held_open = (sw < held) & (tl.gather(guard.to(tl.int32), order, 0) == 0)
    return lane_argmin(pooled, new_pooled, ~held_open, new_guarded, oslot, newslot, W)


@triton.jit
def pooled_eviction(pos_ptr, valid_ptr, score_ptr, order_ptr, meta, m_ss, x_ptr, stat_ptr, r, h, H, W, S,
                    newslot, newest, window, first, sinks, target,
                    G: tl.constexpr, SP: tl.constexpr, BW: tl.constexpr, GROUP_MAX: tl.constexpr,
                    POOL_K: tl.constexpr, POOL_MAX: tl.constexpr, ZERO_WINDOW: tl.constexpr,
                    PROTECT_WINDOW: tl.constexpr, KEY_SPAN: tl.constexpr, HELD: tl.constexpr,
                    SKIP: tl.constexpr):  # fmt: skip
    """The decode eviction of a row and KV head under SnapKV's, CAKE's and SLAKE's rule, with the new token apart
    (the module's docstring): the pooled scores, the victim, and the row's bookkeeping written back (its slots'
    scores, the victim's and the new token's validity and position, and with ``HELD`` the order for its next
    step). Returns ``(victim, chosen)``: the victim's slot, and whether it is evicted (the row holds more than its
    ``target`` and the victim is a valid slot).

    ``BW`` is ``pow2(W - 1)``: lane ``i`` holds slot ``i``, but lane ``newslot`` holds slot ``W - 1`` (when the new
    token's slot is not the last)."""
    L = W - 1  # the lanes in use: every slot but the new token's
    sw, lmask, lslot, pos, valid = row_lanes(pos_ptr, valid_ptr, meta, m_ss, W, newslot, BW)
    held = tl.sum(valid.to(tl.int32), 0)  # the row's slots but the new token's
    count = held + 1
    # 1. the rule's attention signal of every slot; CAKE's window adds 0 to its neighbours' pooling
    if SKIP & 16:  # timing only (SKIP_PARTS): the stored scores instead of this step's attention
        scores = tl.where(valid, tl.load(score_ptr + meta + lslot * m_ss, mask=lmask, other=0.0), 0.0)
        new_score = tl.load(score_ptr + meta + newslot * m_ss)
        tl.debug_barrier()  # read by every thread before step 4 writes them
    else:
        scores, new_score = lane_signal(x_ptr, stat_ptr, r, h, H, W, S, lslot, lmask, newslot, 1.0, G, SP, BW, 0,
                                        GROUP_MAX)  # fmt: skip
    if ZERO_WINDOW:
        scores = tl.where((pos > newest - window) | (~valid), 0.0, scores)
        new_score = tl.where(window > 0, 0.0, new_score)
    # 2. the lanes by position, the new token's rank among them, the pooling
    if SKIP & 1:  # timing only (SKIP_PARTS): the lanes' own order
        order = sw
        rank = held
    else:
        order, rank = held_lanes(order_ptr, meta, m_ss, pos, valid, lmask, lslot, sw, newslot, newest, held, L, BW,
                                 KEY_SPAN, HELD)  # fmt: skip
    pooled, new_pooled = pool_lanes(scores, new_score, valid, order, held, rank, W, L, sw, BW, POOL_K, POOL_MAX)
    # 3. the victim: the lowest-scored slot that is neither protected (window, sinks) nor empty
    guard, new_guarded = lane_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW)
    oslot = tl.gather(lslot, order, 0)  # each lane rank's slot
    victim = lane_victim(pooled, new_pooled, guard, new_guarded, order, oslot, held, newslot, W, sw)
    victim_valid = (victim == newslot) | (tl.sum(((lslot == victim) & valid).to(tl.int32), 0) > 0)
    chosen = (count > target) & (target >= 0) & victim_valid
    # 4. the scores back in their slots: the kept ones by their ranks, the new token's, then the empty ones, which
    # rank after every valid slot in slot order (as a sort of the row ranks them): row rank count + e - 1 for the
    # e-th, lane rank count + e - 2
    ranked_valid = sw < held
    tl.store(score_ptr + meta + oslot * m_ss, tl.where((oslot == victim) & chosen, float("-inf"), pooled),
             mask=ranked_valid)  # fmt: skip
    new_gone = chosen & (victim == newslot)
    tl.store(score_ptr + meta + newslot * m_ss, tl.where(new_gone, float("-inf"), new_pooled))
    if count < W:  # a row full to its width (every row of a uniform layer at batch 1) has none
        empty = lmask & (~valid)
        e = tl.cumsum((empty & (sw != newslot)).to(tl.int32), 0)
        e = tl.where(sw == newslot, tl.sum(empty.to(tl.int32), 0), e)  # the row's last slot: the last empty one
        src = tl.minimum(tl.maximum(count + e - 2, 0), BW - 1)
        tl.store(score_ptr + meta + lslot * m_ss, tl.gather(pooled, src, 0), mask=empty)
    settle_row(pos_ptr, valid_ptr, meta, m_ss, newslot, newest, victim, chosen)
    if HELD:  # the order for the row's next step: the row's, without the victim (a row that keeps all W slots has
        # no free slot for a next step: its W-th entry is not written)
        vlane = tl.min(tl.where((oslot == victim) & ranked_valid, sw, BW), 0)
        vrank = tl.where(victim == newslot, rank, vlane + (vlane >= rank).to(tl.int32))
        vrank = tl.where(chosen, vrank, W + 1)
        at = sw + (sw >= vrank).to(tl.int32)  # the row rank of each entry of the next order
        src = tl.minimum(tl.maximum(at - (at > rank).to(tl.int32), 0), BW - 1)
        listed = tl.where(at == rank, newslot, tl.gather(oslot, src, 0))
        tl.store(order_ptr + meta + sw * m_ss, listed, mask=sw < count - chosen.to(tl.int32))
    return victim, chosen
