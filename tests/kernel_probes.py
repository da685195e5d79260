"""Small Triton kernels that run one of the fused kernels' helpers (:mod:`slake.kernels.triton_pooling`) on a row,
for ``tests/test_fused_decode.py``. Import only after :func:`slake.kernels.load` (which switches Triton's
interpreter on where there is no GPU).

The lanes of a row of ``W`` slots whose new token is in slot ``newslot`` (:func:`slake.kernels.triton_pooling
.pooled_eviction`): lane ``i`` holds slot ``i``, lane ``newslot`` the row's last slot ``W - 1``, and the new token is
apart."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels.triton_eviction import lane_argmin
from slake.kernels.triton_pooling import held_lanes, lane_victim, listed_lanes, pool_lanes, position_order


@triton.jit
def order_kernel(pos_ptr, valid_ptr, out_ptr, W, BW: tl.constexpr, KEY_SPAN: tl.constexpr):
    """``out[:BW]`` = :func:`position_order` of a row of ``W`` slots (positions int64, validity int8)."""
    sw = tl.arange(0, BW)
    wmask = sw < W
    pos = tl.load(pos_ptr + sw, mask=wmask, other=-1)
    valid = (tl.load(valid_ptr + sw, mask=wmask, other=0) != 0) & wmask
    tl.store(out_ptr + sw, position_order(pos, valid, wmask, sw, BW, KEY_SPAN))


@triton.jit
def _lanes(pos_ptr, valid_ptr, W, newslot, BW: tl.constexpr):
    """A row's lanes: ``(sw, lslot, lmask, pos, valid)``, positions and validity of the slots they hold."""
    sw = tl.arange(0, BW)
    lmask = sw < W - 1
    lslot = tl.where(sw == newslot, W - 1, sw)
    pos = tl.load(pos_ptr + lslot, mask=lmask, other=-1)
    valid = (tl.load(valid_ptr + lslot, mask=lmask, other=0) != 0) & lmask
    return sw, lslot, lmask, pos, valid


@triton.jit
def victim_kernel(scores_ptr, guard_ptr, order_ptr, out_ptr, W, held, newslot, BW: tl.constexpr):
    """``out[0]`` = :func:`lane_victim` of a row of ``W`` slots (``scores`` and ``guard``, int8, in slot order) with
    its lanes ranked by ``order``, whose first ``held`` ranks are read; ``out[1]`` = :func:`lane_argmin` of the same
    row, its lanes in their own order."""
    sw = tl.arange(0, BW)
    lslot = tl.where(sw == newslot, W - 1, sw)
    lmask = sw < W - 1
    order = tl.load(order_ptr + sw)
    guard = tl.load(guard_ptr + lslot, mask=lmask, other=1) != 0
    oslot = tl.gather(lslot, order, 0)
    pooled = tl.load(scores_ptr + oslot, mask=oslot < W, other=0.0)
    new_guarded = tl.load(guard_ptr + newslot) != 0
    new_score = tl.load(scores_ptr + newslot)
    tl.store(out_ptr, lane_victim(pooled, new_score, guard, new_guarded, order, oslot, held, newslot, W, sw))
    lane_scores = tl.load(scores_ptr + lslot, mask=lmask, other=0.0)
    tl.store(out_ptr + 1, lane_argmin(lane_scores, new_score, guard | (~lmask), new_guarded, lslot, newslot, W))


@triton.jit
def listed_kernel(buf_ptr, pos_ptr, valid_ptr, out_ptr, holds_ptr, W, newslot, BW: tl.constexpr):
    """``holds[0]``, ``out[:BW]`` = :func:`listed_lanes` of a row of ``W`` slots (positions int64, validity int8 of
    the kept slots; the new token in ``newslot``) with the buffer ``buf`` (int32); ``out`` as slots."""
    sw, lslot, lmask, pos, valid = _lanes(pos_ptr, valid_ptr, W, newslot, BW)
    held = tl.sum(valid.to(tl.int32), 0)
    newest = tl.load(pos_ptr + newslot)
    holds, order = listed_lanes(buf_ptr, 0, 1, pos, valid, sw, newslot, newest, held, W - 1, BW)
    tl.store(out_ptr + sw, tl.gather(lslot, order, 0))
    tl.store(holds_ptr, holds.to(tl.int32))


@triton.jit
def pool_kernel(scores_ptr, pos_ptr, valid_ptr, out_ptr, W, newslot, BW: tl.constexpr, KEY_SPAN: tl.constexpr,
                POOL_K: tl.constexpr, POOL_MAX: tl.constexpr):  # fmt: skip
    """``out[:W]`` = the pooled scores of a row of ``W`` slots (scores, positions int64, validity int8 of the kept
    slots; the new token in ``newslot``, at any position) by slot, the lanes sorted (:func:`held_lanes` without a
    held order) and pooled with the new token apart (:func:`pool_lanes`); the empty slots' entries untouched."""
    sw, lslot, lmask, pos, valid = _lanes(pos_ptr, valid_ptr, W, newslot, BW)
    held = tl.sum(valid.to(tl.int32), 0)
    newest = tl.load(pos_ptr + newslot)
    order, rank = held_lanes(0, 0, 1, pos, valid, lmask, lslot, sw, newslot, newest, held, W - 1, BW, KEY_SPAN, False)
    scores = tl.load(scores_ptr + lslot, mask=lmask, other=0.0)
    pooled, new_pooled = pool_lanes(scores, tl.load(scores_ptr + newslot), valid, order, held, rank, W, W - 1, sw,
                                    BW, POOL_K, POOL_MAX)  # fmt: skip
    tl.store(out_ptr + tl.gather(lslot, order, 0), pooled, mask=sw < held)
    tl.store(out_ptr + newslot, new_pooled)
