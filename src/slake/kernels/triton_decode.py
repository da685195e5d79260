"""The single-token decode step of one compressed layer as two Triton kernels (``docs/gpu.md#the-fused-decode-step``).

:func:`slake.cache.decode_step.decode_step` is the reference; these kernels compute the same step, with the row's
slots addressed through a block table (a dense ``(B, Hkv, n, d)`` store is one block per row; vLLM's paged cache is
its own block table) and arbitrary strides for keys and values:

1. :func:`_append_logits_kernel`, one program per (row, KV head, split of the row's slots), flash-decoding style:
   rows are cut into pieces of :func:`~slake.kernels.launch_config.split_size` slots so that a batch of one still
   occupies a GPU. The program whose piece holds the row's first free slot writes the new key/value there (quantised
   for 8-bit storage) and its metadata; every program computes the logits of the row's ``g`` query heads over its
   slots (``-inf`` where a slot is empty or hidden), written to a scratch buffer, and its partial softmax: each query
   head's maximum, normaliser and weighted sum of the values. With SLAKE's linear state, each program also reads its
   share of the state's ``d x d`` block (:func:`~slake.kernels.launch_config.state_rows` rows) and writes that share
   of the linear term's numerator, so that the state is read by several of the row's programs at once rather than by
   one.
2. :func:`_evict_attend_kernel`, one program per (row, KV head): the method's decode scores
   (:class:`slake.methods.decode_rule.FusedDecodeRule`, from the logits and the pieces' combined maxima and
   normalisers; the positional pooling ranks the slots by position, starting from the order the row's previous step
   left when it proves to hold, else with an in-program sort of int32 keys where the positions allow, and pools the
   ranked scores in registers with ``tl.gather``, no round trip through memory), the
   protected slots, the victim (the first minimum, as ``argmin``, found among the ranks after a pooling), the fold of
   the victim into the PTAA linear state (the block's ``k v^T`` as atomic adds, which need no read of it), the
   eviction, and the attention output: the pieces' partial sums combined, plus the linear term (the first kernel's
   shares, and the victim's rank-one part when it is folded first). A method that evicts before its output (SLAKE's
   Algorithm 1) has the victim's piece summed again without it, in float32 whatever the cache's dtype (half-precision
   operands there cost the kernel its registers: it spilled at Llama-3-8B's shape in bfloat16),
   :data:`~slake.kernels.launch_config.RECOMPUTE_BLOCK` slots at a time; optionally the layer's position counter.

A rule that reads the step's queries through a fixed map (Expected Attention) has the first kernel compute its
logits and softmax statistics beside the attention's, and each slot's value norm. CriticalKV's two stages weigh
the slots by their projected value norms: the new slot's is computed between the two kernels by
:func:`_value_projection_kernel` (a third launch, reading ``W_o`` once), the others are kept per slot.

An eviction across a layer's KV heads (``decode_scope="layer"``) has the second kernel evict nothing and write
each head's lowest slots, and a third kernel choose the layer's victims among them (:mod:`slake.kernels.triton_layer`).

Two launches per layer and step (three for CriticalKV, and across a layer's heads); nothing is read back to the host
and every buffer address is an argument, so the kernels are graph-safe. The launcher is a custom operator
(``torch.library.custom_op``, ``slake::fused_decode_step``, with a fake implementation) so that ``torch.compile``
captures it as one opaque node with declared mutations instead of breaking the graph (an opaque op rather than
``triton_op``: tracing into the kernels is what Triton's interpreter cannot do, and there is nothing for inductor to
fuse around them). On a machine without CUDA the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``,
set by :mod:`slake.kernels` before this module is imported), which is how the tests check them against the torch
step. The first kernel lives in :mod:`slake.kernels.triton_attend`, the kernels' reads and writes of slots in
:mod:`slake.kernels.triton_slots`, the decode rules' per-slot signals (and CriticalKV's projection kernel) in
:mod:`slake.kernels.triton_rules`, the positional pooling of SnapKV's, CAKE's and SLAKE's rule in
:mod:`slake.kernels.triton_pooling`, the launch configuration (how rows are cut, warps, blocks, and the switches that
time the kernels) in :mod:`slake.kernels.launch_config`, a step's launch plan, scratch and runs of arguments in
:mod:`slake.kernels.step_plan`, the launches that skip Triton's per-call argument binding on a GPU in
:mod:`slake.kernels.launch_cache`, eager decoding's held steps in :mod:`slake.kernels.held_step`, and the eviction
across a layer's KV heads in :mod:`slake.kernels.triton_layer`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from slake.kernels import launch_cache
from slake.kernels import launch_config as launch
from slake.kernels.device_support import launch_device
from slake.kernels.step_plan import RULE_CODES, LaunchPlan, Run, Scratch, launch_plan, launch_runs, scratch_specs
from slake.kernels.triton_attend import _append_logits_kernel, attend_block
from slake.kernels.triton_eviction import rule_eviction
from slake.kernels.triton_layer import _layer_eviction_kernel, head_candidates
from slake.kernels.triton_pooling import pool_by_position, pooled_eviction, position_order
from slake.kernels.triton_rules import (
    _value_projection_kernel,
    head_signal,
    key_diversity,
    rule_score,
    sharpening_gain,
    two_stage,
)
from slake.kernels.triton_slots import load_queries, load_row, slot_guard
from slake.kernels.triton_wide import wide_eviction

__all__ = ["RULE_CODES", "fused_step", "fused_step_op"]


@triton.jit(do_not_specialize=launch.UNSPECIALIZED)
def _evict_attend_kernel(
    q_ptr, q_sr, q_sh, q_sd,
    k_ptr, k_sb, k_sh, k_so, k_sd,
    v_ptr, v_sb, v_sh, v_so, v_sd,
    ks_ptr, vs_ptr, s_sb, s_sh, s_so,
    table_ptr, t_sr, block_size,
    rows_ptr,
    pos_ptr, valid_ptr, score_ptr, m_sr, m_sh, m_ss,
    target_ptr, tg_sr, tg_sh,
    plen_ptr, budget_ptr, first_ptr,
    aug_ptr, a_sr, a_sh, a_si, a_sj,
    x_ptr, stat_ptr, part_ptr, newslot_ptr, pool_ptr, order_ptr,
    out_ptr, o_sr, o_sh, o_sd,
    counter_ptr,
    estat_ptr, norm_ptr, wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, lin_ptr, cand_ptr, cslot_ptr,
    W, H, S, scale, window, sinks, pinned, epsilon, two_eps, ratio_hi, ratio_mid, ratio_lo,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SP: tl.constexpr, BW: tl.constexpr, LB: tl.constexpr, QUANT: tl.constexpr,
    LOW_DOT: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_FIRST: tl.constexpr, HAS_LINEAR: tl.constexpr, RULE: tl.constexpr, GROUP_MAX: tl.constexpr,
    POOL_K: tl.constexpr, POOL_MAX: tl.constexpr, ZERO_WINDOW: tl.constexpr, GAIN_FLOOR: tl.constexpr,
    PROTECT_WINDOW: tl.constexpr, EVICT_FIRST: tl.constexpr, ADVANCE: tl.constexpr,
    VNORM: tl.constexpr, TWO_STAGE: tl.constexpr, NBP: tl.constexpr, GEN_FIRST: tl.constexpr,
    COMBINE: tl.constexpr, VB: tl.constexpr, SKIP: tl.constexpr, GC: tl.constexpr, KEY_SPAN: tl.constexpr,
    POOL_GATHER: tl.constexpr, HELD_ORDER: tl.constexpr, APART: tl.constexpr, WIDE: tl.constexpr,
    WB: tl.constexpr, RB: tl.constexpr, LAYER: tl.constexpr, HP: tl.constexpr, TB: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    mr = tl.load(rows_ptr + r).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    meta = mr * m_sr + h * m_sh
    newslot = tl.load(newslot_ptr + r * H + h)
    newest = tl.load(pos_ptr + meta + newslot * m_ss)
    if HAS_FIRST:
        first = tl.load(first_ptr + mr)
    else:
        first = 0
    target = tl.load(target_ptr + mr * tg_sr + h * tg_sh)
    if LAYER:  # the eviction across the layer's KV heads comes after this kernel (triton_layer): none here
        target = target * 0 - 1
    # With APART (every rule but CriticalKV's two stages) the row's kept slots are in vectors of pow2(W - 1) and the
    # new token is apart, so a row of budget + 1 slots is not padded to twice its width: SnapKV's, CAKE's and SLAKE's
    # positional pooling in registers (triton_pooling), its order by position the one the row's previous step left
    # when that proves to hold (HELD_ORDER), else sorted; the other rules in triton_eviction. CriticalKV's two
    # stages, and without APART (or POOL_GATHER: timing only) every rule: the row's slots, the new token's among
    # them, padded to pow2(W)
    RANKED: tl.constexpr = RULE == 0 and POOL_K > 1 and not TWO_STAGE and POOL_GATHER and APART
    PLAIN: tl.constexpr = (RULE != 0 or POOL_K == 1) and not TWO_STAGE and APART
    HELD: tl.constexpr = HELD_ORDER and (SKIP & 1) == 0
    KEEP: tl.constexpr = RULE == 9  # step_plan.KEEP_ALL: a layer that does not evict at decode (a target of -1)
    if KEEP:  # no score, no victim: the new slot made valid (the first kernel wrote its position and score 0)
        victim = newslot
        chosen = newslot < 0  # False
        tl.store(valid_ptr + meta + newslot * m_ss, newslot >= 0)
    elif WIDE:  # rows wider than launch_config.WIDE_SLOTS: read in blocks of WB slots (triton_wide)
        victim, chosen = wide_eviction(
            k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
            pos_ptr, valid_ptr, score_ptr, order_ptr, meta, m_ss, x_ptr, stat_ptr, estat_ptr, norm_ptr, pool_ptr,
            plen_ptr, budget_ptr, r, h, mr, H, W, S, newslot, newest, window, first, sinks, target, pinned, epsilon,
            wt_ptr, w_sr, w_sh, w_ss, pw_ptr, NB, two_eps, ratio_hi, ratio_mid, ratio_lo,
            G, GC, SP, BW, D, DP, LB, QUANT, RULE, GROUP_MAX, POOL_K, POOL_MAX, ZERO_WINDOW, GAIN_FLOOR,
            PROTECT_WINDOW, VNORM, GEN_FIRST, HELD, WB, RB, TWO_STAGE, GP, NBP, LAYER,
        )  # fmt: skip
    elif RANKED:
        victim, chosen = pooled_eviction(
            pos_ptr, valid_ptr, score_ptr, order_ptr, meta, m_ss, x_ptr, stat_ptr, r, h, H, W, S,
            newslot, newest, window, first, sinks, target,
            G, SP, BW, GROUP_MAX, POOL_K, POOL_MAX, ZERO_WINDOW, PROTECT_WINDOW, KEY_SPAN, HELD, SKIP,
        )  # fmt: skip
    elif PLAIN:
        victim, chosen = rule_eviction(
            k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
            pos_ptr, valid_ptr, score_ptr, meta, m_ss, x_ptr, stat_ptr, estat_ptr, norm_ptr, pool_ptr,
            plen_ptr, budget_ptr, r, h, mr, H, W, S, newslot, newest, window, first, sinks, target, pinned, epsilon,
            G, SP, BW, D, DP, LB, QUANT, RULE, GROUP_MAX, ZERO_WINDOW, GAIN_FLOOR, PROTECT_WINDOW, VNORM, GEN_FIRST,
            SKIP,
        )  # fmt: skip
    else:
        sw = tl.arange(0, BW)
        wmask = sw < W
        pos = tl.load(pos_ptr + meta + sw * m_ss, mask=wmask, other=-1)
        valid = ((tl.load(valid_ptr + meta + sw * m_ss, mask=wmask, other=0) != 0) | (sw == newslot)) & wmask
        stored = tl.load(score_ptr + meta + sw * m_ss, mask=wmask, other=float("-inf"))
        count = tl.sum(valid.to(tl.int32), 0)
        # 1. the method's decode score of every slot
        c = 1.0
        if RULE == 2:  # AhaKV's gain from the row's prompt length and budget
            c = sharpening_gain(plen_ptr, budget_ptr, mr, GAIN_FLOOR)
        if RULE == 3:  # TOVA: the mean over every query head of the layer
            sig = tl.zeros([BW], tl.float32)
            for hh in range(0, H):
                sig += head_signal(x_ptr, stat_ptr, r, hh, H, W, S, sw, wmask, c, G, SP, BW, RULE, False)
            new = sig / H
        elif RULE <= 2 or RULE == 6:
            if SKIP & 16:  # timing only (SKIP_PARTS): the stored scores instead of this step's attention
                sig = tl.where(valid, stored, 0.0)
            else:
                sig = head_signal(x_ptr, stat_ptr, r, h, H, W, S, sw, wmask, c, G, SP, BW, RULE, GROUP_MAX)
            if RULE == 0:
                new = sig
                if ZERO_WINDOW:  # the window's slots contribute 0 to their neighbours' pooling (CAKE)
                    new = tl.where((pos > newest - window) | (~valid), 0.0, new)
            else:  # H2O's and AhaKV's accumulation, KVzip's running max
                new = rule_score(stored, sig, pos, valid, sw == newslot, pinned, RULE, GEN_FIRST)
        elif RULE == 7:  # KeyDiff: minus the cosine of each slot's key to the anchor, the mean unit key of the slots
            new, _ = key_diversity(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr,
                                    block_size, valid_ptr, meta, m_ss, pool_ptr, r, h, H, W, newslot, sw, wmask, valid,
                                    count, D, DP, BW, LB, QUANT)  # fmt: skip
        elif RULE == 8:  # Expected Attention: the softmax of the mapped queries' logits, group mean, value-weighted
            new = head_signal(x_ptr, estat_ptr, r, h, H, W, S, sw, wmask, c, G, SP, BW, RULE, False)
            if VNORM:
                vnorm = tl.load(norm_ptr + (r * H + h).to(tl.int64) * W + sw, mask=wmask, other=0.0)
                new = (new + epsilon) * vnorm
        else:  # recency, SAGE-KV's pinned recency
            new = rule_score(stored, 0.0, pos, valid, sw == newslot, pinned, RULE, GEN_FIRST)
        # positional pooling in slot order (CriticalKV's two stages need the pooled scores there; without
        # POOL_GATHER or APART, timing only, the pooling of before, through memory, or the new token among the
        # slots): the slots sorted by position, pooled, and back in slot order through the row's scratch buffer
        if RULE == 0 and POOL_K > 1:
            if SKIP & 1:  # timing only (SKIP_PARTS): the slots' own order
                order = sw
            else:
                order = position_order(pos, valid, wmask, sw, BW, KEY_SPAN)
            base = pool_ptr + (r * H + h).to(tl.int64) * 2 * BW
            new = pool_by_position(new, valid, order, count, base, W, sw, wmask, BW, POOL_K, POOL_MAX, POOL_GATHER)
            if POOL_GATHER:  # ranked: back to slot order
                tl.store(base + order, new, mask=order < W)
                tl.debug_barrier()
                new = tl.load(base + sw, mask=wmask, other=0.0)
        # 2. the victim: the lowest-scored slot that is neither protected (window, sinks) nor empty
        guard = slot_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW)
        if TWO_STAGE:
            new = two_stage(new, valid, guard & valid, sw, wmask, newslot, r, h, mr, H, wt_ptr, w_sr, w_sh, w_ss,
                            pw_ptr, NB, two_eps, ratio_hi, ratio_mid, ratio_lo, G, GP, NBP)  # fmt: skip
        victim = tl.argmin(tl.where(guard, float("inf"), new), 0)
        hit = sw == victim
        chosen = (count > target) & (target >= 0) & (tl.sum((hit & valid).to(tl.int32), 0) > 0)
        gone = hit & chosen
        tl.store(score_ptr + meta + sw * m_ss, tl.where(gone, float("-inf"), new), mask=wmask)
        tl.store(valid_ptr + meta + sw * m_ss, valid & (~gone), mask=wmask)
        tl.store(pos_ptr + meta + sw * m_ss, tl.where(gone, -1, pos), mask=wmask)
    # 3. the fold of the victim into the linear state
    dd = tl.arange(0, DP)
    dmask = dd < D
    g = tl.arange(0, GP)  # the query heads as the rows of a tl.dot operand (at least 16: the victim's piece)
    gmask = g < G
    gc = tl.arange(0, GC)  # the query heads as the rows of everything else (a power of two, G = 4 rows: not 16)
    gcmask = gc < G
    q = load_queries(q_ptr, r, q_sr, q_sh, q_sd, h, gc, gcmask, dd, dmask, G) * scale
    vb = tl.load(table_ptr + r * t_sr + victim // block_size).to(tl.int64)
    vo = (victim % block_size).to(tl.int64)
    vs = vb * s_sb + h * s_sh + vo * s_so
    kv_k = load_row(k_ptr, vb * k_sb + h * k_sh + vo * k_so, dd * k_sd, dmask, ks_ptr, vs, QUANT)
    kv_v = load_row(v_ptr, vb * v_sb + h * v_sh + vo * v_so, dd * v_sd, dmask, vs_ptr, vs, QUANT)
    if HAS_LINEAR:
        # The first kernel read the state's D x D block ``L`` (its programs' shares of ``s q^T L``, summed below with
        # the pieces); here the victim's key and value are folded in: the augmented row and column (``k_sum``,
        # ``v_sum``, the count) read and written back, and ``L += k v^T`` as atomic adds, which need no read of the
        # block (one program per row and KV head: nothing else adds to it). With the fold before the output
        # (SLAKE's Algorithm 1) the output sees ``s q^T (L + k v^T)``: the shares plus ``(s q . k) v``.
        abase = aug_ptr + mr * a_sr + h * a_sh
        ksum = tl.load(abase + dd * a_si + D * a_sj, mask=dmask, other=0.0)
        vsum = tl.load(abase + D * a_si + dd * a_sj, mask=dmask, other=0.0)
        cnt = tl.load(abase + D * a_si + D * a_sj)
        cf = chosen.to(tl.float32)
        ksum2 = ksum + kv_k * cf  # [k c, c]^T [v, 1] (LinearState.fold_buffered)
        vsum2 = vsum + cf * kv_v
        cnt2 = cnt + cf
        # every thread's reads of the row, column and count done before any is written back: a layout may give an
        # element to threads of two warps (128 over 8 warps' 256 threads), and one that loaded after the other's store
        # would fold the victim in twice (a race tests/kernel_hazards.py found in the compiled kernel)
        tl.debug_barrier()
        tl.store(abase + dd * a_si + D * a_sj, ksum2, mask=dmask & chosen)
        tl.store(abase + D * a_si + dd * a_sj, vsum2, mask=dmask & chosen)
        tl.store(abase + D * a_si + D * a_sj, cnt2, mask=chosen)
        for i0 in tl.static_range(0, DP if (SKIP & 2) == 0 and not KEEP else 0, LB):  # SKIP & 2: timing, no fold
            ii = i0 + tl.arange(0, LB)
            imask = ii < D
            k_i = load_row(k_ptr, vb * k_sb + h * k_sh + vo * k_so, ii * k_sd, imask, ks_ptr, vs, QUANT)
            tl.atomic_add(
                abase + ii[:, None] * a_si + dd[None, :] * a_sj,
                k_i[:, None] * kv_v[None, :],
                mask=imask[:, None] & dmask[None, :] & chosen,
                sem="relaxed",
            )
        lin = tl.zeros([GC, DP], tl.float32)
        if EVICT_FIRST:
            lin += (tl.sum(q * kv_k[None, :], 1) * cf)[:, None] * kv_v[None, :]
            ksum, vsum, cnt = ksum2, vsum2, cnt2
    # 4. the output: the first kernel's partial softmax sums of every split, combined; when the victim is evicted
    # before the output, its split is summed again here without it (subtracting its term instead would cancel
    # catastrophically when it held most of a query head's weight)
    RECOMPUTE: tl.constexpr = EVICT_FIRST and (SKIP & 4) == 0  # SKIP & 4: timing only, the piece as stored
    if RECOMPUTE:
        vlo = (victim // SPLIT) * SPLIT
        vhi = tl.minimum(vlo + SPLIT, W)
        m_v = tl.full([GP], -3.4028234663852886e38, tl.float32)
        den_v = tl.zeros([GP], tl.float32)
        acc_v = tl.zeros([GP, DP], tl.float32)
        xbase = (r * H + h).to(tl.int64) * G * W
        for s0 in range(vlo, vhi, VB):
            s = s0 + tl.arange(0, VB)
            ok = s < vhi
            x = tl.load(
                x_ptr + xbase + g[:, None] * W + s[None, :], mask=gmask[:, None] & ok[None, :], other=float("-inf")
            )
            x = tl.where(((s == victim) & chosen)[None, :], float("-inf"), x)
            b = tl.load(table_ptr + r * t_sr + s // block_size, mask=ok, other=0).to(tl.int64)
            o = (s % block_size).to(tl.int64)
            m_v, den_v, acc_v = attend_block(
                m_v, den_v, acc_v, x, b, o, ok, h, dd, dmask,
                v_ptr, v_sb, v_sh, v_so, v_sd, vs_ptr, s_sb, s_sh, s_so, QUANT, LOW_DOT,
            )  # fmt: skip
        # the piece in the combination's GC rows: rows G.. of the GP are padding (maximum -3.4e38, normaliser and
        # sums 0), so the GP rows taken GC at a time and summed (maximised) are the GC rows
        m_v = tl.max(tl.reshape(m_v, [GP // GC, GC]), 0)
        den_v = tl.sum(tl.reshape(den_v, [GP // GC, GC]), 0)
        acc_v = tl.sum(tl.reshape(acc_v, [GP // GC, GC, DP]), 0)
    # the combination works on the G query heads' rows (GC), a quarter of the GP a tl.dot needs at G = 4: it runs
    # once per piece, 17 pieces at batch 1 and budget 1,024
    m_run = tl.full([GC], -3.4028234663852886e38, tl.float32)
    den = tl.zeros([GC], tl.float32)
    acc = tl.zeros([GC, DP], tl.float32)
    # the pieces in order, COMBINE at a time: their loads do not depend on each other, so an unrolled group keeps
    # COMBINE of them in flight instead of one round trip to memory per piece (a piece past the last adds nothing)
    for s0 in range(0, S if (SKIP & 8) == 0 else 0, COMBINE):  # SKIP & 8: timing only, no piece combined
        for nth in tl.static_range(COMBINE):
            sp = s0 + nth
            live = sp < S
            sb = (((r * H + h) * G + gc) * S + sp) * 2
            pm = tl.load(stat_ptr + sb, mask=gcmask & live, other=-3.4028234663852886e38)
            pl = tl.load(stat_ptr + sb + 1, mask=gcmask & live, other=0.0)
            pb = (((r * H + h) * S + sp) * G + gc).to(tl.int64) * D
            live_rows = (gcmask & live)[:, None] & dmask[None, :]
            pa = tl.load(part_ptr + pb[:, None] + dd[None, :], mask=live_rows, other=0.0)
            if HAS_LINEAR:  # the first kernel's shares of the linear term
                lin += tl.load(lin_ptr + pb[:, None] + dd[None, :], mask=live_rows, other=0.0)
            if RECOMPUTE:
                mine = sp * SPLIT == vlo
                pm = tl.where(mine, m_v, pm)
                pl = tl.where(mine, den_v, pl)
                pa = tl.where(mine, acc_v, pa)
            m_new = tl.maximum(m_run, pm)
            a_run = tl.exp(m_run - m_new)
            a_new = tl.exp(pm - m_new)
            acc = acc * a_run[:, None] + pa * a_new[:, None]
            den = den * a_run + pl * a_new
            m_run = m_new
    if HAS_LINEAR:
        qk = tl.sum(q * ksum[None, :], 1)  # s q . k_sum
        mu = tl.where(cnt > 0, qk / cnt, -3.4028234663852886e38)
        lin = lin + (1.0 - mu)[:, None] * vsum[None, :]  # s q^T L (above) + (1 - mu) v_sum
        m = tl.maximum(m_run, mu)
        alpha = tl.exp(m_run - m)
        lam = tl.exp(mu - m)
        acc = acc * alpha[:, None] + lam[:, None] * lin
        den = den * alpha + lam * cnt
    out = acc / tl.maximum(den, 1.1754943508222875e-38)[:, None]
    tl.store(
        out_ptr + r * o_sr + (h * G + gc)[:, None] * o_sh + dd[None, :] * o_sd,
        out.to(out_ptr.dtype.element_ty),
        mask=gcmask[:, None] & dmask[None, :],
    )
    if ADVANCE:  # the layer's position counter (read by no program of this kernel: the new slot holds it)
        if (r == 0) & (h == 0):
            tl.store(counter_ptr, newest + 1)
    if LAYER:  # the head's lowest slots, for the third kernel's choice across the layer's KV heads
        head_candidates(pos_ptr, valid_ptr, score_ptr, meta, m_ss, cand_ptr, cslot_ptr, r, h, H, W, newest, window,
                        first, sinks, PROTECT_WINDOW, HP, TB)  # fmt: skip


_MUTATED = (
    "k_mem", "v_mem", "k_scale", "v_scale", "positions", "valid", "scores", "order", "head_visible", "aug", "counter",
    "weights",
)  # fmt: skip


def fused_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_mem: torch.Tensor,
    v_mem: torch.Tensor,
    k_strides: list[int],
    v_strides: list[int],
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    s_strides: list[int],
    table: torch.Tensor,
    block_size: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    scores: torch.Tensor,
    order: torch.Tensor,
    head_visible: torch.Tensor,
    newest: torch.Tensor,
    target: torch.Tensor,
    prompt_len: torch.Tensor,
    budget: torch.Tensor,
    first_real: torch.Tensor,
    aug: torch.Tensor,
    counter: torch.Tensor,
    query_map: torch.Tensor,
    weights: torch.Tensor,
    out_proj: torch.Tensor,
    width: int,
    scaling: float,
    window: int,
    sinks: int,
    pinned: float,
    epsilon: float,
    two_stage_epsilon: float,
    ratio: float,
    flags: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One decode step of one layer for ``R`` rows (:mod:`slake.kernels.triton_decode`); returns ``(R, Hq, d)``.

    ``flags``: ``[quant, low_dot, has_rows, has_hv, has_first, has_linear, rule, group_max, pool_kernel, pool_max,
    zero_window, gain_floor, protect_window, evict_first, advance, value_norm, two_stage, generated_first,
    held_order, across_heads]`` (the kernels' constexprs; ``rule`` a code of :data:`RULE_CODES`, or
    :data:`~slake.kernels.step_plan.KEEP_ALL` for a layer that does not evict). Tensors a flag turns off are passed
    as empty placeholders. The metadata tensors ``(P, Hkv, >= width)`` share their strides: ``positions``,
    ``valid``, ``scores`` and, with ``held_order``, ``order`` (int32: each row's slots in position order as the last
    step left them, read by the positional pooling when it proves to hold,
    :func:`slake.kernels.triton_pooling.listed_lanes`; any content is safe). ``query_map``: the ``(d, d)`` map of
    the ``expected_attention`` rule; ``weights`` ``(P, Hkv, >= width)`` and ``out_proj`` ``(hidden, Hq * d)``: the
    slot weights and the output projection of a two-stage rule (a third kernel projects the new values); ``ratio``:
    the two stages' ratio."""
    R, Hq, d = query.shape
    H = key.shape[1]
    W = int(width)
    p = launch_plan(R, Hq, d, H, W, tuple(flags), out_proj.shape[0] if flags[16] else 0, ratio)
    dev = query.device
    scratch = [None if spec is None else torch.empty(spec[0], dtype=spec[1], device=dev) for spec in
               scratch_specs(p, R, Hq, H, W, d)]  # fmt: skip
    out = torch.empty(R, Hq, d, dtype=out_dtype, device=dev)
    _launch_joined(p, query, key, value, out, *launch_runs(p, Scratch.of(scratch), H, (
        k_mem, v_mem, k_strides, v_strides, k_scale, v_scale, s_strides, table, block_size, rows, positions, valid,
        scores, order, head_visible, newest, target, prompt_len, budget, first_real, aug, counter, query_map, weights,
        out_proj, W, scaling, window, sinks, pinned, epsilon, two_stage_epsilon,
    )))  # fmt: skip
    return out


