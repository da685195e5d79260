"""The decode rules' per-slot signals inside the fused decode kernels' second kernel
(:mod:`slake.kernels.triton_decode`, :class:`slake.methods.decode_rule.FusedDecodeRule`): each query head's
softmax statistics combined over the first kernel's pieces, the attention a KV head's query heads give each slot,
the positional pooling of SnapKV's and CAKE's rules, KeyDiff's key diversity, and CriticalKV's two stages with the
kernel that weighs each new slot."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels.triton_slots import block_keys, load_row

__all__ = [
    "head_signal",
    "held_order",
    "key_diversity",
    "listed_order",
    "pool_by_position",
    "position_order",
    "ranked_argmin",
    "row_stats",
    "two_stage",
]


@triton.jit
def row_stats(stat_ptr, r, hh, gi, H, S, G: tl.constexpr, SP: tl.constexpr):
    """Query head ``gi`` of KV head ``hh``: its softmax maximum and normaliser over every slot, combined from the
    first kernel's per-split values."""
    sidx = tl.arange(0, SP)
    smask = sidx < S
    sb = (((r * H + hh) * G + gi) * S + sidx) * 2
    ms = tl.load(stat_ptr + sb, mask=smask, other=-3.4028234663852886e38)
    ls = tl.load(stat_ptr + sb + 1, mask=smask, other=0.0)
    m = tl.max(ms, 0)
    return m, tl.sum(ls * tl.exp(ms - m), 0)


@triton.jit
def head_signal(x_ptr, stat_ptr, r, hh, H, W, S, sw, wmask, c, G: tl.constexpr, SP: tl.constexpr,
                 BW: tl.constexpr, RULE: tl.constexpr, GROUP_MAX: tl.constexpr):  # fmt: skip
    """The attention a KV head's ``G`` query heads give each slot this step, reduced over them (mean or max);
    AhaKV's sharpened rule normalises ``softmax(c * logits)`` instead of the softmax."""
    if GROUP_MAX:
        acc = tl.full([BW], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BW], tl.float32)
    xbase = (r * H + hh).to(tl.int64) * G * W
    for gi in tl.static_range(G):
        x = tl.load(x_ptr + xbase + gi * W + sw, mask=wmask, other=float("-inf"))
        m, lsum = row_stats(stat_ptr, r, hh, gi, H, S, G, SP)
        if RULE == 2:
            t = tl.exp(c * (x - m))
            tot = tl.sum(t, 0)
            p = tl.where(tot > 0, t / tot, 0.0)
        else:
            p = tl.where(lsum > 0, tl.exp(x - m) / lsum, 0.0)
        if GROUP_MAX:
            acc = tl.maximum(acc, p)
        else:
            acc = acc + p
    if GROUP_MAX:
        return tl.where(wmask, acc, 0.0)
    return acc / G


@triton.jit
def position_order(pos, valid, wmask, sw, BW: tl.constexpr, KEY_SPAN: tl.constexpr):
    """The row's slots in position order: ``order[i]`` is the slot of rank ``i``; the valid slots come first, by
    position, then the empty ones and those past the row's width, by slot (a permutation of ``0 .. BW - 1``).

    One sort of keys that carry the slot in their low bits. The keys are int32 when the valid positions span fewer
    than ``KEY_SPAN`` (:func:`slake.kernels.launch_config.key_span`: ``2**31 / BW - 2``, a million tokens at 2,048
    slots; the key is the position less the lowest valid one), int64 otherwise: a 64-bit sort is emulated with
    twice the registers and shuffles of a 32-bit one (at Llama-3-8B's shape and 1,025 slots, 1,050 shuffles against
    570, ``tests/kernel_aot.py``)."""
    lo = tl.min(tl.where(valid, pos, 1 << 60), 0)
    hi = tl.max(tl.where(valid, pos, -(1 << 60)), 0)
    if hi - lo < KEY_SPAN:
        rel = tl.where(valid, pos - lo, KEY_SPAN).to(tl.int32)
        order = tl.sort(tl.where(wmask, rel, KEY_SPAN + 1) * BW + sw, 0) % BW
    else:
        key = tl.where(valid, pos, 1 << 40)
        order = (tl.sort(tl.where(wmask, key, (1 << 40) + 1) * BW + sw, 0) % BW).to(tl.int32)
    return order


