"""The full cache's decode attention over a masked dense store, as two Triton kernels (flash-decoding).

A layer that keeps every token and has no score to update (the full cache; a layer that never evicts) attends with
one query per row over a dense store ``(R, Hkv, W, d)`` whose valid slots a mask ``(R, Hkv, W)`` says. In eager
decoding the valid slots are a prefix known on the host, and PyTorch's SDPA without a mask runs its split-over-keys
decode kernel (:func:`slake.cache.decode_step.sdpa_step`). A static cache (``torch.compile``, CUDA graphs) has fixed
shapes, so the step must attend over the whole store with the mask, and SDPA with a mask ran on the H200 as cuDNN's
kernel, which does not split the keys: the compiled full cache took 148 ms per token at 128K against 23-25 eager
(``docs/compile.md``, "Measured on an H200"). These kernels split the keys as flash-decoding does:

1. :func:`_dense_partials_kernel`, one program per (row, KV head, piece of
   :func:`~slake.kernels.launch_config.split_size` slots): the logits of the KV head's ``g`` query heads over its
   slots (``-inf`` where the mask says empty), and the piece's online softmax: each query head's maximum, normaliser
   and weighted sum of the values, into scratch.
2. :func:`_dense_combine_kernel`, one program per (row, KV head): the pieces' partial sums combined into the output,
   in the keys' dtype (SDPA's; float32 for 8-bit rows).

8-bit rows (``int8`` codes, or fp8 e4m3 bit patterns as ``uint8``, with a float32 scale per slot,
:mod:`slake.cache.quant`) are read as they are stored and dequantised in registers (fp8 through the bits on GPUs
without Triton's e4m3 conversion, :mod:`slake.kernels.device_support`), with the loop unpipelined (as the fused
step's first kernel: no register spill); SDPA needed the whole store dequantised into a copy first.

Nothing is read back to the host and every buffer is an argument, so the launches are graph-safe; the launcher is
a custom operator (``slake::dense_decode_attention``, no mutation) that ``torch.compile`` captures as one node. On a
machine without CUDA the kernels run through Triton's interpreter, where the tests check them against SDPA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from slake.kernels import launch_cache
from slake.kernels import launch_config as launch
from slake.kernels.device_support import half_precision_products, launch_device, quant_code
from slake.kernels.triton_slots import load_queries, load_rows

__all__ = ["dense_attention", "dense_attention_op"]

#: query heads per program are padded to at least this (``tl.dot``'s smallest operand)
_MIN_DOT = 16
#: 8-bit codes' storage dtype -> their storage name (the kernels' QUANT: ``slake.kernels.device_support.quant_code``)
_QUANT = {torch.int8: "int8", torch.uint8: "fp8_e4m3"}


@triton.jit
def _program_head(H, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """A program's (row, KV head) from its first program id ``rh = r * H + h``, as ``(rh, r, h)``, with the head
    dimension's lanes and the group's query-head lanes and their masks: ``(dd, dd < D, g, g < G)``."""
    rh = tl.program_id(0)
    dd = tl.arange(0, DP)
    g = tl.arange(0, GP)
    return rh, (rh // H).to(tl.int64), (rh % H).to(tl.int64), dd, dd < D, g, g < G


@triton.jit(do_not_specialize=launch.UNSPECIALIZED)
def _dense_partials_kernel(
    q_ptr, q_sr, q_sh, q_sd,
    k_ptr, k_sr, k_sh, k_ss,
    v_ptr, v_sr, v_sh, v_ss,
    valid_ptr, m_sr, m_sh, m_ss,
    ks_ptr, vs_ptr, s_sr, s_sh, s_ss,
    stat_ptr, part_ptr,
    W, H, S, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, LOW_DOT: tl.constexpr, OFF64: tl.constexpr, k_sd: tl.constexpr, v_sd: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    # the head dimension's strides are constants (1 in every store slake makes): a row's elements are then known to
    # be contiguous, and loaded as vectors
    rh, r, h, dd, dmask, g, gmask = _program_head(H, G, GP, D, DP)
    sp = tl.program_id(1)
    q = load_queries(q_ptr, r, q_sr, q_sh, q_sd, h, g, gmask, dd, dmask, G) * scale
    if LOW_DOT:
        q = q.to(k_ptr.dtype.element_ty)
    m_run = tl.full([GP], -3.4028234663852886e38, tl.float32)  # finite: a block with no valid slot adds nothing
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    kbase = k_ptr + r * k_sr + h * k_sh
    vbase = v_ptr + r * v_sr + h * v_sh
    mbase = valid_ptr + r * m_sr + h * m_sh
    sbase = r * s_sr + h * s_sh  # 8-bit rows: each slot's float32 scale (QUANT 1: int8 codes, 2: fp8 e4m3 bits)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, W)
    for s0 in range(lo, hi, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)  # int32 offsets within the row's KV head (OFF64 on the host: they fit)
        if OFF64:
            s = s.to(tl.int64)
        ok = s < hi
        mask2 = ok[:, None] & dmask[None, :]
        if QUANT == 0:
            kt = tl.load(kbase + s[:, None] * k_ss + dd[None, :] * k_sd, mask=mask2, other=0.0)
        else:
            kt = load_rows(kbase, s * k_ss, dd * k_sd, mask2, ks_ptr, sbase + s * s_ss, ok, QUANT)
        if LOW_DOT:
            x = tl.dot(q, tl.trans(kt))
        else:
            x = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee")
        vis = tl.load(mbase + s * m_ss, mask=ok, other=0) != 0
        x = tl.where(vis[None, :] & gmask[:, None], x, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(x, 1))
        alpha = tl.exp(m_run - m_new)
        e = tl.exp(x - m_new[:, None])
        if QUANT == 0:
            vt = tl.load(vbase + s[:, None] * v_ss + dd[None, :] * v_sd, mask=mask2, other=0.0)
        else:
            vt = load_rows(vbase, s * v_ss, dd * v_sd, mask2, vs_ptr, sbase + s * s_ss, ok, QUANT)
        if LOW_DOT:
            pv = tl.dot(e.to(v_ptr.dtype.element_ty), vt)
        else:
            pv = tl.dot(e, vt.to(tl.float32), input_precision="ieee")
        l_run = l_run * alpha + tl.sum(e, 1)
        acc = acc * alpha[:, None] + pv
        m_run = m_new
    sb = ((rh * S + sp) * G + g).to(tl.int64)
    tl.store(stat_ptr + sb * 2, m_run, mask=gmask)
    tl.store(stat_ptr + sb * 2 + 1, l_run, mask=gmask)
    tl.store(part_ptr + sb[:, None] * D + dd[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=launch.UNSPECIALIZED)
def _dense_combine_kernel(
    stat_ptr, part_ptr,
    o_ptr, o_sr, o_sh, o_sd,
    H, S,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):  # fmt: skip
    rh, r, h, dd, dmask, g, gmask = _program_head(H, G, GP, D, DP)
    top = tl.full([GP], -3.4028234663852886e38, tl.float32)
    for sp in range(0, S):
        sb = ((rh * S + sp) * G + g).to(tl.int64)
        top = tl.maximum(top, tl.load(stat_ptr + sb * 2, mask=gmask, other=-3.4028234663852886e38))
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for sp in range(0, S):
        sb = ((rh * S + sp) * G + g).to(tl.int64)
        w = tl.exp(tl.load(stat_ptr + sb * 2, mask=gmask, other=-3.4028234663852886e38) - top)
        den += w * tl.load(stat_ptr + sb * 2 + 1, mask=gmask, other=0.0)
        part = tl.load(part_ptr + sb[:, None] * D + dd[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        acc += w[:, None] * part
    out = acc / tl.where(gmask, den, 1.0)[:, None]  # padded query heads (not stored) divide by 1, not 0
    heads = h * G + g
    tl.store(
        o_ptr + r * o_sr + heads[:, None] * o_sh + dd[None, :] * o_sd,
        out.to(o_ptr.dtype.element_ty),
        mask=gmask[:, None] & dmask[None, :],
    )


def half_precision_dots(device: torch.device, keys_dtype: torch.dtype) -> bool:
    """Whether the products run in the keys' half precision (tensor cores, float32 accumulation): on a GPU, for
    float16 and bfloat16 keys, from compute capability 8.0; float32 elsewhere (Triton's interpreter, a T4;
    :func:`slake.kernels.device_support.half_precision_products`)."""
    return half_precision_products(device, keys_dtype)


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One query per row over the valid slots of a dense store, split over the keys (two launches).

    Parameters
    ----------
    query : torch.Tensor
        ``(R, Hq, d)``, any float dtype (multiplied in the keys' dtype on a GPU for half-precision keys, float32
        otherwise).
    keys, values : torch.Tensor
        ``(R, Hkv, W, d)`` float32, float16 or bfloat16, or 8-bit codes (``int8``; ``uint8``: fp8 e4m3 bit
        patterns, :mod:`slake.cache.quant`), any strides; ``Hq`` a multiple of ``Hkv``.
    valid : torch.Tensor
        ``(R, Hkv, W)`` bool: the slots attended to (at least one per row and KV head).
    k_scale, v_scale : torch.Tensor
        For 8-bit codes, each slot's float32 scale, ``(R, Hkv, W)`` or ``(R, Hkv, W, 1)``; otherwise ignored (an
        empty tensor will do).
    scaling : float
        The logits' scale.

    Returns
    -------
    torch.Tensor
        ``(R, Hq, d)``, as ``scaled_dot_product_attention`` over the (dequantised) rows with ``valid`` as its mask
        returns: in the keys' dtype, float32 for 8-bit codes.
    """
    R, Hq, d = query.shape
    H, W = keys.shape[1], keys.shape[2]
    dev = query.device
    quant = quant_code(_QUANT.get(keys.dtype), dev)
    mask = valid.view(torch.uint8)
    scales = (k_scale.stride(0), k_scale.stride(1), k_scale.stride(2)) if quant else (0, 0, 0)
    if quant and (k_scale.stride()[:3] != v_scale.stride()[:3]):
        raise ValueError("slake: the keys' and values' scales must share their layout")
    S, partials, combine = _launch_plan(
        R, Hq, H, W, d, quant, half_precision_dots(dev, keys.dtype), keys.stride(), values.stride(), mask.stride(2),
        scales[2], launch.TARGET_PROGRAMS, launch.MIN_SPLIT,
    )  # fmt: skip
    G = Hq // H
    stat = torch.empty(R * H * S * G * 2, dtype=torch.float32, device=dev)
    part = torch.empty(R * H * S * G * d, dtype=torch.float32, device=dev)
    out = torch.empty(R, Hq, d, dtype=torch.float32 if quant else keys.dtype, device=dev)
    args = (query, *query.stride(), keys, *keys.stride()[:3], values, *values.stride()[:3], mask, *mask.stride(),
            k_scale, v_scale, *scales, stat, part, W, H, S, float(scaling))  # fmt: skip
    with launch_device(query):  # Triton launches on the current device; a layer may sit on another GPU
        launch_cache.launch(_dense_partials_kernel, (R * H, S), args, partials)
        launch_cache.launch(_dense_combine_kernel, (R * H,), (stat, part, out, *out.stride(), H, S), combine)
    return out


