"""The logits of a block of queries over a compressed layer's slots (the general, multi-token decode path and the
chunked prefill), in the group layout the shared attention helpers take."""

from __future__ import annotations

import torch

from slake.attention.softmax import matmul_f32
from slake.cache.layer_store import LayerStore

__all__ = ["grouped_queries", "layer_logits"]


def grouped_queries(queries: torch.Tensor, num_kv_heads: int, scaling: float) -> torch.Tensor:
    """``scaling * q`` of ``(B, Hq, n_q, d)`` queries in group layout ``(B, Hkv, g, n_q, d)`` float32."""
    B, Hq, nq, d = queries.shape
    return (queries.float() * scaling).reshape(B, num_kv_heads, Hq // num_kv_heads, nq, d)


def layer_logits(
    store: LayerStore, queries: torch.Tensor, positions: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled queries ``scaling * q`` in group layout ``(B, Hkv, g, n_q, d)`` fp32 and their logits over the store's
    slots (pass the queries to :func:`~slake.attention.ptaa.attend` with ``scaling=1.0``).

    Logits are ``(scaling * q) . k`` in fp32, ``-inf`` for empty slots and for keys after the query's position.
    ``positions=None`` means one query at the newest position, which sees every stored token (no causal test).
    The ``g * n_q`` query rows of a KV head share one matmul against its keys (no per-query-head expansion or
    copy of the cache); an fp32 cache is used as is, a low-precision one through :func:`matmul_f32`.
    """
    qf = grouped_queries(queries, store.keys.shape[1], scaling)
    B, H, g, nq, d = qf.shape
    x = matmul_f32(qf.reshape(B, H, g * nq, d), store.dense_keys().transpose(-1, -2)).view(B, H, g, nq, -1)
    if positions is None:
        visible = store.valid[:, :, None, None, :]
    else:
        visible = store.valid[:, :, None, None, :] & (
            store.positions[:, :, None, None, :] <= positions.view(1, 1, 1, nq, 1)
        )
    if store.head_visible is not None:  # per-query-head visibility (SAGE-KV)
        visible = visible & store.head_visible[:, :, :, None, :]
    return qf, x.masked_fill_(~visible, float("-inf"))