@triton.jit
def pool_by_position(scores, valid, order, count, base, W, sw, wmask, BW: tl.constexpr, POOL_K: tl.constexpr,
                     POOL_MAX: tl.constexpr, IN_REGISTERS: tl.constexpr):  # fmt: skip
    """SnapKV's pooling of ``scores`` (slot order; 0 where a slot is empty) over each slot's ``POOL_K`` neighbours
    in position order (``order``, :func:`position_order`), average or maximum, with the row's ends padded as
    ``avg_pool1d``/``max_pool1d`` pad them (a neighbour past an end adds 0 to the average, nothing to the maximum).

    ``IN_REGISTERS``: the ranking and the shifts are gathers within the program (``tl.gather``), and the pooled
    scores come back in rank order (entry ``i`` belongs to slot ``order[i]``). Only the first ``count`` ranks (the
    valid slots) are read from ``order``; the ranks after them are empty slots, whose score is 0 whichever they are
    (:func:`held_order` leaves them unlisted). Otherwise (the pooling of before,
    kept to time one against the other: ``launch_config.POOL_GATHER``) they go through the row's scratch buffer in
    global memory (``base``, ``2 * BW`` floats), three store-barrier-load round trips, and come back in slot
    order."""
    if IN_REGISTERS:
        ranked = tl.where(sw < count, tl.gather(tl.where(valid, scores, 0.0), order, 0), 0.0)
    else:
        tl.store(base + sw, tl.where(valid, scores, 0.0))
        tl.debug_barrier()
        tl.store(base + BW + sw, tl.load(base + order, mask=order < W, other=0.0))
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
def ranked_argmin(ranked, guard, order, count, sw, BW: tl.constexpr):
    """The slot ``argmin`` would pick from a row's scores in slot order (the first lowest, guarded slots at
    ``+inf``), given the scores in rank order (``ranked``, entry ``i`` of slot ``order[i]``; the first ``count``
    ranks are the valid slots, the others empty, so guarded) and the guard in slot order: among the ranks holding
    the lowest score, the lowest slot, so that ties go where the torch step's ``argmin`` sends them, not to the
    oldest position. When every slot is guarded, slot 0, as ``argmin`` over a row of ``+inf``."""
    scores = tl.where((sw < count) & (tl.gather(guard.to(tl.int32), order, 0) == 0), ranked, float("inf"))
    low = tl.min(scores, 0)
    return tl.where(low == float("inf"), 0, tl.min(tl.where(scores == low, order, BW), 0))


@triton.jit
def listed_order(order_ptr, meta, m_ss, pos, valid, sw, newslot, newest, count, BW: tl.constexpr):
    """Whether the order the kernel left at ``order_ptr`` after the row's previous step still holds, and the order
    it gives: ``(holds, order)``, ``order`` the row's valid slots by position in its first ``count`` ranks (0 after
    them), as :func:`position_order` ranks them when ``holds``.

    A row's order changes little from one step to the next: the new token (``newslot``, at position ``newest``)
    comes last, and the step's victim leaves. The buffer is trusted only when it proves itself: its first
    ``count - 1`` entries are valid slots in strictly increasing positions, all below ``newest``. Those are then
    ``count - 1`` distinct valid slots other than the new one, which is all of them, in the one order a sort by
    position gives; so any content (a new row's, a step of the torch path's, another request's in the vLLM pool)
    is safe. The check is three gathers and two reductions over the row."""
    held = count - 1  # the slots the row held before this step's token
    listed = sw < held
    buf = tl.load(order_ptr + meta + sw * m_ss, mask=listed, other=0)
    buf = tl.minimum(tl.maximum(buf, 0), BW - 1)
    bpos = tl.gather(pos, buf, 0)
    bvalid = tl.gather(valid.to(tl.int32), buf, 0)
    after = tl.gather(bpos, tl.minimum(sw + 1, BW - 1), 0)
    each = (~listed) | ((bvalid != 0) & ((sw >= held - 1) | (bpos < after)))
    last = tl.max(tl.where(listed, bpos, -1), 0)
    holds = (tl.min(each.to(tl.int32), 0) == 1) & (last < newest)
    return holds, tl.where(listed, buf, tl.where(sw == held, newslot, 0))


