"""What a fused decode step's launches need besides the kernels: its launch plan (grids and named constants, worked
out once per shape, flags and launch configuration), its scratch buffers and the runs of its runtime arguments, in
the order the kernels take them. Host-side Python, no kernels: :mod:`slake.kernels.triton_decode` launches the step
with them, and :mod:`slake.kernels.held_step` keeps them from step to step in eager decoding
(``docs/gpu.md#the-fused-decode-step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slake.kernels import launch_cache
from slake.kernels import launch_config as launch

__all__ = [
    "KEEP_ALL", "RULE_CODES", "LaunchPlan", "Run", "Scratch", "ScratchSpec", "launch_plan", "launch_runs",
    "scratch_specs",
]  # fmt: skip

#: :data:`slake.methods.decode_rule.RULE_KINDS` as the kernels' integer codes
RULE_CODES = {
    "pooled_attention": 0,
    "accumulated_attention": 1,
    "sharpened_accumulation": 2,
    "layer_attention": 3,
    "recency": 4,
    "pinned_recency": 5,
    "running_max": 6,
    "key_diversity": 7,
    "expected_attention": 8,
}
#: the code of a layer that does not evict at decode (a target of -1 everywhere; no method's rule): the second
#: kernel scores no slot and looks for no victim, so its cost, and the first kernel's (which then writes no logits),
#: do not grow with the width of the row beyond the attention's reads, and rows wider than
#: :data:`slake.kernels.launch_config.WIDE_SLOTS` are taken
KEEP_ALL = 9


@dataclass(frozen=True)
class LaunchPlan:
    """What a fused step's launches need besides its tensors, worked out once per shape, flags and launch
    configuration (:func:`launch_plan`): in eager decoding on a GPU the host is the bottleneck, and working these out at
    every launch (a dozen powers of two, the three kernels' 16, 9 and 37 named constants, the ratio's parts) was
    about half the launcher's own host time (``docs/gpu.md``)."""

    G: int
    S: int
    BW: int
    NB: int
    logits: bool
    scratch: bool
    map_q: bool
    value_norm: bool
    two_stage: bool
    has_hv: bool
    has_linear: bool
    layer: bool
    HP: int
    ratio_parts: tuple[float, ...]
    append_grid: tuple[int, ...]
    projection_grid: tuple[int, ...]
    evict_grid: tuple[int, ...]
    layer_grid: tuple[int, ...]
    append_constants: launch_cache.Constants
    projection_constants: launch_cache.Constants
    evict_constants: launch_cache.Constants
    layer_constants: launch_cache.Constants


#: the plans made so far, by :func:`launch_plan`'s key (a handful per model: one per layer shape and flags);
#: emptied when full, never grown without bound
_PLANS: dict[tuple, LaunchPlan] = {}
_MAX_PLANS = 256


