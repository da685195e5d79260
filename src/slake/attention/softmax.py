"""The attention arithmetic shared by every decode path: fp32 products over a low-precision cache, the safe
softmax, and the probabilities' product with values.

These are the building blocks of :func:`slake.attention.ptaa.attend` and of the decode step
(:mod:`slake.cache.decode_step`); the vLLM plugin's paged layouts use :func:`matmul_f32` for their logits. Nothing
here knows how a cache is stored.
"""

from __future__ import annotations

import torch

__all__ = ["matmul_f32", "probs_values", "safe_softmax"]

_BMM_OUT_DTYPE = [True]  # torch.bmm(..., out_dtype=float32) usable on this CUDA build (cleared on first failure)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 without an fp32 copy of a low-precision ``b`` (the cache) where the backend allows.

    ``a`` is float32. When ``b`` is float32 this is a plain matmul. For an fp16/bf16 ``b`` on CUDA, ``a`` is cast
    to ``b``'s dtype and the product accumulates and is returned in float32 (``torch.bmm(..., out_dtype=)``);
    elsewhere (CPU, older torch) ``b`` is upcast. So on CUDA with a bf16/fp16 cache the float32 queries, and in
    :func:`probs_values` the float32 probabilities, are rounded to the cache's dtype before the product, as a
    bf16 attention kernel rounds them (``docs/conventions.md#numerics``).
    """
    if b.dtype == torch.float32 or b.dtype == torch.float64:
        return torch.matmul(a.to(b.dtype) if a.dtype != b.dtype else a, b).float()
    if b.is_cuda and _BMM_OUT_DTYPE[0] and not torch.compiler.is_compiling():  # a graph fuses the upcast
        try:
            lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            aa = a.to(b.dtype).expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
            bb = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
            out = torch.bmm(aa, bb, out_dtype=torch.float32)
            return out.reshape(*lead, a.shape[-2], b.shape[-1])
        except (RuntimeError, TypeError):
            _BMM_OUT_DTYPE[0] = False
    return torch.matmul(a.float(), b.float())


def safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis; a row with no visible slot (all ``-inf``) gives zeros, not NaN."""
    return torch.softmax(x, dim=-1).nan_to_num_(0.0)


def probs_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``(B, H, g, nq, n)`` probabilities times ``(B, H, n, d)`` values -> ``(B, H, g, nq, d)`` float32."""
    B, H, g, nq, n = probs.shape
    out = matmul_f32(probs.reshape(B, H, g * nq, n), values)
    return out.view(B, H, g, nq, -1)