@triton.jit
def held_order(order_ptr, meta, m_ss, pos, valid, wmask, sw, newslot, newest, count, BW: tl.constexpr,
               KEY_SPAN: tl.constexpr):  # fmt: skip
    """The row's valid slots in position order (ranks ``0 .. count - 1`` of :func:`position_order`): the order its
    previous step left when it holds (:func:`listed_order`), else by :func:`position_order`'s sort, a bitonic
    network of ``log2(BW) (log2(BW) + 1) / 2`` stages over the row."""
    holds, listed = listed_order(order_ptr, meta, m_ss, pos, valid, sw, newslot, newest, count, BW)
    if holds:
        order = listed
    else:
        order = position_order(pos, valid, wmask, sw, BW, KEY_SPAN)
    return order


@triton.jit
def key_diversity(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                   valid_ptr, meta, m_ss, pool_ptr, r, h, H, W, newslot, sw, wmask, valid,
                   D: tl.constexpr, DP: tl.constexpr, BW: tl.constexpr, LB: tl.constexpr,
                   QUANT: tl.constexpr):  # fmt: skip
    """KeyDiff's decode score of a row's ``BW`` slots (:func:`slake.methods.keydiff.keydiff_scores`): the anchor is
    the mean of the held slots' unit keys (``F.normalize``: ``k / max(|k|, 1e-12)``), a slot's score minus its
    key's cosine to it (``F.cosine_similarity``: ``k . a / (max(|k|, 1e-8) max(|a|, 1e-8))``), 0 where the slot is
    empty. Two passes over the keys, ``LB`` slots at a time; the cosines go through the row's scratch buffer into
    a ``(BW,)`` vector."""
    dd = tl.arange(0, DP)
    dmask = dd < D
    anchor = tl.zeros([DP], tl.float32)
    for s0 in range(0, W, LB):
        s = s0 + tl.arange(0, LB)
        ok = s < W
        kt = block_keys(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                         r, h, s, ok, dd, dmask, QUANT)  # fmt: skip
        held = ((tl.load(valid_ptr + meta + s * m_ss, mask=ok, other=0) != 0) | (s == newslot)) & ok
        unit = kt / tl.maximum(tl.sqrt(tl.sum(kt * kt, 1)), 1e-12)[:, None]
        anchor += tl.sum(tl.where(held[:, None], unit, 0.0), 0)
    anchor = anchor / tl.maximum(tl.sum(valid.to(tl.float32), 0), 1.0)
    anorm = tl.maximum(tl.sqrt(tl.sum(anchor * anchor, 0)), 1e-8)
    base = pool_ptr + (r * H + h).to(tl.int64) * 2 * BW
    for s0 in range(0, W, LB):
        s = s0 + tl.arange(0, LB)
        ok = s < W
        kt = block_keys(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                         r, h, s, ok, dd, dmask, QUANT)  # fmt: skip
        knorm = tl.maximum(tl.sqrt(tl.sum(kt * kt, 1)), 1e-8)
        tl.store(base + s, tl.sum(kt * anchor[None, :], 1) / (knorm * anorm), mask=ok)
    tl.debug_barrier()
    return tl.where(valid, -tl.load(base + sw, mask=wmask, other=0.0), 0.0)


