"""The fused PTAA step (augmented linear state, one product for the linear term) equals the previous implementation.

The functions below are verbatim copies of ``attend`` and ``LinearState.fold`` before the augmented state (spec
``slake-cake.md`` sections 8.2, 8.5, 8.6); the new code must give the same results up to float rounding, on random
data and over a whole engine decode with eviction.
"""

from __future__ import annotations

import pytest
import torch

from slake.attention import ptaa
from slake.attention.linear_state import LinearState
from slake.attention.ptaa import attend
from slake.cache import decode_step, decoding
from slake.cache.compressed import CompressedKV
from slake.methods import make_method

GEN = torch.Generator().manual_seed(7)


def old_attend(query, logits, values, state=None, scaling=None, overwrite_logits=False):
    """``slake.attention.ptaa.attend`` before the fused version (separate k_sum / v_sum / L / count)."""
    B, H, g, nq, d = query.shape
    n = values.shape[2]
    cdt = torch.promote_types(torch.promote_types(query.dtype, logits.dtype), torch.float32)
    x = logits.to(cdt).reshape(B, H, g * nq, n)
    v = values.to(cdt)
    m = x.amax(-1) if n > 0 else x.new_full((B, H, g * nq), float("-inf"))
    lin_on = state is not None
    if lin_on:
        s = d**-0.5 if scaling is None else float(scaling)
        q = query.to(cdt).reshape(B, H, g * nq, d)
        cnt = state.count.to(cdt)[..., None]
        has = cnt > 0
        mu = torch.matmul(q, state.k_sum.to(cdt)[..., None])[..., 0] * s / cnt.clamp_min(1)
        m = torch.where(has, torch.maximum(m, mu), m)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m[..., None])
    num = torch.matmul(e, v)
    den = e.sum(-1)
    if lin_on:
        lam = torch.where(has, torch.exp(mu - m), torch.zeros_like(mu))
        lin = torch.matmul(q, state.kv.to(cdt)) * s + (1 - mu)[..., None] * state.v_sum.to(cdt)[:, :, None, :]
        num = num + lam[..., None] * lin
        den = den + lam * cnt
    out = torch.where(den[..., None] > 0, num / den.clamp_min(torch.finfo(cdt).tiny)[..., None], 0.0)
    return out.reshape(B, H, g, nq, d)


def old_fold(self, keys, values, evicted, finite=False):
    """``LinearState.fold`` before the augmented matrix (four separate in-place updates); ``evicted=None`` is the
    later shorthand for every row."""
    if evicted is None:
        evicted = torch.ones(keys.shape[:3], dtype=torch.bool)
    m = evicted[..., None].to(self.k_sum.device)
    k = torch.where(m, keys.to(self.k_sum), 0.0)
    v = torch.where(m, values.to(self.v_sum), 0.0)
    self.k_sum += k.sum(2)
    self.v_sum += v.sum(2)
    self.kv += torch.matmul(k.transpose(-1, -2), v)
    self.count += m[..., 0].sum(-1).to(self.count.dtype)


def old_fold_slots(self, keys, values, slots, chosen):
    """The decode fold before ``LinearState.fold_slots``: gather the slots' rows, then fold the chosen ones."""
    gi = slots[..., None].expand(-1, -1, -1, keys.shape[-1])
    old_fold(self, keys.gather(2, gi), values.gather(2, gi), chosen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_attend_and_fold_equal_previous_implementation(dtype):
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-5)
    for trial in range(30):
        B, Hkv, g, nq, n, d = (
            2,
            2,
            [1, 2, 3][trial % 3],
            [1, 2][trial % 2],
            int(torch.randint(1, 40, (1,), generator=GEN)),
            8,
        )
        q = torch.randn(B, Hkv, g, nq, d, generator=GEN, dtype=dtype) * 2
        keys = torch.randn(B, Hkv, 3 * n, d, generator=GEN, dtype=dtype) + 0.3
        values = torch.randn(B, Hkv, 3 * n, d, generator=GEN, dtype=dtype)
        evicted = torch.rand(B, Hkv, 3 * n, generator=GEN) < 0.6
        evicted[0, 0] = False  # a head with nothing folded: no linear term
        new, old = LinearState.empty(B, Hkv, d, dtype=dtype), LinearState.empty(B, Hkv, d, dtype=dtype)
        for sl in (slice(0, n), slice(n, 3 * n)):  # two folds, as prefill then decode
            new.fold(keys[:, :, sl], values[:, :, sl], evicted[..., sl], finite=bool(trial % 2))
            old_fold(old, keys[:, :, sl], values[:, :, sl], evicted[..., sl])
        for name in ("k_sum", "v_sum", "kv", "count"):
            torch.testing.assert_close(getattr(new, name), getattr(old, name), **tol)
        logits = torch.einsum("bhgqd,bhnd->bhgqn", q, keys[:, :, :n]) * d**-0.5
        logits = logits.masked_fill(torch.rand(B, Hkv, 1, 1, n, generator=GEN) < 0.3, float("-inf"))
        logits[1, 1] = float("-inf")  # a head with only the linear term
        for st in (None, new):
            out = attend(q, logits, values[:, :, :n], st, d**-0.5)
            ref = old_attend(q, logits, values[:, :, :n], old if st is not None else None, d**-0.5)
            torch.testing.assert_close(out, ref, **tol)
            assert out.dtype == ref.dtype


