"""Shared tensor building blocks of the scoring rules (``docs/methods/README.md``).

Everything here is plain torch, float32, and padding-aware: a padded key gets zero probability, so statistics summed
over keys are unaffected by left padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_logits(
    queries: torch.Tensor, keys: torch.Tensor, window: int, scaling: float, key_padding: torch.Tensor | None = None
) -> torch.Tensor:
    """Scaled logits of the last ``window`` queries against every key, causal inside the window block.

    See ``docs/methods/README.md#observation-window-attention``. Returns ``(B, Hq, w, S)`` float32 with ``-inf`` at
    masked entries (future keys inside the window, padded keys). ``w = min(window, S)``.
    """
    B, Hq, S, d = queries.shape
    Hkv = keys.shape[1]
    g = Hq // Hkv
    w = min(window, S)
    q = queries[:, :, S - w :].float().reshape(B, Hkv, g * w, d)
    x = torch.matmul(q, keys.float().transpose(-1, -2)).reshape(B, Hq, w, S).mul_(scaling)  # x is ours: in place
    causal = torch.ones(w, w, dtype=torch.bool, device=x.device).triu(1)
    x[..., S - w :].masked_fill_(causal, float("-inf"))
    if key_padding is not None and bool(key_padding.any()):
        x.masked_fill_(key_padding[:, None, None, :], float("-inf"))
    return x


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, window: int, scaling: float, key_padding: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax of :func:`window_logits` over keys: ``(B, Hq, w, S)`` float32 whose rows sum to 1."""
    return torch.softmax(window_logits(queries, keys, window, scaling, key_padding), dim=-1)


def pool1d(x: torch.Tensor, kernel: int, kind: str = "avg") -> torch.Tensor:
    """Pool along the last (token) axis with stride 1 and 'same' length (``docs/methods/README.md#pooling``).

    ``avg`` zero-pads and always divides by ``kernel`` (PyTorch ``count_include_pad=True``), as the reference code;
    ``max`` pads with ``-inf``. ``kernel <= 1`` returns ``x`` unchanged. Works on any leading shape.
    """
    if kernel <= 1:
        return x
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    if kind == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    elif kind == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"unknown pooling {kind!r} (use 'avg' or 'max')")
    return out.reshape(shape)


def group_mean(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Mean over the query heads sharing a KV head (``docs/methods/README.md#gqa-reduction``):
    ``(B, Hq, ...) -> (B, Hkv, ...)``."""
    B, Hq = x.shape[:2]
    g = Hq // num_kv_heads
    if g == 1:
        return x
    return x.reshape(B, num_kv_heads, g, *x.shape[2:]).mean(2)


def pooled_outside_window(
    scores: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    newest: torch.Tensor | None,
    window: int,
    kernel: int,
    kind: str = "avg",
) -> torch.Tensor:
    """A decode rule's per-slot scores pooled over positional neighbours with the protected window's slots (and the
    empty ones) set to 0 first, as the prefill leaves the window's columns out of the pooling (CAKE's decode rule;
    ``docs/methods/README.md#pooling``): a protected token does not raise its neighbours' scores.

    ``scores, positions, valid``: ``(B, Hkv, n)``; ``newest``: the newest position (``DecodeInputs.newest``),
    or None to take the largest valid position. The window's slots come out as their neighbours' pooled values;
    they are protected, so their scores are not read.
    """
    empty = ~valid
    if newest is None:
        newest = positions.masked_fill(empty, -1).amax(-1, keepdim=True)
    in_window = positions > newest - window
    s = scores.masked_fill(in_window | empty, 0.0)
    return positional_pool(s, positions, valid, kernel, kind, empty=empty, zeroed=True)


def positional_pool(
    scores: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    kernel: int,
    kind: str = "avg",
    *,
    empty: torch.Tensor | None = None,
    zeroed: bool = False,
) -> torch.Tensor:
    """Pool per-slot scores over *positional* neighbours when slots are not stored in position order.

    Decode-time storage overwrites evicted slots in place, so slot order is not token order. This sorts the slots by
    position (empty slots last, with score 0), pools, and scatters back. ``scores, positions, valid``:
    ``(B, Hkv, n)``. See ``docs/methods/README.md#eviction-and-positional-order``.

    ``empty``: ``~valid`` when the caller has it already; ``zeroed``: the caller guarantees that ``scores`` is 0 on
    every empty slot (the mask is then skipped). Both only save operations (a decode step's cost on CPU is its
    operation count). The sort is stable, so the empty slots, whose positions tie, keep their slot order (the fused
    kernels' order); the pooled scores of the valid slots do not depend on that order.
    """
    if kernel <= 1:
        return scores
    if empty is None:
        empty = ~valid
    key = positions.masked_fill(empty, torch.iinfo(positions.dtype).max)
    order = torch.sort(key, dim=-1, stable=True).indices
    s_sorted = (scores if zeroed else scores.masked_fill(empty, 0.0)).gather(-1, order)
    pooled_sorted = pool1d(s_sorted, kernel, kind)
    return torch.empty_like(pooled_sorted).scatter_(-1, order, pooled_sorted)


def real_positions(key_padding: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` each key's position among its row's real tokens (left padding: negative on the padded keys), so
    that ``0 <= pos < sinks`` marks a row's sinks, whatever its padding."""
    S = key_padding.shape[-1]
    return torch.arange(S, device=key_padding.device).view(1, -1) - key_padding.sum(-1, keepdim=True)