@triton.jit
def two_stage(base, valid, sw, wmask, newslot, r, h, mr, H, wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, eps,
              ratio_hi, ratio_mid, ratio_lo, G: tl.constexpr, GP: tl.constexpr, NBP: tl.constexpr):  # fmt: skip
    """CriticalKV's scores (:func:`slake.methods.criticalkv.two_stage`) of a row's ``BW`` slots from their base
    scores ``base``: the ``floor(n * ratio)`` best of the ``n`` held slots by ``base`` (ties to the lower slot, as a
    stable descending sort) score ``FIRST`` (1e30), the others ``(base + eps) * w``. ``w`` is the slot's weight;
    the new slot's is the sum of the projection kernel's pieces averaged over the KV head's query heads, written to
    the weights here. ``ratio`` comes as three float32 parts that add up to the float64 ratio exactly, so that
    ``floor(n * ratio)`` is computed in float64 as the torch rule computes it."""
    gi = tl.arange(0, GP)
    nbi = tl.arange(0, NBP)
    pw = tl.load(
        pw_ptr + ((r * H + h) * G + gi[:, None]).to(tl.int64) * NB + nbi[None, :],
        mask=(gi < G)[:, None] & (nbi < NB)[None, :],
        other=0.0,
    )
    w_new = tl.sum(tl.sum(pw, 1), 0) / G
    wbase = wt_ptr + mr * w_sr + h * w_sh
    wt = tl.load(wbase + sw * w_ss, mask=wmask & (sw != newslot), other=0.0)
    wt = tl.where(sw == newslot, w_new, wt)
    tl.store(wbase + newslot * w_ss, w_new)
    held = tl.sum(valid.to(tl.int32), 0)
    ratio = tl.cast(ratio_hi, tl.float64) + tl.cast(ratio_mid, tl.float64) + tl.cast(ratio_lo, tl.float64)
    first = tl.floor(held.to(tl.float64) * ratio).to(tl.int32)
    ranked = tl.where(valid, base, float("-inf"))
    top = tl.sort(ranked, 0, descending=True)
    t = tl.sum(tl.where(sw == first - 1, top, 0.0), 0)  # the first-th largest held score
    above = valid & (ranked > t)
    ties = (valid & (ranked == t)).to(tl.int32)
    before = tl.cumsum(ties, 0) - ties  # tied slots before this one
    chosen = (first > 0) & (above | ((ties != 0) & (before < first - tl.sum(above.to(tl.int32), 0))))
    return tl.where(chosen, 1e30, (base + eps) * wt)


@triton.jit
def _value_projection_kernel(
    v_ptr, v_sb, v_sh, v_so, v_sd,
    vs_ptr, s_sb, s_sh, s_so,
    table_ptr, t_sr, block_size,
    newslot_ptr, wo_ptr, wo_sj, wo_si, pw_ptr,
    R, H, hidden, NB,
    G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, HB: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """CriticalKV's weight of each row's new slot, in pieces: program (query head ``q``, block ``j`` of ``HB``
    output channels) writes ``sum_{i in j} |(W_o^q v)_i|`` for every row's new value ``v`` (as stored, dequantised),
    with :func:`slake.methods.criticalkv.projected_norm`'s roundings (the value and each output in ``W_o``'s
    dtype); the second kernel sums the pieces and averages over the KV head's query heads. ``W_o`` is read once
    per step, whatever the number of rows."""
    qh = tl.program_id(0)
    nb = tl.program_id(1)
    h = qh // G
    dd = tl.arange(0, DP)
    dmask = dd < D
    j = nb * HB + tl.arange(0, HB)
    jmask = j < hidden
    w = tl.load(
        wo_ptr + j[:, None].to(tl.int64) * wo_sj + (qh * D + dd)[None, :].to(tl.int64) * wo_si,
        mask=jmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    for r in range(0, R):
        free = tl.load(newslot_ptr + r * H + h)
        blk = tl.load(table_ptr + r * t_sr + free // block_size).to(tl.int64)
        off = (free % block_size).to(tl.int64)
        v = load_row(v_ptr, blk * v_sb + h * v_sh + off * v_so, dd * v_sd, dmask,
                     vs_ptr, blk * s_sb + h * s_sh + off * s_so, QUANT)  # fmt: skip
        v = v.to(wo_ptr.dtype.element_ty).to(tl.float32)
        proj = tl.sum(w * v[None, :], 1).to(wo_ptr.dtype.element_ty).to(tl.float32)
        tl.store(pw_ptr + (r * H * G + qh).to(tl.int64) * NB + nb, tl.sum(tl.abs(proj), 0))
