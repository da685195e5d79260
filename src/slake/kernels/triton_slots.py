"""How the fused decode kernels (:mod:`slake.kernels.triton_decode`) read and write a layer's slots: one key or value
row at a time or a block of them, through a block table and four strides, as stored (model dtype) or as 8-bit codes
with one float32 scale per row (:mod:`slake.cache.quant`'s rounding, reproduced bit for bit); and a row's
metadata with its new token apart (``row_lanes``, ``settle_row``).

8-bit storage is the kernels' ``QUANT``: 0 none, 1 int8 codes, 2 fp8 e4m3 codes through the GPU's own conversion
(NVIDIA from ``sm_89``), 3 the same codes through integer arithmetic on their bits (:func:`e4m3_bits`,
:func:`e4m3_value`), for GPUs whose compiler has no e4m3 conversion (Triton refuses ``float8e4nv`` before
``sm_89``: an A100's, a T4's); :func:`slake.kernels.device_support.quant_code` chooses."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "block_keys", "e4m3_bits", "e4m3_value", "load_queries", "load_row", "load_rows", "round_e4m3", "round_half_even",
    "lane_guard", "row_lanes", "settle_row", "slot_guard", "store_row",
]  # fmt: skip


@triton.jit
def round_half_even(y):
    """``torch.round``: to the nearest integer, ties to even."""
    f = tl.floor(y)
    diff = y - f
    f_even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where(diff > 0.5, f + 1.0, tl.where(diff < 0.5, f, tl.where(f_even, f, f + 1.0)))


@triton.jit
def round_e4m3(y):
    """``y`` (within +-448) rounded to the nearest float8 e4m3 value, ties to even, in float32 arithmetic: 3 mantissa
    bits, so the step is ``2^(e - 3)`` in the binade ``2^e`` (``e >= -6``; below, the subnormal step ``2^-9``).
    The conversion of the exact result to e4m3 then needs no rounding (Triton's interpreter rounds some ties across
    a binade down, triton-lang/triton's numpy emulation of the cast). The magnitude is rounded and the sign put
    back, so that a small negative value becomes ``-0.0``, as in torch's cast (rounding ``y`` itself gave ``+0.0``:
    the same value, another code)."""
    a = tl.abs(y)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1.0e-30))), -6.0)
    step = tl.exp2(e - 3.0)
    r = round_half_even(a / step) * step
    # the sign put back as a bit: a negative value that rounds to zero is -0.0 (code 0x80), as torch's cast gives
    return (r.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(y):
    """The float8 e4m3 code (an int32 in 0..255) of ``y``, an exact e4m3 value within +-448 (:func:`round_e4m3`'s
    result), read off its float32 bits: the sign; for a normal value (``|y| >= 2^-6``) the exponent rebiased from
    127 to 7 and the top 3 mantissa bits (the others are zero); for a subnormal one ``|y| / 2^-9`` (exact). The code
    the GPU's conversion gives (``-0.0`` included), for GPUs without one."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    normal = ((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7)
    sub = (tl.abs(y) * 512.0).to(tl.int32)
    return sign | tl.where(tl.abs(y) >= 0.015625, normal, sub)


@triton.jit
def e4m3_value(code):
    """The float32 value of float8 e4m3 codes (integers in 0..255, as loaded from ``uint8``): for a normal code
    (exponent field ``e > 0``) the float32 with exponent ``e - 7 + 127`` and the code's 3 mantissa bits on top, for
    a subnormal one ``m * 2^-9``; the sign the code's top bit (set as a bit, so ``0x80`` is ``-0.0``). The codes
    :func:`store_row` writes never include the two NaN patterns (values are clamped to +-448 first)."""
    c = code.to(tl.int32) & 0xFF
    e = (c >> 3) & 15
    m = c & 7
    normal = ((e + 120) << 23) | (m << 20)
    mag = tl.where(e == 0, (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True), normal)
    return (mag | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)  # the sign as a bit: -0.0 stays -0.0


@triton.jit
def store_row(ptr, scale_ptr, x, dd, dmask, QUANT: tl.constexpr):
    """Store one key or value row ``x`` (float32, ``(DP,)``): as is, or as 8-bit codes plus a float32 scale
    (:func:`slake.cache.quant.quantize_rows`: ``scale = max|x| / qmax``, codes ``round(x / scale)`` for int8, the
    e4m3 conversion for fp8; the scale of a non-zero row kept between float32's smallest normal number and the
    largest whose ``qmax * scale`` is finite, 0 for a zero row, as there)."""
    if QUANT == 0:
        tl.store(ptr + dd, x.to(ptr.dtype.element_ty), mask=dmask)
    else:
        qmax = 127.0 if QUANT == 1 else 448.0
        # slake.cache.quant._MAX_SCALE: the largest float32 s with qmax * s finite
        top = 2.6793883890187504e36 if QUANT == 1 else 7.595588094610019e35
        amax = tl.max(tl.abs(x), 0)
        scale = tl.minimum(tl.maximum(amax / qmax, 1.1754943508222875e-38), top)
        scale = tl.where(amax == 0.0, 0.0, scale)
        y = x / tl.maximum(scale, 1.1754943508222875e-38)
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if QUANT == 1:
            code = round_half_even(y).to(tl.int8)
            tl.store(ptr + dd, code, mask=dmask)
        elif QUANT == 2:
            code = round_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(ptr + dd, code, mask=dmask)
        else:
            tl.store(ptr + dd, e4m3_bits(round_e4m3(y)).to(tl.uint8), mask=dmask)
        tl.store(scale_ptr, scale)


