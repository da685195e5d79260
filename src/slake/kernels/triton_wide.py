"""The decode eviction of rows too wide for the second kernel's vectors (``launch_config.WIDE_SLOTS``), inside the
fused decode kernels' second kernel (:mod:`slake.kernels.triton_decode`): the same rules, scores, victim and
bookkeeping as :mod:`slake.kernels.triton_eviction` and :mod:`slake.kernels.triton_pooling`, computed over the row
in blocks of ``WB`` slots instead of in one vector per row.

The other forms hold a row's slots in a program's vectors, ``pow2(W - 1)`` lanes of positions, validity and scores
(and the positional pooling's sort of them): up to 16,384 slots, a budget of 16K. A wider row (a budget given as a
ratio, half of a 64K prompt) took the torch step, 40 to 100 kernels per layer on a GPU. Here the row is read in
blocks: its valid count, then each slot's score and the running ``argmin`` (the first lowest, ties to the lowest
slot, as ``argmin`` over the slots), then the victim's bookkeeping as scalars.

SnapKV's, CAKE's and SLAKE's positional pooling needs the slots ranked by position. The row's order buffer (the
engines keep it for these rules, :func:`slake.cache.fused_step.keeps_order`) lists them, and is read in one of three
ways: the order the row's previous step left, when it proves to hold (its entries are valid slots in strictly
increasing positions, the new token's after them, as :func:`slake.kernels.triton_pooling.listed_lanes` checks it);
else the valid slots in slot order, when that is position order (a row just prefilled: the prefill packs its kept
slots in position order); else each slot's rank counted against every other (``W^2 / RB^2`` tiles: a row the other
forms would have sorted, which neither engine leaves). The signal of each rank then goes through the row's scratch
buffer (``2 pow2(W)`` floats), is pooled from there, and the next step's order is the row's without the victim.

Every rule of :class:`slake.methods.decode_rule.FusedDecodeRule`. CriticalKV's two stages take the rule's scores as
their base (:func:`wide_two_stage`): the first stage's threshold, which the other forms find by sorting the row, is
found by a radix select over the scores' bits, 8 passes of a 16-bin count, then one pass writes the two stages'
scores and finds the victim."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels.triton_rules import first_stage_count, key_cosines, new_slot_weight, rule_score, sharpening_gain
from slake.kernels.triton_slots import settle_row, slot_guard

__all__ = ["wide_eviction", "wide_two_stage"]


@triton.jit
def _head_stats(stat_ptr, r, hh, H, S, gc, gcmask, G: tl.constexpr, SP: tl.constexpr):
    """Each query head of KV head ``hh`` (``gc``, ``(GC,)``): its softmax maximum and normaliser over the whole row,
    combined from the first kernel's pieces (:func:`slake.kernels.triton_rules.row_stats`, for every head at once)."""
    sidx = tl.arange(0, SP)
    ok = gcmask[:, None] & (sidx < S)[None, :]
    sb = (((r * H + hh) * G + gc[:, None]) * S + sidx[None, :]) * 2
    ms = tl.load(stat_ptr + sb, mask=ok, other=-3.4028234663852886e38)
    ls = tl.load(stat_ptr + sb + 1, mask=ok, other=0.0)
    m = tl.max(ms, 1)
    return m, tl.sum(ls * tl.exp(ms - m[:, None]), 1)


@triton.jit
def _sharpened_totals(x_ptr, r, hh, H, W, m, c, gc, gcmask, G: tl.constexpr, GC: tl.constexpr, WB: tl.constexpr):
    """AhaKV's normaliser of ``softmax(c * logits)`` for each query head of KV head ``hh``: the sum over the row of
    ``exp(c (x - m))``, ``WB`` slots at a time."""
    tot = tl.zeros([GC], tl.float32)
    xbase = (r * H + hh).to(tl.int64) * G * W
    for s0 in range(0, W, WB):
        s = s0 + tl.arange(0, WB)
        x = tl.load(x_ptr + xbase + gc[:, None] * W + s[None, :], mask=gcmask[:, None] & (s < W)[None, :],
                    other=float("-inf"))  # fmt: skip
        tot += tl.sum(tl.exp(c * (x - m[:, None])), 1)
    return tot


