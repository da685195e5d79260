"""Regressions of the fifth audit of ``slake.cache`` (multi-token appends).

A block of several new tokens (a later chat turn, a prompt chunk of a chunked prefill) is written into a layer's store
by :meth:`slake.cache.layer_store.LayerStore.append`, a ``scatter_`` along the slot axis. ``scatter_`` only requires
its source to be at least as large as the index in every dimension, so keys and values whose batch, KV heads or head
size did not match the layer's (a batch of 2 continuing a cache prefilled with 1, a model with other KV heads, keys in
the token-major ``(B, n, Hkv, d)`` layout) were silently cut to the store's shape: SnapKV then answered the second
sequence from the first one's cache, with no error. They are refused now, before the layer changes.
"""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.cache.layer_store import LayerStore
from slake.methods import make_method

B, HQ, HKV, S, D, C = 1, 4, 2, 24, 8, 10


def _engine(spec: str = "snapkv[window=4]", chunked: bool = False) -> CompressedKV:
    """A one-layer engine prefilled with ``S`` random tokens (budget ``C``), or the first 8 of them in a chunked
    prefill."""
    g = torch.Generator().manual_seed(0)
    eng = CompressedKV(make_method(spec), C, 1, kernels="torch")
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (HQ, HKV, HKV))
    if chunked:
        eng.begin_chunked_prefill(torch.zeros(B, S, dtype=torch.bool))
        q, k, v = q[:, :, :8], k[:, :, :8], v[:, :, :8]
    eng.prefill_layer(0, q, k, v, None, D**-0.5)
    return eng


WRONG = {
    "batch": ((2, HKV, 3, D), (2, HKV, 3, D)),
    "kv_heads": ((B, 2 * HKV, 3, D), (B, 2 * HKV, 3, D)),
    "head_size": ((B, HKV, 3, 2 * D), (B, HKV, 3, 2 * D)),
    "token_major": ((B, 3, HKV, D), (B, 3, HKV, D)),
    "values": ((B, HKV, 3, D), (B, HKV, 2, D)),
}


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("case", sorted(WRONG))
def test_a_block_whose_shape_does_not_match_the_layer_is_refused(case, chunked):
    """Keys/values of another batch, KV-head count or head size, in the token-major layout, or of different token
    counts: a ValueError naming the shapes, and the layer as it was (before the fix SnapKV took a batch of 2 into a
    batch-1 cache and returned a (2, Hq, 3, d) output whose second row read the first row's cache)."""
    eng = _engine(chunked=chunked)
    store = eng.layers[0]
    before = (store.keys.clone(), store.valid.clone(), store.positions.clone(), eng.seen[0])
    kshape, vshape = WRONG[case]
    with pytest.raises(ValueError, match=r"keys and values"):
        eng.append(0, torch.randn(kshape), torch.randn(vshape))
    assert torch.equal(store.keys, before[0]) and torch.equal(store.valid, before[1])
    assert torch.equal(store.positions, before[2]) and eng.seen[0] == before[3]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_block_of_the_layer_s_shape_is_still_taken(chunked):
    """The check refuses nothing right: a 3-token block of the layer's shape is appended and attended."""
    eng = _engine(chunked=chunked)
    g = torch.Generator().manual_seed(1)
    seen = eng.seen[0]
    eng.append(0, torch.randn(B, HKV, 3, D, generator=g), torch.randn(B, HKV, 3, D, generator=g))
    out = eng.decode_attention(0, torch.randn(B, HQ, 3, D, generator=g), D**-0.5)
    assert out.shape == (B, HQ, 3, D) and bool(torch.isfinite(out).all())
    assert eng.seen[0] == seen + 3


def test_a_prefix_keep_cuts_per_head_visibility_on_its_slot_axis() -> None:
    """``keep(order=None)`` (the CAKE cascade's later steps, slots already in preference order) slices the slots of
    every per-slot tensor; per-query-head visibility ``(B, Hkv, G, n)`` has its slots last, and was cut on its group
    axis instead (a store of 2 query heads per KV head kept all 6 visibility columns)."""
    B, H, G, n, d = 1, 2, 2, 6, 4
    visible = torch.rand(B, H, G, n, generator=torch.Generator().manual_seed(3)) > 0.3
    store = LayerStore(
        torch.randn(B, H, n, d),
        torch.randn(B, H, n, d),
        torch.arange(n).expand(B, H, n).clone(),
        torch.ones(B, H, n, dtype=torch.bool),
        torch.zeros(B, H, n),
        head_visible=visible.clone(),
    )
    store.keep(None, torch.full((B, H), 4), positional=False)
    assert store.head_visible is not None
    assert store.head_visible.shape == (B, H, G, 4)
    assert torch.equal(store.head_visible, visible[..., :4])
