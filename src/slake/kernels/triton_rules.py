"""The decode rules' per-slot signals inside the fused decode kernels' second kernel
(:mod:`slake.kernels.triton_decode`, :class:`slake.methods.decode_rule.FusedDecodeRule`): each query head's
softmax statistics combined over the first kernel's pieces, the attention a KV head's query heads give each slot,
KeyDiff's key diversity, and CriticalKV's two stages with the kernel that weighs each new slot. The positional
pooling of SnapKV's, CAKE's and SLAKE's rule is in :mod:`slake.kernels.triton_pooling`."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels import launch_config as launch
from slake.kernels.triton_slots import block_keys, load_row

__all__ = [
    "first_stage_count", "head_signal", "key_cosines", "key_diversity", "lane_signal", "new_slot_weight", "row_stats",
    "rule_score", "sharpening_gain", "two_stage",
]  # fmt: skip


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
def rule_score(stored, sig, pos, valid, generated, pinned, RULE: tl.constexpr, GEN_FIRST: tl.constexpr):
    """The new decode score of the rules that update a slot's stored score, elementwise (a row's slots, its lanes,
    or the new token alone): H2O's accumulation (``RULE`` 1: 0 where the stored score is not finite), AhaKV's (2: 0
    where a valid slot's is not finite), KVzip's running maximum (6: generated tokens, ``generated`` or a stored
    score >= 2, carry 2 + their maximum with ``GEN_FIRST``: :data:`slake.methods.kvzip.GENERATED`, above any
    context pair's attention, which is at most 1), recency (4: the position) and SAGE-KV's pinned recency
    (5: ``pinned`` where the stored score is at least half of it, else the position). ``sig``: this step's attention
    signal (unread by 4 and 5)."""
    finite = (stored == stored) & (tl.abs(stored) != float("inf"))
    if RULE == 1:
        score = tl.where(finite, stored, 0.0) + sig
    elif RULE == 2:
        score = tl.where((~finite) & valid, 0.0, stored) + sig
    elif RULE == 6:
        if GEN_FIRST:
            sig = sig + 2.0 * (generated | (stored >= 2.0)).to(tl.float32)
        score = tl.maximum(stored, sig)
    elif RULE == 4:
        score = pos.to(tl.float32)
    else:
        score = tl.where(finite & (stored >= pinned / 2), pinned, pos.to(tl.float32))
    return score


@triton.jit
def sharpening_gain(plen_ptr, budget_ptr, mr, GAIN_FLOOR: tl.constexpr):
    """AhaKV's gain ``c = sqrt(2 ln(max(N, B + 1) / B))`` of row ``mr`` from its prompt length ``N`` and budget
    ``B`` (at least 1 with ``GAIN_FLOOR``), as :mod:`slake.methods.ahakv` computes it."""
    n = tl.load(plen_ptr + mr).to(tl.float32)
    bb = tl.maximum(tl.load(budget_ptr + mr).to(tl.float32), 1.0)
    c = tl.sqrt(2.0 * tl.log(tl.maximum(n, bb + 1.0) / bb))
    if GAIN_FLOOR:
        c = tl.maximum(c, 1.0)
    return c


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
def lane_signal(x_ptr, stat_ptr, r, hh, H, W, S, lslot, lmask, newslot, c, G: tl.constexpr, SP: tl.constexpr,
                BW: tl.constexpr, RULE: tl.constexpr, GROUP_MAX: tl.constexpr):  # fmt: skip
    """:func:`head_signal` with the new token apart (:func:`slake.kernels.triton_slots.row_lanes`): the attention a
    KV head's ``G`` query heads give each lane's slot (``lslot``) and the new token (``newslot``) this step,
    reduced over them (mean, or max with ``GROUP_MAX``): ``(lanes, new)``. AhaKV's sharpened rule (``RULE`` 2)
    normalises ``softmax(c * logits)`` over the lanes and the new token together."""
    if GROUP_MAX:
        acc = tl.full([BW], float("-inf"), tl.float32)
        acc_new = float("-inf")
    else:
        acc = tl.zeros([BW], tl.float32)
        acc_new = 0.0
    xbase = (r * H + hh).to(tl.int64) * G * W
    for gi in tl.static_range(G):
        x = tl.load(x_ptr + xbase + gi * W + lslot, mask=lmask, other=float("-inf"))
        x_new = tl.load(x_ptr + xbase + gi * W + newslot)
        m, lsum = row_stats(stat_ptr, r, hh, gi, H, S, G, SP)
        if RULE == 2:
            t = tl.exp(c * (x - m))
            t_new = tl.exp(c * (x_new - m))
            tot = tl.sum(t, 0) + t_new
            p = tl.where(tot > 0, t / tot, 0.0)
            p_new = tl.where(tot > 0, t_new / tot, 0.0)
        else:
            p = tl.where(lsum > 0, tl.exp(x - m) / lsum, 0.0)
            p_new = tl.where(lsum > 0, tl.exp(x_new - m) / lsum, 0.0)
        if GROUP_MAX:
            acc = tl.maximum(acc, p)
            acc_new = tl.maximum(acc_new, p_new)
        else:
            acc = acc + p
            acc_new = acc_new + p_new
    if GROUP_MAX:
        return tl.where(lmask, acc, 0.0), acc_new
    return acc / G, acc_new / G


@triton.jit
def key_cosines(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                valid_ptr, meta, m_ss, base, r, h, W, newslot, count,
                D: tl.constexpr, DP: tl.constexpr, LB: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """KeyDiff's cosine of every slot's key to the anchor, written to ``base[0 .. W)`` (the row's scratch buffer). The
    anchor is the mean of the row's ``count`` held slots' unit keys (``F.normalize``: ``k / max(|k|, 1e-12)``), the
    cosine ``F.cosine_similarity``'s: ``k . a / (max(|k|, 1e-8) max(|a|, 1e-8))``. Two passes over the row's keys,
    ``LB`` slots at a time, and a barrier: the buffer is read by the program's other threads after it."""
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
    anchor = anchor / tl.maximum(count.to(tl.float32), 1.0)
    anorm = tl.maximum(tl.sqrt(tl.sum(anchor * anchor, 0)), 1e-8)
    for s0 in range(0, W, LB):
        s = s0 + tl.arange(0, LB)
        ok = s < W
        kt = block_keys(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                         r, h, s, ok, dd, dmask, QUANT)  # fmt: skip
        knorm = tl.maximum(tl.sqrt(tl.sum(kt * kt, 1)), 1e-8)
        tl.store(base + s, tl.sum(kt * anchor[None, :], 1) / (knorm * anorm), mask=ok)
    tl.debug_barrier()


@triton.jit
def key_diversity(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                   valid_ptr, meta, m_ss, pool_ptr, r, h, H, W, newslot, idx, imask, valid, count,
                   D: tl.constexpr, DP: tl.constexpr, BW: tl.constexpr, LB: tl.constexpr,
                   QUANT: tl.constexpr):  # fmt: skip
    """KeyDiff's decode score (:func:`slake.methods.keydiff.keydiff_scores`) of the slots ``idx`` (``(BW,)``, where
    ``imask``; ``valid`` whether each is held) and of the new token (slot ``newslot``): ``(scores, new)``, minus each
    slot's key's cosine to the anchor (:func:`key_cosines`), 0 where the slot is empty. The cosines go through the
    row's scratch buffer (``2 BW`` floats, of which the first ``W``)."""
    base = pool_ptr + (r * H + h).to(tl.int64) * 2 * BW
    key_cosines(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                valid_ptr, meta, m_ss, base, r, h, W, newslot, count, D, DP, LB, QUANT)  # fmt: skip
    return tl.where(valid, -tl.load(base + idx, mask=imask, other=0.0), 0.0), -tl.load(base + newslot)


@triton.jit
def new_slot_weight(wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, r, h, mr, H, newslot, G: tl.constexpr, GP: tl.constexpr,
                    NBP: tl.constexpr):  # fmt: skip
    """CriticalKV's weight of the row's new slot: the projection kernel's pieces (:func:`_value_projection_kernel`)
    summed and averaged over the KV head's query heads, written to the slot weights at ``newslot`` and returned."""
    gi = tl.arange(0, GP)
    nbi = tl.arange(0, NBP)
    pw = tl.load(
        pw_ptr + ((r * H + h) * G + gi[:, None]).to(tl.int64) * NB + nbi[None, :],
        mask=(gi < G)[:, None] & (nbi < NB)[None, :],
        other=0.0,
    )
    w_new = tl.sum(tl.sum(pw, 1), 0) / G
    tl.store(wt_ptr + mr * w_sr + h * w_sh + newslot * w_ss, w_new)
    return w_new


@triton.jit
def first_stage_count(held, ratio_hi, ratio_mid, ratio_lo):
    """``floor(held * ratio)``, the slots CriticalKV's first stage keeps, computed in float64 as the torch rule
    computes it, from the ratio's three float32 parts (which add up to the float64 ratio exactly)."""
    ratio = tl.cast(ratio_hi, tl.float64) + tl.cast(ratio_mid, tl.float64) + tl.cast(ratio_lo, tl.float64)
    return tl.floor(held.to(tl.float64) * ratio).to(tl.int32)


@triton.jit
def two_stage(base, valid, protected, sw, wmask, newslot, r, h, mr, H, wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, eps,
              ratio_hi, ratio_mid, ratio_lo, G: tl.constexpr, GP: tl.constexpr, NBP: tl.constexpr):  # fmt: skip
    """CriticalKV's scores (:meth:`slake.methods.criticalkv.CriticalKV.decode_scores`) of a row's ``BW`` slots from
    their base scores ``base``: of the ``floor(n * ratio)`` first-stage places of the ``n`` held slots, the
    ``protected`` held ones (window, sinks) take theirs (ranked above every base score) and the best others by
    ``base`` the rest (ties to the lower slot, as a stable descending sort); those others score ``FIRST`` (1e30),
    every other slot ``(base + eps) * w``. ``w`` is the slot's weight; the new slot's is :func:`new_slot_weight`.
    ``ratio`` comes as three float32 parts (:func:`first_stage_count`). Rows read in blocks:
    :func:`slake.kernels.triton_wide.wide_two_stage`."""
    w_new = new_slot_weight(wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, r, h, mr, H, newslot, G, GP, NBP)
    # the new slot's weight stored before the others are read (they are not its slot, but a check by argument cannot
    # tell: tests/kernel_hazards.py)
    tl.debug_barrier()
    wbase = wt_ptr + mr * w_sr + h * w_sh
    wt = tl.load(wbase + sw * w_ss, mask=wmask & (sw != newslot), other=0.0)
    wt = tl.where(sw == newslot, w_new, wt)
    held = tl.sum(valid.to(tl.int32), 0)
    first = first_stage_count(held, ratio_hi, ratio_mid, ratio_lo)
    ranked = tl.where(valid, tl.where(protected, float("inf"), base), float("-inf"))
    top = tl.sort(ranked, 0, descending=True)
    t = tl.sum(tl.where(sw == first - 1, top, 0.0), 0)  # the first-th largest held score
    above = valid & (ranked > t)
    ties = (valid & (ranked == t)).to(tl.int32)
    before = tl.cumsum(ties, 0) - ties  # tied slots before this one
    chosen = (first > 0) & (above | ((ties != 0) & (before < first - tl.sum(above.to(tl.int32), 0))))
    return tl.where(chosen & (~protected), 1e30, (base + eps) * wt)


@triton.jit(do_not_specialize=launch.UNSPECIALIZED)
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
