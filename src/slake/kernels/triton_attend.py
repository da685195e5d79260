"""The first of the fused decode kernels (:mod:`slake.kernels.triton_decode`): the new token's write and the
flash-decoding pass over a row's slots (logits, each piece's partial softmax), with :func:`attend_block`, the online
softmax over a block of slots that the second kernel also uses."""

from __future__ import annotations

import triton
import triton.language as tl

from slake.kernels import launch_config as launch
from slake.kernels.triton_slots import load_queries, load_rows, store_row

__all__ = ["attend_block"]


@triton.jit
def attend_block(m_run, den, acc, x, b, o, ok, h, dd, dmask, v_ptr, v_sb, v_sh, v_so, v_sd, vs_ptr, s_sb, s_sh, s_so,
                  QUANT: tl.constexpr, LOW_DOT: tl.constexpr):  # fmt: skip
    """A block of slots (logits ``x`` ``(GP, N)``, in blocks ``b`` at offsets ``o``, ``ok`` where they exist) added
    to an online softmax's running maximum ``m_run``, normaliser ``den`` and output ``acc`` ``(GP, DP)``."""
    m_new = tl.maximum(m_run, tl.max(x, 1))
    alpha = tl.exp(m_run - m_new)
    e = tl.exp(x - m_new[:, None])
    vt = load_rows(
        v_ptr, b * v_sb + h * v_sh + o * v_so, dd * v_sd, ok[:, None] & dmask[None, :],
        vs_ptr, b * s_sb + h * s_sh + o * s_so, ok, QUANT,
    )  # fmt: skip
    if LOW_DOT:
        pv = tl.dot(e.to(v_ptr.dtype.element_ty), vt.to(v_ptr.dtype.element_ty))
    else:
        pv = tl.dot(e, vt, input_precision="ieee")
    return m_new, den * alpha + tl.sum(e, 1), acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=launch.UNSPECIALIZED)