def launch_plan(
    R: int, Hq: int, d: int, H: int, W: int, flags: tuple[int, ...], proj_rows: int, ratio: float
) -> LaunchPlan:
    """The :class:`LaunchPlan` of a step of ``R`` rows, ``Hq`` query and ``H`` KV heads of ``d`` dims, rows of ``W``
    slots, the kernels' ``flags`` (:func:`~slake.kernels.triton_decode.fused_step`), ``proj_rows`` output channels of
    a two-stage rule's ``W_o`` (else 0) and its ``ratio``. The first kernel's split of a row
    (:func:`~slake.kernels.launch_config.split_size`) is chosen at every step, and every launch constant is read at
    every step (``launch_config.settings``): a plan is reused only for the same values, so a change of the launch
    configuration takes effect at the next step."""
    split = launch.split_size(W, R * H)
    key = (R, Hq, d, H, W, split, flags, proj_rows, ratio, launch.settings())
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    (quant, low_dot, has_rows, has_hv, has_first, has_linear, rule, group_max, pool_k, pool_max, zero_window,
     gain_floor, protect_window, evict_first, advance, value_norm, two_stage, generated_first,
     held, across) = flags  # fmt: skip
    G = Hq // H
    GP, DP, BW = launch.pow2(G, 16), launch.pow2(d, 16), launch.pow2(W, 16)
    # the second kernel's vectors: but for CriticalKV's two stages (and the timing variants without NEW_TOKEN_APART or
    # POOL_GATHER), the row's kept slots only, the new token apart: budget + 1 slots in pow2(budget) lanes
    pools = rule == RULE_CODES["pooled_attention"] and pool_k > 1
    apart = not two_stage and launch.NEW_TOKEN_APART and (launch.POOL_GATHER or not pools)
    keep_all = rule == KEEP_ALL
    # rows wider than the second kernel's vectors take (a layer that evicts at decode): read in blocks (triton_wide),
    # the row's scratch buffer 2 BW floats
    wide = not keep_all and W > launch.WIDE_SLOTS
    EW = 16 if keep_all else BW if wide else launch.pow2(W - 1, 16) if apart else BW
    split = min(split, BW)
    S = -(-W // split)
    BLOCK_N = min(64, split)
    NB = -(-proj_rows // launch.PROJECTION_BLOCK) if two_stage else 1
    # an eviction across the layer's KV heads (triton_layer): each head's H lowest slots, read back in blocks of TB;
    # HP is a constant of the second kernel only then (else 1: the other layers' kernels compile once for any H)
    HP = launch.pow2(H)
    layer = bool(across) and not keep_all
    common = dict(
        G=G, GP=GP, D=d, DP=DP, BLOCK_N=BLOCK_N, SPLIT=split, QUANT=quant, LOW_DOT=bool(low_dot),
        HAS_ROWS=bool(has_rows),
    )  # fmt: skip
    map_q = rule == RULE_CODES["expected_attention"]
    append = dict(
        HAS_HV=bool(has_hv), MAP_Q=map_q, VNORM=bool(value_norm), FREE_BLOCK=min(BW, launch.FREE_BLOCK), MB=16,
        HAS_LINEAR=bool(has_linear), RB=launch.state_rows(d, S), LOGITS=not keep_all, **common,
    )  # fmt: skip
    if quant:
        # 8-bit rows dequantised into float32 tiles: with the loop software-pipelined (Triton's default stages) the
        # first kernel took all 255 registers and spilled 316 bytes on sm_90, unpipelined 64 registers and none (a
        # program's piece is one or a few blocks of slots; occupancy hides the latency instead)
        append["num_stages"] = 1
    projection = dict(G=G, D=d, DP=DP, HB=launch.PROJECTION_BLOCK, QUANT=quant)
    evict = dict(
        SP=launch.pow2(S), BW=EW, LB=16, HAS_FIRST=bool(has_first), HAS_LINEAR=bool(has_linear), RULE=rule,
        GROUP_MAX=bool(group_max),
        POOL_K=pool_k, POOL_MAX=bool(pool_max), ZERO_WINDOW=bool(zero_window), GAIN_FLOOR=bool(gain_floor),
        PROTECT_WINDOW=bool(protect_window), EVICT_FIRST=bool(evict_first), ADVANCE=bool(advance),
        VNORM=bool(value_norm), TWO_STAGE=bool(two_stage), NBP=launch.pow2(NB), GEN_FIRST=bool(generated_first),
        COMBINE=launch.COMBINE, VB=min(launch.RECOMPUTE_BLOCK, BLOCK_N), SKIP=launch.left_out(), GC=launch.pow2(G),
        KEY_SPAN=launch.key_span(2 * EW if apart else BW), POOL_GATHER=bool(launch.POOL_GATHER),
        HELD_ORDER=bool(held and launch.HELD_ORDER), APART=apart, WIDE=wide, WB=min(launch.WIDE_BLOCK, BW),
        RB=min(launch.RANK_TILE, BW), LAYER=layer, HP=HP if layer else 1, TB=min(BW, launch.WIDE_BLOCK),
        num_warps=launch.evict_warps(max(EW, launch.WIDE_ROW) if wide else EW),  # wide: as the widest vectors
        maxnreg=launch.evict_registers(max(EW, launch.WIDE_ROW) if wide else EW),
        **{**common, "LOW_DOT": False},
    )  # fmt: skip
    made = LaunchPlan(
        G=G,
        S=S,
        BW=BW,
        NB=NB,
        logits=not keep_all,
        # row buffers: KeyDiff's, and the pooling's when CriticalKV's two stages need the pooled scores in slot order
        # (or the pooling goes through memory, POOL_GATHER off, or runs in slot order, NEW_TOKEN_APART off), and a
        # wide row's (its ranked signals)
        scratch=bool((pools and not apart) or rule == RULE_CODES["key_diversity"] or wide),
        map_q=map_q,
        value_norm=bool(value_norm),
        two_stage=bool(two_stage),
        has_hv=bool(has_hv),
        has_linear=bool(has_linear),
        layer=layer,
        HP=HP,
        ratio_parts=tuple(launch.ratio_parts(ratio)),
        append_grid=(R, H, S),
        projection_grid=(Hq, NB),
        evict_grid=(R, H),
        layer_grid=(R,),
        append_constants=launch_cache.Constants(append),
        projection_constants=launch_cache.Constants(projection),
        evict_constants=launch_cache.Constants(evict),
        layer_constants=launch_cache.Constants(dict(HP=HP, HAS_ROWS=bool(has_rows))),
    )
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = made
    return made


class Scratch(NamedTuple):
    """A step's scratch buffers, written by one kernel and read by the next within the step (never across steps):
    the logits ``x`` (one element, never written, for a layer that does not evict: :data:`KEEP_ALL`), the pieces'
    softmax statistics ``stat`` and partial sums ``part``, the new token's slot ``newslot``, and the buffers only
    some rules use (:func:`scratch_specs`), each ``x`` where unused (``newslot`` for an int32 one): among them the
    heads' lowest slots of an eviction across the layer's KV heads, ``cand`` (scores) and ``cslot`` (slots and
    counts)."""

    x: torch.Tensor
    stat: torch.Tensor
    part: torch.Tensor
    newslot: torch.Tensor
    pool: torch.Tensor
    estat: torch.Tensor
    vn: torch.Tensor
    pw: torch.Tensor
    lin: torch.Tensor
    cand: torch.Tensor
    cslot: torch.Tensor

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor | None]) -> Scratch:
        """The scratch from :func:`scratch_specs`' buffers in order (None: unused, ``x`` in its place, ``newslot``
        for an int32 one; an unused ``estat`` is ``stat``)."""
        x, stat, part, newslot, pool, estat, vn, pw, lin, cand, cslot = buffers
        assert x is not None and stat is not None and part is not None and newslot is not None
        return cls(x, stat, part, newslot, pool if pool is not None else x, estat if estat is not None else stat,
                   vn if vn is not None else x, pw if pw is not None else x, lin if lin is not None else x,
                   cand if cand is not None else x, cslot if cslot is not None else newslot)  # fmt: skip


