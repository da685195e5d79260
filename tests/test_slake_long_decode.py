"""SLAKE over a 300-step decode past the budget: constant kept size, consistent counts, finite output (spec 12.5)."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_300_step_decode_keeps_size_and_counts(dtype):
    g = torch.Generator().manual_seed(0)
    L, B, HQ, HKV, S, D = 2, 2, 6, 2, 80, 16
    eng = CompressedKV(make_method("slake"), 48, L)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :10] = True  # a left-padded second sequence
    for layer in range(L):
        q = (torch.randn(B, HQ, S, D, generator=g) * 2).to(dtype)
        k = (torch.randn(B, HKV, S, D, generator=g) * 2 + 0.5).to(dtype)  # non-zero key mean, as real keys
        v = torch.randn(B, HKV, S, D, generator=g).to(dtype)
        eng.prefill_layer(layer, q, k, v, pad, D**-0.5)
    kept0 = [s.counts().clone() for s in eng.layers]
    real = torch.tensor([S, S - 10])
    for step in range(300):
        for layer in range(L):
            k = (torch.randn(B, HKV, 1, D, generator=g) * 2 + 0.5).to(dtype)
            v = torch.randn(B, HKV, 1, D, generator=g).to(dtype)
            q = (torch.randn(B, HQ, 1, D, generator=g) * 2).to(dtype)
            eng.append(layer, k, v)
            out = eng.decode_attention(layer, q, D**-0.5)
            assert out.shape == (B, HQ, 1, D)
            assert bool(torch.isfinite(out).all()), f"step {step} layer {layer}"
    for layer, store in enumerate(eng.layers):
        assert torch.equal(store.counts(), kept0[layer])
        seen = (real + 300).view(B, 1).expand(B, HKV)
        # every token is either kept or folded into the linear state, never both, never lost
        assert torch.equal(store.linear.count.round().long() + store.counts(), seen)
        assert store.linear.k_sum.dtype == torch.float32
        assert bool(torch.isfinite(store.linear.kv).all())
        # the newest window tokens are kept
        newest = store.positions.max(-1).values
        assert bool((newest == S + 299).all())