def launch_step(
    p: LaunchPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    append: Run,
    projection: Run,
    evict_before_out: Run,
    evict_after_out: Run,
    layer: Run,
) -> None:
    """Launch a step's kernels with the runs of :func:`launch_runs` (tuples, or
    :class:`~slake.kernels.launch_cache.Fixed` runs made once) and the step's ``query``, ``key``, ``value`` and
    ``out`` put in their places."""
    qs = query.stride()
    with launch_device(query):  # Triton launches on the current device; a layer may sit on another GPU
        launch_cache.launch_parts(
            _append_logits_kernel, p.append_grid, ((query, *qs, key, *key.stride(), value, *value.stride()), append),
            p.append_constants,
        )  # fmt: skip
        if p.two_stage:
            launch_cache.launch_parts(
                _value_projection_kernel, p.projection_grid, (projection,), p.projection_constants
            )
        launch_cache.launch_parts(
            _evict_attend_kernel, p.evict_grid, ((query, *qs), evict_before_out, (out, *out.stride()), evict_after_out),
            p.evict_constants,
        )  # fmt: skip
        if p.layer:
            launch_cache.launch_parts(_layer_eviction_kernel, p.layer_grid, (layer,), p.layer_constants)


def _launch_joined(
    p: LaunchPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    append: tuple,
    projection: tuple,
    evict_before_out: tuple,
    evict_after_out: tuple,
    layer: tuple,
) -> None:
    """:func:`launch_step` for runs made for this step (tuples): each launch's arguments joined into one tuple and
    launched with :func:`~slake.kernels.launch_cache.launch` (its key made once over the whole), the step's
    ``query``, ``key``, ``value`` and ``out`` in the places :func:`launch_step` puts them."""
    qs = query.stride()
    head = (query, *qs, key, *key.stride(), value, *value.stride())
    evict = (query, *qs, *evict_before_out, out, *out.stride(), *evict_after_out)
    with launch_device(query):
        launch_cache.launch(_append_logits_kernel, p.append_grid, head + append, p.append_constants)
        if p.two_stage:
            launch_cache.launch(_value_projection_kernel, p.projection_grid, projection, p.projection_constants)
        launch_cache.launch(_evict_attend_kernel, p.evict_grid, evict, p.evict_constants)
        if p.layer:
            launch_cache.launch(_layer_eviction_kernel, p.layer_grid, layer, p.layer_constants)


#: the same as a custom operator with declared mutations, for ``torch.compile`` (captured as one node, no graph
#: break). Eager code calls :func:`fused_step` directly: the operator's Python dispatch (its argument defaults and
#: mutation bookkeeping over 30-odd arguments) cost about 0.35 ms per call on a CPU host, more than the rest of a
#: layer's eager decode step together (``docs/gpu.md``).
fused_step_op = custom_op("slake::fused_decode_step", fused_step, mutates_args=_MUTATED)


@fused_step_op.register_fake
def _(query, key, value, *args) -> torch.Tensor:
    """The op's output for tracing (``torch.compile``): ``(R, Hq, d)`` in ``out_dtype``."""
    return query.new_empty(query.shape, dtype=args[-1])