@functools.lru_cache(maxsize=256)
def _launch_plan(
    R: int,
    Hq: int,
    H: int,
    W: int,
    d: int,
    quant: int,
    half_dots: bool,
    k_strides: tuple[int, ...],
    v_strides: tuple[int, ...],
    mask_stride: int,
    scale_stride: int,
    target_programs: int,
    min_split: int,
) -> tuple[int, launch_cache.Constants, launch_cache.Constants]:
    """The pieces per row and the two launches' constants for one shape, worked out once (an eager step on a GPU is
    bound by its host); ``target_programs`` and ``min_split`` are :func:`~slake.kernels.launch_config.split_size`'s
    settings, in the key so that a tuned value takes effect."""
    G = Hq // H
    split = launch.split_size(W, R * H)
    GP, DP = launch.pow2(G, _MIN_DOT), launch.pow2(d, _MIN_DOT)
    # a slot's element offsets within its row and KV head in 32 bits where they fit (64-bit addresses of a block of
    # 64 x 128 slots spilled the kernel's registers at 128K slots on sm_90)
    reach = max(abs(t[2]) * (W - 1) + abs(t[3]) * (d - 1) for t in (k_strides, v_strides))
    off64 = max(reach, abs(mask_stride) * (W - 1), abs(scale_stride) * (W - 1)) >= 2**31
    constants: dict[str, Any] = dict(G=G, GP=GP, D=d, DP=DP, BLOCK_N=min(64, split), SPLIT=split, OFF64=off64)
    constants.update(LOW_DOT=bool(half_dots and not quant), k_sd=k_strides[3], v_sd=v_strides[3], QUANT=quant)
    if quant:  # dequantised float32 tiles: unpipelined, as the fused step's first kernel (no register spill)
        constants["num_stages"] = 1
    combine = launch_cache.Constants({"G": G, "GP": GP, "D": d, "DP": DP})
    return -(-W // split), launch_cache.Constants(constants), combine


#: :func:`dense_attention` as a custom operator, for ``torch.compile`` to capture as one node; eager code calls the
#: function (the operator's Python dispatch is host time)
dense_attention_op = custom_op("slake::dense_decode_attention", dense_attention, mutates_args=())


@dense_attention_op.register_fake
def _(query, keys, values, valid, k_scale, v_scale, scaling) -> torch.Tensor:
    """The op's output for tracing: ``(R, Hq, d)`` in the keys' dtype (float32 for 8-bit codes)."""
    return query.new_empty(query.shape, dtype=torch.float32 if keys.dtype in _QUANT else keys.dtype)