@triton.jit
def _block_signal(x_ptr, r, hh, H, W, s, ok, m, lsum, tot, c, gc, gcmask, G: tl.constexpr, RULE: tl.constexpr,
                  GROUP_MAX: tl.constexpr):  # fmt: skip
    """The attention KV head ``hh``'s query heads give the slots ``s`` (``(WB,)``, where ``ok``) this step, reduced
    over them (mean, or max with ``GROUP_MAX``; :func:`slake.kernels.triton_rules.head_signal` for a block), from
    their maxima ``m``, normalisers ``lsum`` and, for AhaKV's sharpened rule (``RULE`` 2), ``tot``."""
    xbase = (r * H + hh).to(tl.int64) * G * W
    x = tl.load(x_ptr + xbase + gc[:, None] * W + s[None, :], mask=gcmask[:, None] & ok[None, :], other=float("-inf"))
    if RULE == 2:
        p = tl.where(tot[:, None] > 0, tl.exp(c * (x - m[:, None])) / tot[:, None], 0.0)
    else:
        p = tl.where(lsum[:, None] > 0, tl.exp(x - m[:, None]) / lsum[:, None], 0.0)
    if GROUP_MAX:
        return tl.where(ok, tl.max(tl.where(gcmask[:, None], p, float("-inf")), 0), 0.0)
    return tl.sum(p, 0) / G


@triton.jit
def _order_holds(order_ptr, pos_ptr, valid_ptr, meta, m_ss, W, held, newslot, newest, WB: tl.constexpr):
    """Whether the order buffer's first ``held`` entries are the row's ``held`` valid slots but the new token's, in
    strictly increasing positions below ``newest`` (then they are all of them, in the one order a sort by position
    gives), ``WB`` entries at a time."""
    bad = tl.sum(tl.zeros([WB], tl.int32), 0)
    for i0 in range(0, held, WB):
        i = i0 + tl.arange(0, WB)
        listed = i < held
        buf = tl.load(order_ptr + meta + i * m_ss, mask=listed, other=0)
        fits = (buf >= 0) & (buf < W) & (buf != newslot)
        slot = tl.minimum(tl.maximum(buf, 0), W - 1)
        bpos = tl.load(pos_ptr + meta + slot * m_ss, mask=listed, other=0)
        bvalid = tl.load(valid_ptr + meta + slot * m_ss, mask=listed, other=0) != 0
        nxt = tl.load(order_ptr + meta + (i + 1) * m_ss, mask=i + 1 < held, other=0)
        npos = tl.load(pos_ptr + meta + tl.minimum(tl.maximum(nxt, 0), W - 1) * m_ss, mask=i + 1 < held, other=0)
        after = tl.where(i + 1 < held, npos, newest)  # the last entry ranks below the new token
        each = (~listed) | (fits & bvalid & (bpos < after))
        bad += tl.sum((~each).to(tl.int32), 0)
    return bad == 0


