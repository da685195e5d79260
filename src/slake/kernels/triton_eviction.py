"""The decode eviction of the rules without positional pooling inside the fused decode kernels' second kernel
(:mod:`slake.kernels.triton_decode`), with the new token apart: H2O's accumulated attention, AhaKV's sharpened
accumulation, TOVA's layer mean, recency, SAGE-KV's pinned recency, KVzip's running maximum, KeyDiff's key
diversity, Expected Attention's moved queries, and the current attention without pooling.

As in :func:`slake.kernels.triton_pooling.pooled_eviction`, the program's vectors hold the row's ``W - 1`` kept
slots in ``pow2(W - 1)`` lanes (:func:`slake.kernels.triton_slots.row_lanes`) and the new token is a scalar beside
them, so that a row of budget + 1 slots is not padded to twice its width. The rules' arithmetic is the slot-order
path's (the kernel's, which CriticalKV's two stages keep), applied to the lanes and to the new token alike."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels.triton_rules import key_diversity, lane_signal, rule_score, sharpening_gain
from slake.kernels.triton_slots import lane_guard, row_lanes, settle_row

__all__ = ["lane_argmin", "rule_eviction"]


@triton.jit
def lane_argmin(scores, new_score, guard, new_guarded, lslot, newslot, W):
    """The slot ``argmin`` would pick from the row's scores in slot order (the first lowest, guarded slots at
    ``+inf``), from the lanes' scores (``guard`` in lane order, ``lslot`` each lane's slot) and the new token's:
    the lowest score, ties to the lowest slot. When every slot is guarded, slot 0, as ``argmin`` over a row of
    ``+inf``."""
    scores = tl.where(guard, float("inf"), scores)
    low = tl.min(scores, 0)
    slot = tl.min(tl.where(scores == low, lslot, W), 0)
    new = tl.where(new_guarded, float("inf"), new_score)
    take_new = (new < low) | ((new == low) & (newslot < slot))
    best = tl.minimum(low, new)
    return tl.where(best == float("inf"), 0, tl.where(take_new, newslot, slot))


@triton.jit
def rule_eviction(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                  pos_ptr, valid_ptr, score_ptr, meta, m_ss, x_ptr, stat_ptr, estat_ptr, norm_ptr, pool_ptr,
                  plen_ptr, budget_ptr, r, h, mr, H, W, S, newslot, newest, window, first, sinks, target, pinned,
                  epsilon,
                  G: tl.constexpr, SP: tl.constexpr, BW: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  LB: tl.constexpr, QUANT: tl.constexpr, RULE: tl.constexpr, GROUP_MAX: tl.constexpr,
                  ZERO_WINDOW: tl.constexpr, GAIN_FLOOR: tl.constexpr, PROTECT_WINDOW: tl.constexpr,
                  VNORM: tl.constexpr, GEN_FIRST: tl.constexpr, SKIP: tl.constexpr):  # fmt: skip
    """The decode eviction of a row and KV head under a rule without positional pooling (the module's docstring):
    each slot's new score, the victim, and the row's bookkeeping written back (every slot's score, the victim's
    and the new token's validity and position). Returns ``(victim, chosen)``: the victim's slot, and whether it is
    evicted (the row holds more than its ``target`` and the victim is a valid slot). ``BW`` is ``pow2(W - 1)``."""
    sw, lmask, lslot, pos, valid = row_lanes(pos_ptr, valid_ptr, meta, m_ss, W, newslot, BW)
    stored = tl.load(score_ptr + meta + lslot * m_ss, mask=lmask, other=float("-inf"))
    stored_new = tl.load(score_ptr + meta + newslot * m_ss)
    count = tl.sum(valid.to(tl.int32), 0) + 1  # the kept slots and the new token
    always = newslot == newslot  # the new token is valid, and generated
    # 1. the method's decode score of every slot, and of the new token
    c = 1.0
    if RULE == 2:  # AhaKV's gain from the row's prompt length and budget
        c = sharpening_gain(plen_ptr, budget_ptr, mr, GAIN_FLOOR)
    if RULE == 3:  # TOVA: the mean over every query head of the layer
        new = tl.zeros([BW], tl.float32)
        new_s = tl.sum(new, 0)  # 0.0, a float32 scalar carried through the loop
        for hh in range(0, H):
            sig, sig_new = lane_signal(x_ptr, stat_ptr, r, hh, H, W, S, lslot, lmask, newslot, c, G, SP, BW, RULE,
                                       False)  # fmt: skip
            new += sig
            new_s += sig_new
        new = new / H
        new_s = new_s / H
    elif RULE <= 2 or RULE == 6:
        if SKIP & 16:  # timing only (SKIP_PARTS): the stored scores instead of this step's attention
            sig = tl.where(valid, stored, 0.0)
            sig_new = stored_new
        else:
            sig, sig_new = lane_signal(x_ptr, stat_ptr, r, h, H, W, S, lslot, lmask, newslot, c, G, SP, BW, RULE,
                                       GROUP_MAX)  # fmt: skip
        if RULE == 0:  # the current attention, not pooled
            new = sig
            new_s = sig_new
            if ZERO_WINDOW:  # the window's slots score 0 (CAKE's rule)
                new = tl.where((pos > newest - window) | (~valid), 0.0, new)
                new_s = tl.where(window > 0, 0.0, new_s)
        else:  # H2O's and AhaKV's accumulation, KVzip's running max: the new token is valid and generated
            new = rule_score(stored, sig, pos, valid, sw < 0, pinned, RULE, GEN_FIRST)
            new_s = rule_score(stored_new, sig_new, newest, always, always, pinned, RULE, GEN_FIRST)
    elif RULE == 7:  # KeyDiff: minus the cosine of each slot's key to the anchor, the mean unit key of the slots
        new, new_s = key_diversity(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr,
                                   block_size, valid_ptr, meta, m_ss, pool_ptr, r, h, H, W, newslot, lslot, lmask,
                                   valid, count, D, DP, BW, LB, QUANT)  # fmt: skip
    elif RULE == 8:  # Expected Attention: the softmax of the mapped queries' logits, group mean, value-weighted
        new, new_s = lane_signal(x_ptr, estat_ptr, r, h, H, W, S, lslot, lmask, newslot, c, G, SP, BW, RULE, False)
        if VNORM:
            nbase = norm_ptr + (r * H + h).to(tl.int64) * W
            new = (new + epsilon) * tl.load(nbase + lslot, mask=lmask, other=0.0)
            new_s = (new_s + epsilon) * tl.load(nbase + newslot)
    else:  # recency, SAGE-KV's pinned recency
        new = rule_score(stored, 0.0, pos, valid, sw < 0, pinned, RULE, GEN_FIRST)
        new_s = rule_score(stored_new, 0.0, newest, always, always, pinned, RULE, GEN_FIRST)
    # 2. the victim: the lowest-scored slot that is neither protected (window, sinks) nor empty
    guard, new_guarded = lane_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW)
    victim = lane_argmin(new, new_s, guard, new_guarded, lslot, newslot, W)
    victim_valid = (victim == newslot) | (tl.sum(((lslot == victim) & valid).to(tl.int32), 0) > 0)
    chosen = (count > target) & (target >= 0) & victim_valid
    # 3. every slot's score (the empty ones' too, as the torch step writes them), the victim's -inf; once every
    # thread has read the scores (the lanes are not the new token's slot, read apart, but a check by argument cannot
    # tell: tests/kernel_hazards.py)
    tl.debug_barrier()
    tl.store(score_ptr + meta + lslot * m_ss, tl.where((lslot == victim) & chosen, float("-inf"), new), mask=lmask)
    tl.store(score_ptr + meta + newslot * m_ss, tl.where(chosen & (victim == newslot), float("-inf"), new_s))
    settle_row(pos_ptr, valid_ptr, meta, m_ss, newslot, newest, victim, chosen)
    return victim, chosen
