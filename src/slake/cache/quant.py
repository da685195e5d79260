"""8-bit storage of the kept keys and values (``kv_dtype``), orthogonal to eviction.

Eviction decides *which* tokens are kept; this module decides *how* each kept row is stored. With
``kv_dtype="int8"`` or ``"fp8_e4m3"`` every kept key and value row (one token, one KV head, ``d`` numbers) is stored
as ``d`` 8-bit codes plus one float32 scale per row (per-token absmax scaling):

* ``int8``: ``scale = max|x| / 127``, ``code = round(x / scale)`` in ``[-127, 127]``; the error of an element is at
  most ``scale / 2 = max|x| / 254``;
* ``fp8_e4m3``: ``scale = max|x| / 448``, ``code = fp8_e4m3fn(x / scale)`` (3 mantissa bits, relative error at most
  ``2^-4`` for normal codes, absolute error at most ``2^-10 * scale`` for subnormal ones).

Attention dequantises (``code * scale``, float32) right before the logits and the value product; scores, the
softmax, the PTAA linear state (``docs/methods/slake.md#linear-state``) and everything else stay float32. A row of zeros
has scale 0 and decodes to zeros. The scale of any other finite row lies between float32's smallest normal number
(a row below ``qmax`` times it, about 1.5e-36, is coded on that scale: its error stays at most ``scale / 2``, never the
row's own size) and the largest scale whose ``qmax * scale`` is finite (a row at float32's largest numbers decodes to
finite numbers, not ``inf``); ``+-inf`` saturates to the largest code, and a row with a NaN stays NaN. Bytes per
stored token and KV head: ``2 * (d + 4)`` (136 at ``d = 64``, i.e. 0.53x of bf16's 256; 0.52x at ``d = 128``).
Prefill attention is exact and unaffected; only what later tokens see is quantised, like eviction itself.
"""

from __future__ import annotations

import torch

__all__ = ["KV_DTYPES", "parse_kv_dtype", "quantize_rows", "dequantize_rows", "scale_bytes_per_row"]

#: accepted ``kv_dtype`` names -> (storage dtype, largest code magnitude)
KV_DTYPES: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}
_SCALE_DTYPE = torch.float32
_TINY = torch.finfo(_SCALE_DTYPE).tiny  # smallest normal float32: the smallest scale of a non-zero row


def _largest_scale(qmax: float) -> float:
    """The largest float32 ``s`` with ``qmax * s`` finite in float32 (the largest code decodes to a finite number)."""
    s = torch.tensor(torch.finfo(_SCALE_DTYPE).max / qmax, dtype=_SCALE_DTYPE)
    while not bool(torch.isfinite(s * qmax)):
        s = torch.nextafter(s, torch.zeros_like(s))
    return float(s)


_MAX_SCALE = {kind: _largest_scale(qmax) for kind, (_, qmax) in KV_DTYPES.items()}
_ALIASES = {"fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "qint8": "int8"}
_NONE = {None, "", "none", "auto", "model"}


def parse_kv_dtype(name: str | None) -> str | None:
    """Canonical ``kv_dtype`` name, or None for storage at the model's dtype (``None``, ``"auto"``, ``"none"``).

    Raises
    ------
    ValueError
        For an unknown name (the message lists the accepted ones).
    """
    if name is None:
        return None
    key = str(name).strip().lower()
    if key in _NONE:
        return None
    key = _ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ValueError(
            f"unknown kv_dtype {name!r}; use one of {', '.join(KV_DTYPES)} (or 'auto' for the model's dtype)"
        )
    return key


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last axis) absmax quantisation of ``x`` (``(..., d)``, any float dtype).

    Returns ``(codes, scale)``: ``codes`` of ``x``'s shape, 8 bits each, and ``scale`` ``(..., 1)`` float32 with
    ``x ~= codes * scale``. fp8 codes are returned as their ``uint8`` bit patterns (``gather``/``scatter_`` have no
    float8 kernels on CPU); :func:`dequantize_rows` reads them back.
    """
    qdtype, qmax = KV_DTYPES[kind]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # the codes are computed with the scale that is stored (a row's own, smaller scale stored beside codes computed on
    # a clamped one decoded a row below qmax * tiny to a fraction of itself); a zero row keeps scale 0, a NaN row NaN
    scale = (amax / qmax).clamp_(_TINY, _MAX_SCALE[kind]).masked_fill_(amax == 0, 0.0)
    y = xf / scale.clamp_min(_TINY)
    if qdtype == torch.int8:
        codes = y.round_().clamp_(-qmax, qmax).to(qdtype)
    else:
        codes = y.clamp_(-qmax, qmax).to(qdtype).view(torch.uint8)
    return codes, scale.to(_SCALE_DTYPE)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` in ``dtype`` (float32 by default); ``uint8`` codes are fp8 e4m3 bit patterns."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    out = codes.to(dtype)
    return out.mul_(scale if scale.dtype == dtype else scale.to(dtype))


def scale_bytes_per_row() -> int:
    """Bytes of the scale stored with every quantised row."""
    return torch.empty((), dtype=_SCALE_DTYPE).element_size()