@triton.jit
def load_rows(ptr, addr, dd, mask2, scale_ptr, saddr, smask, QUANT: tl.constexpr):
    """Rows at ``addr`` ``(N,)`` (+ ``dd`` along the head dimension) as float32 ``(N, DP)``, dequantised for
    8-bit storage (``codes * scale``)."""
    x = tl.load(ptr + addr[:, None] + dd[None, :], mask=mask2, other=0)
    if QUANT == 0:
        return x.to(tl.float32)
    if QUANT == 2:
        x = x.to(tl.float8e4nv, bitcast=True)
    if QUANT == 3:
        x = e4m3_value(x)
    s = tl.load(scale_ptr + saddr, mask=smask, other=0.0)
    return x.to(tl.float32) * s[:, None]


@triton.jit
def load_row(ptr, addr, dd, dmask, scale_ptr, saddr, QUANT: tl.constexpr):
    """One row at ``addr`` as float32 ``(DP,)`` (:func:`load_rows` for a single slot)."""
    x = tl.load(ptr + addr + dd, mask=dmask, other=0)
    if QUANT == 0:
        return x.to(tl.float32)
    if QUANT == 2:
        x = x.to(tl.float8e4nv, bitcast=True)
    if QUANT == 3:
        x = e4m3_value(x)
    return x.to(tl.float32) * tl.load(scale_ptr + saddr)


@triton.jit
def load_queries(q_ptr, r, q_sr, q_sh, q_sd, h, g, gmask, cols, cmask, G: tl.constexpr):
    """The float32 queries of step row ``r``'s query heads ``h * G + g`` (KV head ``h``'s group, where ``gmask``),
    elements ``cols`` of each (where ``cmask``): ``(GP, len(cols))``, zero where masked."""
    return tl.load(
        q_ptr + r * q_sr + (h * G + g)[:, None] * q_sh + cols[None, :] * q_sd,
        mask=gmask[:, None] & cmask[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def block_keys(k_ptr, k_sb, k_sh, k_so, k_sd, ks_ptr, s_sb, s_sh, s_so, table_ptr, t_sr, block_size,
                r, h, s, ok, dd, dmask, QUANT: tl.constexpr):  # fmt: skip
    """The float32 keys ``(N, DP)`` of KV head ``h``'s slots ``s`` of step row ``r`` (where ``ok``), through the block
    table (dequantised for 8-bit storage)."""
    b = tl.load(table_ptr + r * t_sr + s // block_size, mask=ok, other=0).to(tl.int64)
    o = (s % block_size).to(tl.int64)
    return load_rows(
        k_ptr, b * k_sb + h * k_sh + o * k_so, dd * k_sd, ok[:, None] & dmask[None, :],
        ks_ptr, b * s_sb + h * s_sh + o * s_so, ok, QUANT,
    )  # fmt: skip


@triton.jit
def row_lanes(pos_ptr, valid_ptr, meta, m_ss, W, newslot, BW: tl.constexpr):
    """A row of ``W`` slots with its new token (in slot ``newslot``) apart, as the second kernel's eviction holds it:
    ``(sw, lmask, lslot, pos, valid)``. ``BW`` lanes (``pow2(W - 1)``), of which ``lmask`` the ``W - 1`` in use;
    lane ``i`` holds slot ``i`` (``lslot``), but lane ``newslot`` holds the row's last slot ``W - 1`` when the new
    token's is not the last, so the lanes cover every slot but the new token's. ``pos``, ``valid``: their slots'
    positions (-1 past the row) and validity (false past the row)."""
    sw = tl.arange(0, BW)
    lmask = sw < W - 1
    lslot = tl.where(sw == newslot, W - 1, sw)
    pos = tl.load(pos_ptr + meta + lslot * m_ss, mask=lmask, other=-1)
    valid = (tl.load(valid_ptr + meta + lslot * m_ss, mask=lmask, other=0) != 0) & lmask
    return sw, lmask, lslot, pos, valid


@triton.jit
def settle_row(pos_ptr, valid_ptr, meta, m_ss, newslot, newest, victim, chosen):
    """A row's slots after its eviction: the new token (slot ``newslot``, position ``newest``) held from now on
    unless it is the victim, and the victim's slot freed (not valid, position -1) when ``chosen``."""
    # every thread's reads of the row's validity and positions done before any is written (the new token's slot was
    # read apart, and across a layer's heads nothing here waits on the victim: tests/kernel_hazards.py)
    tl.debug_barrier()
    new_gone = chosen & (victim == newslot)
    tl.store(valid_ptr + meta + newslot * m_ss, ~new_gone)
    tl.store(valid_ptr + meta + victim * m_ss, victim != victim, mask=chosen & (victim != newslot))
    tl.store(pos_ptr + meta + victim * m_ss, newest - newest - 1, mask=chosen)


@triton.jit
def slot_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW: tl.constexpr):
    """The slots no eviction may take, of slots at positions ``pos`` (``valid`` where held) in a step whose new token
    is at ``newest``: empty ones, the sinks (positions ``first .. first + sinks - 1``) and with ``PROTECT_WINDOW``
    the newest ``window`` positions."""
    guard = (~valid) | ((pos >= first) & (pos < first + sinks))
    if PROTECT_WINDOW:
        guard = guard | (pos > newest - window)
    return guard


@triton.jit
def lane_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW: tl.constexpr):
    """:func:`slot_guard` of a row's lanes and of its new token (at ``newest``): ``(guard, new_guarded)``, the new
    token guarded as a sink, or within the window when ``window > 0``."""
    new_guarded = (newest >= first) & (newest < first + sinks)
    if PROTECT_WINDOW:
        new_guarded = new_guarded | (window > 0)
    return slot_guard(pos, valid, newest, window, first, sinks, PROTECT_WINDOW), new_guarded
