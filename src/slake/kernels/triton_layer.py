"""The decode eviction across a layer's KV heads (``decode_scope="layer"``, :mod:`slake.methods.decode_scope`) in the
fused decode step (:mod:`slake.kernels.triton_decode`): the torch step's :func:`slake.cache.decode_step.layer_victims`
as a tail of the second kernel and a third kernel.

With it, a step appends one token to every KV head and evicts as many slots from the whole layer: the slots of the
heads over the layer's widest target (each such head's lowest, "forced"), then the lowest-scored unprotected slots
of the layer, at most one per KV head in all. One program per (row, KV head) cannot choose them alone, so the step
runs in three launches:

1. the first kernel, as for any rule;
2. the second kernel scores the row's slots with the method's rule and evicts nothing (it reads the row's target as
   -1); its tail, :func:`head_candidates`, reads the head's row back as it stored it and writes the head's ``H``
   lowest slots (``H`` the layer's KV heads, the most a step evicts: any slot the layer evicts is among its head's
   ``H`` lowest) and how many slots the head holds;
3. :func:`_layer_eviction_kernel`, one program per row: the layer's forced slots and its lowest among the ``H x H``
   candidates, evicted (validity, position, score).

Equal scores go in the order of the layer's slots, head by head (the torch step sorts stably), so that both choose
the same slots. No linear state is folded: :class:`~slake.methods.decode_scope.DecodeScope` refuses one. The
positional pooling sorts a row of the usual width at every step; over rows wider than ``launch_config.WIDE_SLOTS``
it reads the row's order buffer, from which the second kernel first drops the slots this kernel evicted since it
wrote the order (:func:`slake.kernels.triton_wide.wide_eviction`)."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels import launch_config as launch
from slake.kernels.triton_slots import slot_guard

__all__ = ["head_candidates"]

#: larger than any slot index or flat index of a layer's slots (an index "not found")
_NONE = tl.constexpr(2147483647)


@triton.jit
def _next_lowest(cv, cs, ok_c, bv, bs, ok_b):
    """The lowest ``(score, index)`` pair of two sets (``cv``/``cs`` where ``ok_c``, ``bv``/``bs`` where ``ok_b``),
    scores first, then indices: ``(score, index)``, the index :data:`_NONE` when both sets are empty."""
    low = tl.minimum(tl.min(tl.where(ok_c, cv, float("inf")), 0), tl.min(tl.where(ok_b, bv, float("inf")), 0))
    at = tl.minimum(
        tl.min(tl.where(ok_c & (cv == low), cs, _NONE), 0), tl.min(tl.where(ok_b & (bv == low), bs, _NONE), 0)
    )
    return low, at


@triton.jit
def head_candidates(pos_ptr, valid_ptr, score_ptr, meta, m_ss, cand_ptr, cslot_ptr, r, h, H, W, newest, window,
                    first, sinks, PROTECT_WINDOW: tl.constexpr, HP: tl.constexpr, TB: tl.constexpr):  # fmt: skip
    """The second kernel's tail under ``decode_scope="layer"``: the ``H`` lowest slots of row ``r``, KV head ``h``
    as the step left them (scores of the method's rule, the new token held, nothing evicted), ``+inf`` on protected
    and empty slots as the torch step ranks them, ties to the lower slot; written to ``cand_ptr`` (``(R, H, HP)``
    float32 scores) and ``cslot_ptr`` (``(R, H, HP + 1)`` int32: the slots, -1 where the row has fewer than ``H``,
    then the count of the row's valid slots). The row is read back in blocks of ``TB`` slots, a running set of
    ``H`` candidates merged with each."""
    tl.debug_barrier()  # the row's scores, validity and positions as this program's threads stored them
    jj = tl.arange(0, HP)
    cv = tl.full([HP], float("inf"), tl.float32)
    cs = tl.full([HP], -1, tl.int32)
    count = tl.sum(jj * 0, 0)  # 0, an int32 scalar carried through the loop
    for b0 in range(0, W, TB):
        sw = b0 + tl.arange(0, TB)
        inb = sw < W
        pos = tl.load(pos_ptr + meta + sw * m_ss, mask=inb, other=-1)
        valid = (tl.load(valid_ptr + meta + sw * m_ss, mask=inb, other=0) != 0) & inb
        score = tl.load(score_ptr + meta + sw * m_ss, mask=inb, other=0.0)
        ranked = tl.where(slot_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW), float("inf"), score)
        count += tl.sum(valid.to(tl.int32), 0)
        # the H lowest of the candidates so far and this block, one at a time: each the lowest pair above the last
        nv = tl.full([HP], float("inf"), tl.float32)
        ns = tl.full([HP], -1, tl.int32)
        pv = tl.min(tl.full([HP], float("-inf"), tl.float32), 0)  # -inf: a score of -inf too, then the slot decides
        ps = tl.sum(jj * 0, 0) - 1
        for j in range(0, H):
            ok_c = (cs >= 0) & ((cv > pv) | ((cv == pv) & (cs > ps)))
            ok_b = inb & ((ranked > pv) | ((ranked == pv) & (sw > ps)))
            low, at = _next_lowest(cv, cs, ok_c, ranked, sw, ok_b)
            found = at != _NONE
            nv = tl.where((jj == j) & found, low, nv)
            ns = tl.where((jj == j) & found, at, ns)
            pv = tl.where(found, low, pv)
            ps = tl.where(found, at, ps)
        cv = nv
        cs = ns
    base = (r * H + h).to(tl.int64)
    tl.store(cand_ptr + base * HP + jj, cv, mask=jj < H)
    tl.store(cslot_ptr + base * (HP + 1) + jj, cs, mask=jj < H)
    tl.store(cslot_ptr + base * (HP + 1) + HP, count)


@triton.jit(do_not_specialize=launch.UNSPECIALIZED)
def _layer_eviction_kernel(
    pos_ptr, valid_ptr, score_ptr, m_sr, m_sh, m_ss,
    rows_ptr, target_ptr, tg_sr, tg_sh,
    cand_ptr, cslot_ptr,
    W, H,
    HP: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """The layer's victims of row ``r`` (:func:`slake.cache.decode_step.layer_victims`), from the heads' candidates
    (:func:`head_candidates`): a head holding more slots than the layer's widest target gives its lowest slot (it
    ranks at ``-inf``); the row evicts ``max(sum(count) - sum(target), forced)`` slots (none when its target is
    -1), at most ``H``, the lowest ``(score, head * W + slot)`` pairs of the candidates, and only valid ones (a
    protected slot goes only when no other can, an empty one never)."""
    r = tl.program_id(0)
    mr = tl.load(rows_ptr + r).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    hh = tl.arange(0, HP)
    jj = tl.arange(0, HP)
    hmask = hh < H
    cmask = hmask[:, None] & (jj < H)[None, :]
    base = (r * H + hh).to(tl.int64)
    cv = tl.load(cand_ptr + base[:, None] * HP + jj[None, :], mask=cmask, other=float("inf"))
    cs = tl.load(cslot_ptr + base[:, None] * (HP + 1) + jj[None, :], mask=cmask, other=-1)
    count = tl.load(cslot_ptr + base * (HP + 1) + HP, mask=hmask, other=0).to(tl.int64)
    target = tl.load(target_ptr + mr * tg_sr + hh * tg_sh, mask=hmask, other=0).to(tl.int64)
    meta = mr * m_sr + hh.to(tl.int64) * m_sh
    live = cmask & (cs >= 0)
    held = tl.load(valid_ptr + meta[:, None] + cs * m_ss, mask=live, other=0) != 0
    cap = tl.max(tl.where(hmask, target, -(2**62)), 0)
    lowest_held = tl.sum(tl.where((jj == 0)[None, :] & held, 1, 0), 1) > 0
    forced = hmask & (count > cap) & lowest_held
    cv = tl.where(forced[:, None] & (jj == 0)[None, :], float("-inf"), cv)
    need = tl.maximum(tl.sum(count, 0) - tl.sum(target, 0), 0)
    need = tl.maximum(need, tl.sum(forced.to(tl.int64), 0))
    need = tl.where(tl.load(target_ptr + mr * tg_sr) >= 0, need, 0)
    flat = hh[:, None] * W + cs
    pv = tl.min(tl.full([HP], float("-inf"), tl.float32), 0)  # -inf: a forced slot's too, then the index decides
    pf = tl.sum(jj * 0, 0) - 1
    for j in range(0, H):
        ok = live & ((cv > pv) | ((cv == pv) & (flat > pf)))
        low = tl.min(tl.min(tl.where(ok, cv, float("inf")), 1), 0)
        at = tl.min(tl.min(tl.where(ok & (cv == low), flat, _NONE), 1), 0)
        found = at != _NONE
        gone = found & (j < need) & (tl.sum(tl.sum(tl.where((flat == at) & ok & held, 1, 0), 1), 0) > 0)
        slot = mr * m_sr + (at // W).to(tl.int64) * m_sh + (at % W).to(tl.int64) * m_ss
        tl.store(valid_ptr + slot, ~gone, mask=gone)
        tl.store(score_ptr + slot, float("-inf"), mask=gone)
        tl.store(pos_ptr + slot, -1, mask=gone)
        pv = tl.where(found, low, pv)
        pf = tl.where(found, at, pf)