@triton.jit
def _drop_evicted(order_ptr, valid_ptr, meta, m_ss, W, held, newslot, H, WB: tl.constexpr):
    """The order buffer without the slots evicted since it was written, for an eviction across a layer's KV heads
    (:mod:`slake.kernels.triton_layer`), whose third kernel evicts up to ``H`` of a head's slots after this kernel
    wrote the order: the buffer's entries that are valid slots (not the new token's: it may sit in a slot just freed)
    moved to its front in order, until ``held`` are (past them, the buffer holds older steps' entries). The buffer's
    first ``held + H`` entries are read, one block at a time, each read before any of it is written over (entries
    only move to lower indices). Whether the result is the row's order is for :func:`_order_holds` to say."""
    kept = tl.sum(tl.zeros([WB], tl.int32), 0)
    for i0 in range(0, tl.minimum(held + H, W), WB):
        i = i0 + tl.arange(0, WB)
        listed = i < tl.minimum(held + H, W)
        buf = tl.load(order_ptr + meta + i * m_ss, mask=listed, other=-1)
        slot = tl.minimum(tl.maximum(buf, 0), W - 1)
        ok = listed & (buf >= 0) & (buf < W) & (buf != newslot)
        ok = ok & (tl.load(valid_ptr + meta + slot * m_ss, mask=ok, other=0) != 0)
        k = ok.to(tl.int32)
        at = kept + tl.cumsum(k, 0) - k
        ok = ok & (at < held)
        tl.debug_barrier()  # the block read by every thread before any of it is written over
        tl.store(order_ptr + meta + at * m_ss, buf, mask=ok)
        kept += tl.sum(ok.to(tl.int32), 0)
        # written before the next block, or the order after the loop, is read: the next block lies past what this
        # one wrote, but a check by argument cannot tell (tests/kernel_hazards.py); a barrier a block costs nothing
        tl.debug_barrier()


@triton.jit
def _list_slot_order(order_ptr, valid_ptr, meta, m_ss, W, newslot, WB: tl.constexpr):
    """The row's valid slots but the new token's, in slot order, written to the front of the order buffer (what the
    prefill leaves is in position order)."""
    carry = tl.sum(tl.zeros([WB], tl.int32), 0)
    for s0 in range(0, W, WB):
        s = s0 + tl.arange(0, WB)
        keep = (s < W) & (tl.load(valid_ptr + meta + s * m_ss, mask=s < W, other=0) != 0) & (s != newslot)
        k = keep.to(tl.int32)
        at = carry + tl.cumsum(k, 0) - k
        tl.store(order_ptr + meta + at * m_ss, s, mask=keep)
        carry += tl.sum(k, 0)
    tl.debug_barrier()


@triton.jit
def _count_ranks(order_ptr, pos_ptr, valid_ptr, meta, m_ss, W, newslot, RB: tl.constexpr):
    """Every valid slot's rank by position (ties by slot), the new token's among them, counted against every other
    slot in ``RB x RB`` tiles, and the slots written to the order buffer at their ranks."""
    for a0 in range(0, W, RB):
        a = a0 + tl.arange(0, RB)
        oka = a < W
        pa = tl.load(pos_ptr + meta + a * m_ss, mask=oka, other=0)
        va = ((tl.load(valid_ptr + meta + a * m_ss, mask=oka, other=0) != 0) | (a == newslot)) & oka
        rank = tl.zeros([RB], tl.int32)
        for t0 in range(0, W, RB):
            t = t0 + tl.arange(0, RB)
            okt = t < W
            pt = tl.load(pos_ptr + meta + t * m_ss, mask=okt, other=0)
            vt = ((tl.load(valid_ptr + meta + t * m_ss, mask=okt, other=0) != 0) | (t == newslot)) & okt
            first = (pt[None, :] < pa[:, None]) | ((pt[None, :] == pa[:, None]) & (t[None, :] < a[:, None]))
            rank += tl.sum((vt[None, :] & first).to(tl.int32), 1)
        tl.store(order_ptr + meta + rank * m_ss, a, mask=va)
    tl.debug_barrier()