#: a scratch buffer's shape and dtype, or None for one a step does not use
ScratchSpec = tuple[tuple[int, ...], torch.dtype] | None


def scratch_specs(p: LaunchPlan, R: int, Hq: int, H: int, W: int, d: int) -> tuple[ScratchSpec, ...]:
    """The shapes and dtypes of a step's scratch buffers, in :class:`Scratch`'s order (None: a buffer the step does
    not use)."""
    f32 = torch.float32
    G, S = p.G, p.S
    return (
        ((R, H, G, W), f32) if p.logits else ((1,), f32),
        ((R, H, G, S, 2), f32),
        ((R, H, S, G, d), f32),
        ((R, H), torch.int32),
        ((R, H, 2, p.BW), f32) if p.scratch else None,
        ((R, H, G, S, 2), f32) if p.map_q else None,
        ((R, H, W), f32) if p.value_norm else None,
        ((R, Hq, p.NB), f32) if p.two_stage else None,
        ((R, H, S, G, d), f32) if p.has_linear else None,
        ((R, H, p.HP), f32) if p.layer else None,
        ((R, H, p.HP + 1), torch.int32) if p.layer else None,
    )


def launch_runs(
    p: LaunchPlan, scratch: Scratch, H: int, arguments: Sequence
) -> tuple[tuple, tuple, tuple, tuple, tuple]:
    """The runs of a step's runtime arguments that do not depend on its query, key, value or output, in the order
    the kernels take them (:func:`slake.kernels.triton_decode.launch_step` puts those four in): the first kernel's
    after the key and value, the projection kernel's (all of them; empty without two stages), the second kernel's
    between the query and the output, and after the output, and the layer kernel's (all of them; empty but for an
    eviction across the layer's KV heads). ``arguments``:
    :func:`~slake.kernels.triton_decode.fused_step`'s parameters from ``k_mem`` to ``two_stage_epsilon``, the width
    an int. A step whose slots, storage and scratch are the same objects as an
    earlier step's has the same runs (:class:`slake.kernels.held_step.HeldStep` makes them once)."""
    (k_mem, v_mem, k_strides, v_strides, k_scale, v_scale, s_strides, table, block_size, rows, positions, valid, scores,
     order, head_visible, newest, target, prompt_len, budget, first_real, aug, counter, query_map, weights, out_proj, W,
     scaling, window, sinks, pinned, epsilon, two_stage_epsilon) = arguments  # fmt: skip
    x, stat, part, newslot, pool, estat, vn, pw, lin, cand, cslot = scratch
    w_strides = weights.stride() if p.two_stage else (0, 0, 0)
    m_sr, m_sh, m_ss = positions.stride()
    hv_strides = head_visible.stride() if p.has_hv else (0, 0, 0, 0)
    a_strides = aug.stride() if p.has_linear else (0, 0, 0, 0)
    newest_sr = newest.stride(0) if newest.ndim else 0
    S = p.S
    # the row's slots, as both kernels take them after the query (and the first kernel after the new key and value)
    slots = (
        k_mem, *k_strides,
        v_mem, *v_strides,
        k_scale, v_scale, *s_strides,
        table, table.stride(0), block_size,
        rows,
        positions, valid, scores, m_sr, m_sh, m_ss,
    )  # fmt: skip
    append = (
        *slots,
        head_visible, *hv_strides,
        newest, newest_sr,
        x, stat, part, newslot,
        query_map, estat, vn,
        aug, *a_strides, lin,
        W, H, S, float(scaling),
    )  # fmt: skip
    projection: tuple = ()
    if p.two_stage:
        projection = (
            v_mem, *v_strides,
            v_scale, *s_strides,
            table, table.stride(0), block_size,
            newslot, out_proj, *out_proj.stride(), pw,
            newslot.shape[0], H, out_proj.shape[0], p.NB,
        )  # fmt: skip
    evict_before_out = (
        *slots,
        target, target.stride(0), target.stride(1),
        prompt_len, budget, first_real,
        aug, *a_strides,
        x, stat, part, newslot, pool, order,
    )  # fmt: skip
    evict_after_out = (
        counter,
        estat, vn, weights, *w_strides, pw, p.NB, lin, cand, cslot,
        W, H, S, float(scaling), int(window), int(sinks), float(pinned), float(epsilon), float(two_stage_epsilon),
        *p.ratio_parts,
    )  # fmt: skip
    layer: tuple = ()
    if p.layer:
        layer = (
            positions, valid, scores, m_sr, m_sh, m_ss,
            rows, target, target.stride(0), target.stride(1),
            cand, cslot,
            W, H,
        )  # fmt: skip
    return append, projection, evict_before_out, evict_after_out, layer


#: a run of a launch's runtime arguments: made for one step (a tuple), or made once (:class:`launch_cache.Fixed`)
Run = tuple | launch_cache.Fixed