def _run_engine(method: str, steps: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    L, B, HQ, HKV, S, D = 2, 2, 6, 2, 70, 16
    eng = CompressedKV(make_method(method), 40, L)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :7] = True
    for layer in range(L):
        q = torch.randn(B, HQ, S, D, generator=g) * 2
        k = torch.randn(B, HKV, S, D, generator=g) * 2 + 0.5
        v = torch.randn(B, HKV, S, D, generator=g)
        eng.prefill_layer(layer, q, k, v, pad, D**-0.5)
    outs = []
    for _ in range(steps):
        for layer in range(L):
            eng.append(layer, torch.randn(B, HKV, 1, D, generator=g) * 2 + 0.5, torch.randn(B, HKV, 1, D, generator=g))
            outs.append(eng.decode_attention(layer, torch.randn(B, HQ, 1, D, generator=g) * 2, D**-0.5))
    return outs, [s.linear.aug.clone() for s in eng.layers if s.linear is not None]


@pytest.mark.parametrize("method", ["slake", "snapkv[linear_cache=true]"])
def test_engine_decode_step_equals_previous_implementation(method, monkeypatch):
    new_out, new_state = _run_engine(method, 20, seed=3)
    monkeypatch.setattr(decode_step, "attend", old_attend)
    monkeypatch.setattr(decoding, "attend", old_attend)
    monkeypatch.setattr(ptaa, "attend", old_attend)
    monkeypatch.setattr(LinearState, "fold", old_fold)
    monkeypatch.setattr(LinearState, "fold_slots", old_fold_slots)
    old_out, old_state = _run_engine(method, 20, seed=3)
    assert len(new_state) == 2
    for a, b in zip(new_out, old_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(new_state, old_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_fold_without_a_mask_folds_every_row():
    keys, values = torch.randn(2, 3, 1500, 8, generator=GEN), torch.randn(2, 3, 1500, 8, generator=GEN)
    every, masked = LinearState.empty(2, 3, 8), LinearState.empty(2, 3, 8)
    every.fold(keys, values, None)
    masked.fold(keys, values, torch.ones(2, 3, 1500, dtype=torch.bool))
    torch.testing.assert_close(every.aug, masked.aug, rtol=1e-6, atol=1e-4)
    assert torch.equal(every.count, torch.full((2, 3), 1500.0))


def test_linear_state_keeps_its_former_constructor():
    st = LinearState.empty(2, 3, 4)
    st.fold(
        torch.randn(2, 3, 5, 4, generator=GEN),
        torch.randn(2, 3, 5, 4, generator=GEN),
        torch.rand(2, 3, 5, generator=GEN) < 0.5,
    )
    again = LinearState(k_sum=st.k_sum, v_sum=st.v_sum, kv=st.kv, count=st.count)
    assert torch.equal(again.aug, st.aug) and again.aug.data_ptr() != st.aug.data_ptr()
    st.k_sum += 1.0  # in-place update through the view lands in the augmented matrix
    assert torch.equal(st.aug[..., :-1, -1], again.k_sum + 1.0)


@pytest.mark.parametrize("e", [1, 3])
def test_fold_slots_equals_gather_then_fold_and_reuses_its_buffers(e):
    """``fold_slots`` (rows gathered into reused buffers, masked by ``chosen``) equals folding the gathered rows."""
    for B in (2, 1, 2):  # the buffers follow a change of batch size
        keys, values = torch.randn(B, 3, 20, 8, generator=GEN), torch.randn(B, 3, 20, 8, generator=GEN)
        fast, ref = LinearState.empty(B, 3, 8), LinearState.empty(B, 3, 8)
        for _ in range(4):
            slots = torch.stack([torch.randperm(20, generator=GEN)[:e] for _ in range(B * 3)]).view(B, 3, e)
            chosen = torch.rand(B, 3, e, generator=GEN) < 0.7
            chosen[0, 0] = False  # a row with nothing evicted this step
            fast.fold_slots(keys, values, slots, chosen)
            gi = slots[..., None].expand(-1, -1, -1, 8)
            ref.fold(keys.gather(2, gi), values.gather(2, gi), chosen)
        torch.testing.assert_close(fast.aug, ref.aug, rtol=1e-6, atol=1e-5)
        assert float(fast.count[0, 0]) == 0.0
    with pytest.raises(ValueError, match="fold_slots"):
        fast.fold_slots(keys.double(), values.double(), slots, chosen)


def test_attend_may_overwrite_its_logits_with_the_same_result():
    q = torch.randn(2, 2, 3, 1, 8, generator=GEN)
    keys, values = torch.randn(2, 2, 12, 8, generator=GEN), torch.randn(2, 2, 12, 8, generator=GEN)
    state = LinearState.empty(2, 2, 8)
    state.fold(
        torch.randn(2, 2, 5, 8, generator=GEN),
        torch.randn(2, 2, 5, 8, generator=GEN),
        torch.ones(2, 2, 5, dtype=torch.bool),
    )
    logits = torch.einsum("bhgqd,bhnd->bhgqn", q, keys)
    logits[..., 3] = float("-inf")
    for st in (None, state):
        kept = logits.clone()
        ref = attend(q, kept, values, st, 1.0)
        assert torch.equal(kept, logits)  # untouched without overwrite_logits
        scratch = logits.clone()
        torch.testing.assert_close(attend(q, scratch, values, st, 1.0, overwrite_logits=True), ref)
        # the linear term sees scaling * query: pre-scaled queries with scaling=1.0 give the same output
        torch.testing.assert_close(attend(q / 4.0, logits, values, st, 4.0), ref)