@triton.jit
def _pooled_at(base, j0, count, W, POOL_K: tl.constexpr, POOL_MAX: tl.constexpr):
    """The positional pooling at ranks ``j0`` (a block) of the ranked signals at ``base`` (the first ``count``;
    the empty slots' ranks after them are 0), average or maximum over ``POOL_K`` neighbours, a neighbour past the
    row's ends adding 0 to the average and nothing to the maximum (``avg_pool1d``/``max_pool1d``)."""
    pad = float("-inf") if POOL_MAX else 0.0
    pooled = tl.full(j0.shape, pad, tl.float32)
    for t in tl.static_range(POOL_K):
        j = j0 + (t - POOL_K // 2)
        got = tl.load(base + j, mask=(j >= 0) & (j < count), other=0.0)
        got = tl.where((j >= 0) & (j < W), got, pad)
        pooled = tl.maximum(pooled, got) if POOL_MAX else pooled + got
    if not POOL_MAX:
        pooled = pooled / POOL_K
    return pooled


@triton.jit
def _running_argmin(open_score, s, W, best, vslot):
    """The running ``argmin`` over a row read in slot order, one block at a time: the block's ``open_score`` (guarded
    slots at ``+inf``) of slots ``s`` against the lowest so far (``best`` at ``vslot``); ties stay with the earlier,
    lower slot, as ``argmin`` takes the first minimum. Returns ``(best, vslot)``."""
    low = tl.min(open_score, 0)
    at = tl.min(tl.where(open_score == low, s, W), 0)
    return tl.minimum(best, low), tl.where(low < best, at, vslot)


@triton.jit
def _order_key(x):
    """A float32's bits as a uint32 whose unsigned order is the floats' order (``-0.0`` taken as ``+0.0``, which
    compares equal to it): positive floats with the sign bit set, negative ones with every bit flipped."""
    u = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where(u >= 0x80000000, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _stage_key(base, pos, held, newest, window, first, sinks, PROTECT_WINDOW: tl.constexpr):
    """The first stage's order key of slots with base scores ``base``: :func:`_order_key`, and the largest key for a
    held protected slot (window, sinks), which takes its first-stage place before every other slot."""
    protected = held & slot_guard(pos, held, newest, window, first, sinks, PROTECT_WINDOW)
    key = _order_key(base)
    return tl.where(protected, key | 0xFFFFFFFF, key)


@triton.jit
def wide_two_stage(pos_ptr, valid_ptr, score_ptr, meta, m_ss, wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, r, h, mr, H, W,
                   count, newslot, newest, window, first, sinks, eps, ratio_hi, ratio_mid, ratio_lo,
                   G: tl.constexpr, GP: tl.constexpr, NBP: tl.constexpr, PROTECT_WINDOW: tl.constexpr,
                   WB: tl.constexpr):  # fmt: skip
    """CriticalKV's two stages (:func:`slake.kernels.triton_rules.two_stage`) over a row read in blocks of ``WB``
    slots, from the base scores the rule's pass wrote to the row's scores (every slot's, the empty ones' too):
    of the ``floor(count * ratio)`` first-stage places, the held protected slots (window, sinks) take theirs and the
    best others by base score (ties to the lower slot) the rest; those others score 1e30, every other slot
    ``(base + eps) * w``; written back, and the running ``argmin`` of the unprotected ones returned as
    ``(lowest, slot)``.

    The first stage's threshold, the ``k``-th largest held base score, is found without sorting the row: a radix
    select over the scores' order-preserving bits (:func:`_order_key`), 4 bits a pass from the top, each pass a
    16-bin count of the held slots whose higher bits match the threshold's so far (8 passes over the row). What is
    left of ``k`` at the end is how many of the slots equal to the threshold are chosen, the first ones in slot
    order."""
    w_new = new_slot_weight(wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, r, h, mr, H, newslot, G, GP, NBP)
    k = first_stage_count(count, ratio_hi, ratio_mid, ratio_lo)
    bins = tl.arange(0, 16)
    hi = tl.sum(tl.zeros([16], tl.uint32), 0)  # the threshold's bits found so far, as a number
    need = k  # the threshold's rank among the held slots whose bits match them so far (1 = the largest)
    for p in tl.static_range(8):
        SH = 28 - 4 * p  # a constant of the unrolled loop
        counts = tl.zeros([16], tl.int32)
        for s0 in range(0, W, WB):
            s = s0 + tl.arange(0, WB)
            ok = s < W
            held = ((tl.load(valid_ptr + meta + s * m_ss, mask=ok, other=0) != 0) | (s == newslot)) & ok
            pos = tl.load(pos_ptr + meta + s * m_ss, mask=ok, other=-1)
            base = tl.load(score_ptr + meta + s * m_ss, mask=ok, other=0.0)
            kk = _stage_key(base, pos, held, newest, window, first, sinks, PROTECT_WINDOW) >> SH
            match = held & ((kk >> 4) == hi)
            digit = (kk & 15).to(tl.int32)
            counts += tl.sum(((digit[:, None] == bins[None, :]) & match[:, None]).to(tl.int32), 0)
        above = tl.sum(tl.where(bins[None, :] > bins[:, None], counts[None, :], 0), 1)  # matches with a higher digit
        d = tl.max(tl.where((above < need) & (need <= above + counts), bins, 0), 0)
        need -= tl.sum(tl.where(bins == d, above, 0), 0)
        hi = (hi << 4) | d.to(tl.uint32)
    tl.debug_barrier()  # every block's counts read before the scores are written over
    wbase = wt_ptr + mr * w_sr + h * w_sh
    ties_before = tl.sum(tl.zeros([WB], tl.int32), 0)
    best = tl.sum(tl.zeros([WB], tl.float32), 0) + float("inf")
    vslot = tl.sum(tl.zeros([WB], tl.int32), 0) + W
    for s0 in range(0, W, WB):
        s = s0 + tl.arange(0, WB)
        ok = s < W
        pos = tl.load(pos_ptr + meta + s * m_ss, mask=ok, other=-1)
        valid = ((tl.load(valid_ptr + meta + s * m_ss, mask=ok, other=0) != 0) | (s == newslot)) & ok
        base = tl.load(score_ptr + meta + s * m_ss, mask=ok, other=0.0)
        key = _stage_key(base, pos, valid, newest, window, first, sinks, PROTECT_WINDOW)
        tie = (valid & (key == hi)).to(tl.int32)
        rank = ties_before + tl.cumsum(tie, 0) - tie  # tied slots before this one
        ties_before += tl.sum(tie, 0)
        guard = slot_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW)
        chosen = (k > 0) & valid & (~guard) & ((key > hi) | ((tie != 0) & (rank < need)))
        wt = tl.load(wbase + s * w_ss, mask=ok & (s != newslot), other=0.0)
        new = tl.where(chosen, 1e30, (base + eps) * tl.where(s == newslot, w_new, wt))
        open_score = tl.where(guard, float("inf"), new)
        best, vslot = _running_argmin(open_score, s, W, best, vslot)
        tl.store(score_ptr + meta + s * m_ss, new, mask=ok)
        # the next block lies past this one, but the compiler stores in another layout than it loads (other threads
        # for a slot), and a check by argument cannot tell the blocks apart (tests/kernel_hazards.py)
        tl.debug_barrier()
    return best, vslot


@triton.jit
def wide_eviction(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                  pos_ptr, valid_ptr, score_ptr, order_ptr, meta, m_ss, x_ptr, stat_ptr, estat_ptr, norm_ptr,
                  pool_ptr, plen_ptr, budget_ptr, r, h, mr, H, W, S, newslot, newest, window, first, sinks, target,
                  pinned, epsilon, wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, two_eps, ratio_hi, ratio_mid, ratio_lo,
                  G: tl.constexpr, GC: tl.constexpr, SP: tl.constexpr, BW: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, LB: tl.constexpr, QUANT: tl.constexpr, RULE: tl.constexpr,
                  GROUP_MAX: tl.constexpr, POOL_K: tl.constexpr, POOL_MAX: tl.constexpr, ZERO_WINDOW: tl.constexpr,
                  GAIN_FLOOR: tl.constexpr, PROTECT_WINDOW: tl.constexpr, VNORM: tl.constexpr,
                  GEN_FIRST: tl.constexpr, HELD: tl.constexpr, WB: tl.constexpr, RB: tl.constexpr,
                  TWO_STAGE: tl.constexpr, GP: tl.constexpr, NBP: tl.constexpr, LAYER: tl.constexpr):  # fmt: skip
    """The decode eviction of a row and KV head whose ``W`` slots are read in blocks of ``WB`` (the module's
    docstring), the new token (slot ``newslot``, position ``newest``) among them: every slot's new score written
    back, the victim's and the new token's validity and position, and for a pooled rule the order of the row's next
    step. Returns ``(victim, chosen)`` as :func:`slake.kernels.triton_eviction.rule_eviction` does. ``BW``:
    ``pow2(W)``, the row's scratch buffer holding ``2 BW`` floats; ``HELD``: read the order the previous step left;
    ``TWO_STAGE``: CriticalKV's two stages over the rule's scores (:func:`wide_two_stage`); ``LAYER``: an eviction
    across the layer's KV heads, which evicts nothing here (a target of -1) and whose evictions since the previous
    step are dropped from the order buffer (:func:`_drop_evicted`)."""
    gc = tl.arange(0, GC)
    gcmask = gc < G
    # 0. the row's valid slots, the new token's among them
    count = tl.sum(tl.zeros([WB], tl.int32), 0)
    for s0 in range(0, W, WB):
        s = s0 + tl.arange(0, WB)
        v = ((tl.load(valid_ptr + meta + s * m_ss, mask=s < W, other=0) != 0) | (s == newslot)) & (s < W)
        count += tl.sum(v.to(tl.int32), 0)
    c = 1.0
    if RULE == 2:  # AhaKV's gain from the row's prompt length and budget
        c = sharpening_gain(plen_ptr, budget_ptr, mr, GAIN_FLOOR)
    if RULE == 8:
        m, lsum = _head_stats(estat_ptr, r, h, H, S, gc, gcmask, G, SP)
    else:
        m, lsum = _head_stats(stat_ptr, r, h, H, S, gc, gcmask, G, SP)
    tot = lsum
    if RULE == 2:
        tot = _sharpened_totals(x_ptr, r, h, H, W, m, c, gc, gcmask, G, GC, WB)
    base = pool_ptr + (r * H + h).to(tl.int64) * 2 * BW
    best = tl.sum(tl.zeros([WB], tl.float32), 0) + float("inf")
    vslot = tl.sum(tl.zeros([WB], tl.int32), 0) + W
    if RULE == 0 and POOL_K > 1:
        # 1. the row's order by position in the order buffer: the previous step's, the slot order, or counted
        held = count - 1
        if HELD:
            if LAYER:  # the slots the layer kernel evicted after the previous step's order was written, dropped
                _drop_evicted(order_ptr, valid_ptr, meta, m_ss, W, held, newslot, H, WB)
            holds = _order_holds(order_ptr, pos_ptr, valid_ptr, meta, m_ss, W, held, newslot, newest, WB)
        else:
            holds = count < 0
        if holds == 0:
            _list_slot_order(order_ptr, valid_ptr, meta, m_ss, W, newslot, WB)
            if _order_holds(order_ptr, pos_ptr, valid_ptr, meta, m_ss, W, held, newslot, newest, WB) == 0:
                _count_ranks(order_ptr, pos_ptr, valid_ptr, meta, m_ss, W, newslot, RB)
                held = count  # the new token is listed at its rank
        if held < count:  # the new token after the listed slots
            tl.store(order_ptr + meta + held * m_ss, newslot)
        tl.debug_barrier()
        # 2. each rank's signal into the scratch buffer (CAKE's window adds 0 to its neighbours' pooling)
        for i0 in range(0, count, WB):
            i = i0 + tl.arange(0, WB)
            ok = i < count
            slot = tl.load(order_ptr + meta + i * m_ss, mask=ok, other=0)
            sig = _block_signal(x_ptr, r, h, H, W, slot, ok, m, lsum, tot, c, gc, gcmask, G, RULE, GROUP_MAX)
            if ZERO_WINDOW:
                spos = tl.load(pos_ptr + meta + slot * m_ss, mask=ok, other=0)
                sig = tl.where(spos > newest - window, 0.0, sig)
            tl.store(base + i, sig, mask=ok)
        tl.debug_barrier()
        # 3. the pooled scores of the valid slots, written back, and the victim among them: the lowest, ties to the
        # lowest slot (argmin over the row's slots)
        vrank = count
        for i0 in range(0, count, WB):
            i = i0 + tl.arange(0, WB)
            ok = i < count
            slot = tl.load(order_ptr + meta + i * m_ss, mask=ok, other=0)
            pooled = _pooled_at(base, i, count, W, POOL_K, POOL_MAX)
            spos = tl.load(pos_ptr + meta + slot * m_ss, mask=ok, other=0)
            open_score = tl.where(slot_guard(spos, ok, newest, window, first, sinks, PROTECT_WINDOW), float("inf"),
                                  pooled)  # fmt: skip
            low = tl.min(open_score, 0)
            at = tl.min(tl.where(open_score == low, slot, W), 0)
            take = (low < best) | ((low == best) & (at < vslot))
            vrank = tl.where(take, tl.min(tl.where((open_score == low) & (slot == at), i, count), 0), vrank)
            vslot = tl.where(take, at, vslot)
            best = tl.minimum(best, low)
            tl.store(score_ptr + meta + slot * m_ss, pooled, mask=ok)
        # 4. the empty slots' scores: they rank after every valid slot, in slot order (as a sort of the row ranks
        # them), the e-th empty one at count + e (a row full to its width, every row of a uniform layer at batch 1,
        # has none)
        if count < W:
            carry = tl.sum(tl.zeros([WB], tl.int32), 0)
            for s0 in range(0, W, WB):
                s = s0 + tl.arange(0, WB)
                empty = (s < W) & (tl.load(valid_ptr + meta + s * m_ss, mask=s < W, other=1) == 0) & (s != newslot)
                e = empty.to(tl.int32)
                rank = count + carry + tl.cumsum(e, 0) - e
                pooled = _pooled_at(base, rank, count, W, POOL_K, POOL_MAX)
                tl.store(score_ptr + meta + s * m_ss, pooled, mask=empty)
                carry += tl.sum(e, 0)
    else:
        if RULE == 7:  # KeyDiff: the cosines of the row's keys to their anchor, into the scratch buffer
            key_cosines(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                        valid_ptr, meta, m_ss, base, r, h, W, newslot, count, D, DP, LB, QUANT)  # fmt: skip
        # 1. each slot's new score, written back, and the running argmin
        for s0 in range(0, W, WB):
            s = s0 + tl.arange(0, WB)
            ok = s < W
            pos = tl.load(pos_ptr + meta + s * m_ss, mask=ok, other=-1)
            valid = ((tl.load(valid_ptr + meta + s * m_ss, mask=ok, other=0) != 0) | (s == newslot)) & ok
            stored = tl.load(score_ptr + meta + s * m_ss, mask=ok, other=float("-inf"))
            if RULE == 3:  # TOVA: the mean over every query head of the layer
                new = tl.zeros([WB], tl.float32)
                for hh in range(0, H):
                    m_h, l_h = _head_stats(stat_ptr, r, hh, H, S, gc, gcmask, G, SP)
                    new += _block_signal(x_ptr, r, hh, H, W, s, ok, m_h, l_h, l_h, c, gc, gcmask, G, RULE, False)
                new = new / H
            elif RULE <= 2 or RULE == 6:
                sig = _block_signal(x_ptr, r, h, H, W, s, ok, m, lsum, tot, c, gc, gcmask, G, RULE, GROUP_MAX)
                if RULE == 0:  # the current attention, not pooled
                    new = sig
                    if ZERO_WINDOW:  # the window's slots score 0 (CAKE's rule)
                        new = tl.where((pos > newest - window) | (~valid), 0.0, new)
                else:  # H2O's and AhaKV's accumulation, KVzip's running max
                    new = rule_score(stored, sig, pos, valid, s == newslot, pinned, RULE, GEN_FIRST)
            elif RULE == 7:
                new = tl.where(valid, -tl.load(base + s, mask=ok, other=0.0), 0.0)
            elif RULE == 8:  # Expected Attention: the mapped queries' softmax, group mean, value-weighted
                new = _block_signal(x_ptr, r, h, H, W, s, ok, m, lsum, tot, c, gc, gcmask, G, RULE, False)
                if VNORM:
                    vnorm = tl.load(norm_ptr + (r * H + h).to(tl.int64) * W + s, mask=ok, other=0.0)
                    new = (new + epsilon) * vnorm
            else:  # recency, SAGE-KV's pinned recency
                new = rule_score(stored, 0.0, pos, valid, s == newslot, pinned, RULE, GEN_FIRST)
            open_score = tl.where(slot_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW), float("inf"),
                                  new)  # fmt: skip
            best, vslot = _running_argmin(open_score, s, W, best, vslot)
            tl.store(score_ptr + meta + s * m_ss, new, mask=ok)
        vrank = count
    if TWO_STAGE:  # the rule's scores were the base scores: the two stages' in their place, and their victim
        tl.debug_barrier()  # every block's base scores stored before any is read
        best, vslot = wide_two_stage(pos_ptr, valid_ptr, score_ptr, meta, m_ss, wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB,
                                     r, h, mr, H, W, count, newslot, newest, window, first, sinks, two_eps, ratio_hi,
                                     ratio_mid, ratio_lo, G, GP, NBP, PROTECT_WINDOW, WB)  # fmt: skip
        if RULE == 0 and POOL_K > 1:  # the victim's rank in the order buffer, for the order of the next step
            vrank = count
            for i0 in range(0, count, WB):
                i = i0 + tl.arange(0, WB)
                slot = tl.load(order_ptr + meta + i * m_ss, mask=i < count, other=-1)
                vrank = tl.minimum(vrank, tl.min(tl.where(slot == vslot, i, count), 0))
    # the victim: slot 0 when every slot is guarded (argmin over a row of +inf); evicted when the row holds more
    # than its target and the victim is a valid slot
    victim = tl.where(best == float("inf"), 0, vslot)
    victim_valid = (victim == newslot) | (tl.load(valid_ptr + meta + victim * m_ss) != 0)
    chosen = (count > target) & (target >= 0) & victim_valid
    # after every thread's store of the blocks' scores: the victim's, written by whichever thread held its block,
    # would otherwise race this one
    tl.debug_barrier()
    tl.store(score_ptr + meta + victim * m_ss, float("-inf"), mask=chosen)
    if RULE == 0 and POOL_K > 1:
        # 5. the order of the row's next step: this one's without the victim, one block at a time (each block's
        # entries read before any is written over)
        vrank = tl.where(best == float("inf"), count, vrank)
        for i0 in range(vrank, count - 1, WB):
            i = i0 + tl.arange(0, WB)
            shift = (i < count - 1) & chosen
            nxt = tl.load(order_ptr + meta + (i + 1) * m_ss, mask=shift, other=0)
            tl.debug_barrier()
            tl.store(order_ptr + meta + i * m_ss, nxt, mask=shift)
            tl.debug_barrier()
    settle_row(pos_ptr, valid_ptr, meta, m_ss, newslot, newest, victim, chosen)
    return victim, chosen
