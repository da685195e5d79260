"""Attention over a compressed layer: exact softmax over the kept slots plus SLAKE's PTAA linear term.

Partially Taylor-Approximated Attention (SLAKE section 3.3, Algorithm 1 of App. C; see
``docs/methods/slake.md#the-closed-form``, ``#decode-step`` and ``#numerical-safeguards``). For one query head with
scaled logits ``x_j`` over the kept slots and a linear state summarising the ``n_e`` evicted tokens, with
``mu = scaling * q . k_sum / n_e``, any shift ``m`` and ``lam = exp(mu - m)``::

    out = [sum_kept e^(x_j - m) v_j + lam * ((1 - mu) v_sum + scaling * q^T L)]
          / [sum_kept e^(x_j - m) + lam * n_e]              (docs/methods/slake.md#the-closed-form)

This is the softmax over *all* past tokens in which every evicted token's weight ``e^{x_j}`` is replaced by its
first-order expansion ``e^{mu} (1 + x_j - mu)`` around the mean evicted logit. The printed Eqs. 12/13/21 of the paper
contain typos (``docs/methods/slake.md#deviations-from-the-paper``); Algorithm 1, i.e. the closed form above, is
used. ``m = max(max_kept x, mu)`` (``docs/methods/slake.md#numerical-safeguards``), so neither exponential can
overflow. Without a state, or where ``count == 0``, the result is exactly ``softmax(logits) @ values``.

GQA is handled by a group axis: the ``g`` query heads of a KV head are laid out as ``(B, Hkv, g, n_q, d)`` and share
the KV head's slots and linear state, which are never expanded.
"""

from __future__ import annotations

import torch

from slake.attention.linear_state import LinearState

__all__ = ["attend"]

# (lowest finite, smallest normal) per compute dtype, looked up once (torch.finfo costs a call per use)
_LIMITS = {dt: (torch.finfo(dt).min, torch.finfo(dt).tiny) for dt in (torch.float32, torch.float64)}


def attend(
    query: torch.Tensor,
    logits: torch.Tensor,
    values: torch.Tensor,
    state: LinearState | None = None,
    scaling: float | None = None,
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """PTAA output (the closed form, ``docs/methods/slake.md#the-closed-form``) or plain softmax attention when
    there is no linear term.

    Parameters
    ----------
    query : torch.Tensor
        ``(B, Hkv, g, n_q, d)`` raw post-RoPE queries in group layout (query head ``h`` -> ``(h // g, h % g)``, i.e.
        ``q.view(B, Hkv, g, n_q, d)``), float32 (float64 accepted). Only used for the linear term.
    logits : torch.Tensor
        ``(B, Hkv, g, n_q, n)`` float32 ``scaling * q . k`` over the cached slots, ``-inf`` where a slot is empty or
        not visible to the query (causal, padding, evicted this step).
    values : torch.Tensor
        ``(B, Hkv, n, d)`` cached values, any float dtype. Values of invisible slots must be finite (0 * NaN = NaN).
    state : LinearState | None
        The layer's linear state; batch elements / heads with ``count == 0`` get no linear term.
    scaling : float | None
        Softmax scale used in ``logits``; ``None`` means ``d ** -0.5``. Needed only for the linear term. A caller
        whose ``query`` is already scaled (``logits = query . k``) passes ``1.0``, which skips the multiplication.
    overwrite_logits : bool
        Allow the exponentials to be written into ``logits`` (the compressor's own per-step tensor, when it is float32
        and contiguous), which saves an allocation per call. ``logits`` is then garbage afterwards.

    Returns
    -------
    torch.Tensor
        ``(B, Hkv, g, n_q, d)`` in float32 (float64 if ``query``/``logits`` are float64). A row with no visible slot
        and no linear term returns zeros, never NaN.
    """
    if query.ndim != 5 or logits.ndim != 5 or values.ndim != 4:
        raise ValueError(
            f"expected query (B,Hkv,g,nq,d), logits (B,Hkv,g,nq,n), values (B,Hkv,n,d); got "
            f"{tuple(query.shape)}, {tuple(logits.shape)}, {tuple(values.shape)}"
        )
    B, H, g, nq, d = query.shape
    n = values.shape[2]
    if logits.shape != (B, H, g, nq, n) or values.shape != (B, H, n, d):
        raise ValueError(
            f"shape mismatch: query {tuple(query.shape)}, logits {tuple(logits.shape)}, values {tuple(values.shape)}"
        )
    cdt = torch.float64 if torch.float64 in (query.dtype, logits.dtype) else torch.float32
    R = g * nq
    x = logits.reshape(B, H, R, n)
    if x.dtype != cdt:
        x = x.to(cdt)
    v = values if values.dtype == cdt else values.to(cdt)
    fmin, tiny = _LIMITS[cdt]
    # (a traced graph cannot compare data pointers; there x is logits' view or this call's own copy, both writable)
    own = overwrite_logits and (
        torch.compiler.is_compiling() or (x.data_ptr() == logits.data_ptr() and x.is_contiguous())
    )
    if state is None:
        m = (x.amax(-1, keepdim=True) if n > 0 else x.new_zeros(B, H, R, 1)).clamp_min_(fmin)
        e = (x.sub_(m) if own else x - m).exp_()  # all -inf row: e = 0, no NaN
        return torch.matmul(e, v).div_(e.sum(-1, keepdim=True).clamp_min(tiny)).reshape(B, H, g, nq, d)
    aug = state.aug
    if aug.shape != (B, H, d + 1, d + 1):
        raise ValueError(f"linear state shape {tuple(state.k_sum.shape)} does not match (B, Hkv, d)={(B, H, d)}")
    if aug.dtype == cdt:
        cnt, lk, vsum = state.attention_parts()  # n_e (B, H, 1, 1), [L, k_sum] (B, H, d, d+1), v_sum (B, H, 1, d)
    else:
        aug = aug.to(cdt)
        cnt, lk, vsum = aug[..., d:, d:], aug[..., :d, :], aug[..., d:, :d]
    s = d**-0.5 if scaling is None else float(scaling)
    qs = query.reshape(B, H, R, d)
    if qs.dtype != cdt:
        qs = qs.to(cdt)
    if s != 1.0:
        qs = qs * s
    # one product gives s q^T L and s q . k_sum: s q @ [L, k_sum]; p is this call's own tensor, updated in place
    p = torch.matmul(qs, lk)  # (B, H, R, d + 1)
    # mu = s q . k_sum / n_e (a view of p's last column); a head with nothing folded (0 / 0) gets the lowest finite
    # logit, so lam = 0 (or a row without any visible slot gets m = mu and num = den = 0, as the state is all zeros)
    mu = p[..., d:].div_(cnt).nan_to_num_(nan=fmin)  # (B, H, R, 1)
    lin = p[..., :d].addcmul_(1 - mu, vsum)  # s q^T L + (1 - mu) v_sum
    # the shift m = max(max_j x_j, mu); e stays contiguous for the product with v (no concatenation, no copy)
    m = torch.maximum(x.amax(-1, keepdim=True), mu) if n > 0 else mu.clone()
    e = (x.sub_(m) if own else x - m).exp_()
    lam = (mu - m).exp_()
    num = torch.matmul(e, v).addcmul_(lam, lin)  # (B, H, R, d)
    den = e.sum(-1, keepdim=True).addcmul_(lam, cnt)
    # den >= 1 when the row has a visible slot or a linear term (the shift m is attained), else num = den = 0
    return num.div_(den.clamp_min_(tiny)).reshape(B, H, g, nq, d)