def _append_logits_kernel(
    q_ptr, q_sr, q_sh, q_sd,
    kn_ptr, kn_sr, kn_sh, kn_sd,
    vn_ptr, vn_sr, vn_sh, vn_sd,
    k_ptr, k_sb, k_sh, k_so, k_sd,
    v_ptr, v_sb, v_sh, v_so, v_sd,
    ks_ptr, vs_ptr, s_sb, s_sh, s_so,
    table_ptr, t_sr, block_size,
    rows_ptr,
    pos_ptr, valid_ptr, score_ptr, m_sr, m_sh, m_ss,
    hv_ptr, hv_sr, hv_sh, hv_sg, hv_ss,
    newest_ptr, newest_sr,
    x_ptr, stat_ptr, part_ptr, newslot_ptr,
    map_ptr, estat_ptr, norm_ptr,
    aug_ptr, a_sr, a_sh, a_si, a_sj, lin_ptr,
    W, H, S, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, QUANT: tl.constexpr, LOW_DOT: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_HV: tl.constexpr,
    MAP_Q: tl.constexpr, VNORM: tl.constexpr, FREE_BLOCK: tl.constexpr, MB: tl.constexpr,
    HAS_LINEAR: tl.constexpr, RB: tl.constexpr, LOGITS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    mr = tl.load(rows_ptr + r).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    meta = mr * m_sr + h * m_sh
    dd = tl.arange(0, DP)
    dmask = dd < D
    g = tl.arange(0, GP)
    gmask = g < G
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, W)
    # 1. the first free slot of the row (the lowest empty index), found by every program of the row: the validity
    # is written by the second kernel only, so no program here sees another's write. Read FREE_BLOCK slots at a
    # time (the whole row of a budget up to 2K in one load: each block is a round trip to memory)
    free = W
    for s0 in range(0, W, FREE_BLOCK):
        s = s0 + tl.arange(0, FREE_BLOCK)
        ok = s < W
        v = tl.load(valid_ptr + meta + s * m_ss, mask=ok, other=1)
        free = tl.minimum(free, tl.min(tl.where(ok & (v == 0), s, W), 0))
    if sp == 0:
        tl.store(newslot_ptr + r * H + h, free)
    # 2. the program whose slots hold it writes the new key and value there, and its metadata (score 0, visible to
    # every query head; its validity bit is set by the second kernel)
    if (free >= lo) & (free < hi):
        blk = tl.load(table_ptr + r * t_sr + free // block_size).to(tl.int64)
        off = (free % block_size).to(tl.int64)
        kn = tl.load(kn_ptr + r * kn_sr + h * kn_sh + dd * kn_sd, mask=dmask, other=0.0).to(tl.float32)
        vn = tl.load(vn_ptr + r * vn_sr + h * vn_sh + dd * vn_sd, mask=dmask, other=0.0).to(tl.float32)
        sbase = blk * s_sb + h * s_sh + off * s_so
        store_row(k_ptr + blk * k_sb + h * k_sh + off * k_so, ks_ptr + sbase, kn, dd * k_sd, dmask, QUANT)
        store_row(v_ptr + blk * v_sb + h * v_sh + off * v_so, vs_ptr + sbase, vn, dd * v_sd, dmask, QUANT)
        tl.store(pos_ptr + meta + free * m_ss, tl.load(newest_ptr + r * newest_sr))
        tl.store(score_ptr + meta + free * m_ss, 0.0)
        if HAS_HV:
            tl.store(hv_ptr + mr * hv_sr + h * hv_sh + g * hv_sg + free * hv_ss, 1, mask=gmask)
    tl.debug_barrier()
    # 3. over this program's slots: the logits of the scaled queries (kept for the second kernel's scores), and the
    # softmax's partial sums of the values, by an online softmax (each query head's maximum, normaliser and output)
    q = load_queries(q_ptr, r, q_sr, q_sh, q_sd, h, g, gmask, dd, dmask, G) * scale
    m_run = tl.full([GP], -3.4028234663852886e38, tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    xbase = (r * H + h).to(tl.int64) * G * W
    if MAP_Q:  # a rule's own queries (Expected Attention): q M^T, with their own softmax statistics
        # contracted MB columns at a time: the whole D x D float32 map in registers spilled at D = 128
        q2 = tl.zeros([GP, DP], tl.float32)
        for k0 in tl.static_range(0, DP, MB):
            kk = k0 + tl.arange(0, MB)
            kmask = kk < D
            q_k = load_queries(q_ptr, r, q_sr, q_sh, q_sd, h, g, gmask, kk, kmask, G)
            m_k = tl.load(map_ptr + dd[:, None] * D + kk[None, :], mask=dmask[:, None] & kmask[None, :], other=0.0)
            q2 += tl.dot(q_k * scale, tl.trans(m_k), input_precision="ieee")
        m2 = tl.full([GP], -3.4028234663852886e38, tl.float32)
        l2 = tl.zeros([GP], tl.float32)
    for s0 in range(lo, hi, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        ok = s < hi
        b = tl.load(table_ptr + r * t_sr + s // block_size, mask=ok, other=0).to(tl.int64)
        o = (s % block_size).to(tl.int64)
        kt = load_rows(
            k_ptr, b * k_sb + h * k_sh + o * k_so, dd * k_sd, ok[:, None] & dmask[None, :],
            ks_ptr, b * s_sb + h * s_sh + o * s_so, ok, QUANT,
        )  # fmt: skip
        if LOW_DOT:
            x = tl.dot(q.to(k_ptr.dtype.element_ty), tl.trans(kt.to(k_ptr.dtype.element_ty)))
        else:
            x = tl.dot(q, tl.trans(kt), input_precision="ieee")
        vis = (tl.load(valid_ptr + meta + s * m_ss, mask=ok, other=0) != 0) | (s == free)
        vis2 = vis[None, :] & gmask[:, None]
        if HAS_HV:
            hv = tl.load(
                hv_ptr + mr * hv_sr + h * hv_sh + g[:, None] * hv_sg + s[None, :] * hv_ss,
                mask=gmask[:, None] & ok[None, :],
                other=0,
            )
            vis2 = vis2 & (hv != 0)
        x = tl.where(vis2, x, float("-inf"))
        if MAP_Q:  # the second kernel reads the rule's logits (masked by validity alone), not the attention's
            x2 = tl.dot(q2, tl.trans(kt), input_precision="ieee")
            x2 = tl.where(vis[None, :] & gmask[:, None], x2, float("-inf"))
            tl.store(x_ptr + xbase + g[:, None] * W + s[None, :], x2, mask=gmask[:, None] & ok[None, :])
            m2n = tl.maximum(m2, tl.max(x2, 1))
            l2 = l2 * tl.exp(m2 - m2n) + tl.sum(tl.exp(x2 - m2n[:, None]), 1)
            m2 = m2n
        elif LOGITS:  # not for a layer that does not evict (step_plan.KEEP_ALL): nothing reads them
            tl.store(x_ptr + xbase + g[:, None] * W + s[None, :], x, mask=gmask[:, None] & ok[None, :])
        if VNORM:  # each slot's value norm ||v||_2, for the second kernel's rule
            vt = load_rows(
                v_ptr, b * v_sb + h * v_sh + o * v_so, dd * v_sd, ok[:, None] & dmask[None, :],
                vs_ptr, b * s_sb + h * s_sh + o * s_so, ok, QUANT,
            )  # fmt: skip
            tl.store(norm_ptr + (r * H + h).to(tl.int64) * W + s, tl.sqrt(tl.sum(vt * vt, 1)), mask=ok)
        m_run, l_run, acc = attend_block(
            m_run, l_run, acc, x, b, o, ok, h, dd, dmask,
            v_ptr, v_sb, v_sh, v_so, v_sd, vs_ptr, s_sb, s_sh, s_so, QUANT, LOW_DOT,
        )  # fmt: skip
    sb = (((r * H + h) * G + g) * S + sp) * 2
    tl.store(stat_ptr + sb, m_run, mask=gmask)
    tl.store(stat_ptr + sb + 1, l_run, mask=gmask)
    if MAP_Q:
        tl.store(estat_ptr + sb, m2, mask=gmask)
        tl.store(estat_ptr + sb + 1, l2, mask=gmask)
    pb = (((r * H + h) * S + sp) * G + g).to(tl.int64) * D
    tl.store(part_ptr + pb[:, None] + dd[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    if HAS_LINEAR:
        # 4. this program's share of the PTAA linear term's numerator ``s q^T L`` over the state as it stands before
        # this step's fold: rows ``sp * RB ...`` of the D x D block (the row's programs share its rows out, so the
        # state is read in parallel; a program past the last row writes zeros). The second kernel sums the shares
        # and adds the victim's rank-one part when it folds before the output.
        lin = tl.zeros([GP, DP], tl.float32)
        abase = aug_ptr + mr * a_sr + h * a_sh
        for i0 in tl.static_range(0, RB, MB):
            ii = sp * RB + i0 + tl.arange(0, MB)
            imask = ii < D
            blk = tl.load(
                abase + ii[:, None] * a_si + dd[None, :] * a_sj, mask=imask[:, None] & dmask[None, :], other=0.0
            )
            q_i = load_queries(q_ptr, r, q_sr, q_sh, q_sd, h, g, gmask, ii, imask, G)
            lin += tl.dot(q_i * scale, blk, input_precision="ieee")
        tl.store(lin_ptr + pb[:, None] + dd[None, :], lin, mask=gmask[:, None] & dmask[None, :])
