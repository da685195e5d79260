"""Small Triton kernels that run one of the fused kernels' helpers (:mod:`slake.kernels.triton_rules`) on a row,
for ``tests/test_fused_decode.py``. Import only after :func:`slake.kernels.load` (which switches Triton's
interpreter on where there is no GPU)."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels.triton_rules import listed_order, position_order, ranked_argmin


@triton.jit
def order_kernel(pos_ptr, valid_ptr, out_ptr, W, BW: tl.constexpr, KEY_SPAN: tl.constexpr):
    """``out[:BW]`` = :func:`position_order` of a row of ``W`` slots (positions int64, validity int8)."""
    sw = tl.arange(0, BW)
    wmask = sw < W
    pos = tl.load(pos_ptr + sw, mask=wmask, other=-1)
    valid = (tl.load(valid_ptr + sw, mask=wmask, other=0) != 0) & wmask
    tl.store(out_ptr + sw, position_order(pos, valid, wmask, sw, BW, KEY_SPAN))


@triton.jit
def victim_kernel(scores_ptr, guard_ptr, order_ptr, out_ptr, count, BW: tl.constexpr):
    """``out[0]`` = :func:`ranked_argmin` of ``scores`` (slot order) ranked by ``order``, whose first ``count``
    ranks are read, with ``guard`` (int8)."""
    sw = tl.arange(0, BW)
    order = tl.load(order_ptr + sw)
    guard = tl.load(guard_ptr + sw) != 0
    tl.store(out_ptr, ranked_argmin(tl.load(scores_ptr + order), guard, order, count, sw, BW))


@triton.jit
def listed_kernel(buf_ptr, pos_ptr, valid_ptr, out_ptr, holds_ptr, W, newslot, BW: tl.constexpr):
    """``holds[0]``, ``out[:BW]`` = :func:`listed_order` of a row of ``W`` slots (positions int64, validity int8,
    the new token's slot ``newslot`` valid) with the buffer ``buf`` (int32)."""
    sw = tl.arange(0, BW)
    wmask = sw < W
    pos = tl.load(pos_ptr + sw, mask=wmask, other=-1)
    valid = ((tl.load(valid_ptr + sw, mask=wmask, other=0) != 0) | (sw == newslot)) & wmask
    count = tl.sum(valid.to(tl.int32), 0)
    newest = tl.load(pos_ptr + newslot)
    holds, order = listed_order(buf_ptr, 0, 1, pos, valid, sw, newslot, newest, count, BW)
    tl.store(out_ptr + sw, order)
    tl.store(holds_ptr, holds.to(tl.int32))
