"""PTAA closed form and the linear state (spec slake-cake.md sections 8.1, 8.2, 11; invariants 1-4, 6, 7)."""

from __future__ import annotations

import math

import pytest
import torch

from slake.attention.linear_state import LinearState
from slake.attention.ptaa import attend

F64 = torch.float64
GEN = torch.Generator().manual_seed(1)


def brute_force_ptaa(q, keys, values, kept, evicted, scaling, shift=0.0):
    """Taylor-weighted softmax over ALL tokens, one query head at a time (spec 8.1, 'brute-force definition').

    ``q (B,Hq,nq,d)``, ``keys/values (B,Hkv,N,d)``, ``kept/evicted (B,Hkv,N)`` bool (other slots are invisible).
    The reference shift is ``max(kept max, mu) + shift``; the result must not depend on it (invariant 4).
    """
    B, Hq, nq, d = q.shape
    g = Hq // keys.shape[1]
    out = torch.zeros(B, Hq, nq, d, dtype=F64)
    for b in range(B):
        for h in range(Hq):
            kh = h // g
            kp, ev = kept[b, kh], evicted[b, kh]
            for i in range(nq):
                x = scaling * keys[b, kh].double() @ q[b, h, i].double()
                if not (kp.any() or ev.any()):
                    continue
                mu = x[ev].mean() if ev.any() else None
                cands = ([x[kp].max()] if kp.any() else []) + ([mu] if mu is not None else [])
                m = max(cands) + shift
                w = torch.zeros_like(x)
                w[kp] = torch.exp(x[kp] - m)
                if mu is not None:
                    w[ev] = torch.exp(mu - m) * (1 + x[ev] - mu)
                out[b, h, i] = w @ values[b, kh].double() / w.sum()
    return out


def closed_form(q, keys, values, kept, evicted, scaling, state_dtype=F64):
    """Fold ``evicted`` into a LinearState and call :func:`attend` on logits masked to ``kept``."""
    B, Hq, nq, d = q.shape
    Hkv = keys.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, nq, d)
    logits = scaling * torch.einsum("bhgqd,bhnd->bhgqn", qg.to(state_dtype), keys.to(state_dtype))
    logits = logits.masked_fill(~kept[:, :, None, None, :], float("-inf"))
    state = LinearState.empty(B, Hkv, d, dtype=state_dtype)
    state.fold(keys, values, evicted)
    out = attend(qg.to(state_dtype), logits, values, state, scaling=scaling)
    return out.reshape(B, Hq, nq, d), state


def _random_case(B=2, Hq=6, Hkv=2, nq=3, N=40, d=8, dtype=F64):
    q = torch.randn(B, Hq, nq, d, generator=GEN, dtype=dtype) * 1.5
    keys = torch.randn(B, Hkv, N, d, generator=GEN, dtype=dtype) + 0.3
    values = torch.randn(B, Hkv, N, d, generator=GEN, dtype=dtype)
    u = torch.rand(B, Hkv, N, generator=GEN)
    p_kept, p_ev = torch.rand(2, generator=GEN).tolist()
    kept = u < p_kept * 0.8
    evicted = (u >= p_kept * 0.8) & (u < p_kept * 0.8 + (1 - p_kept * 0.8) * p_ev)
    return q, keys, values, kept, evicted, d**-0.5


def test_zero_evicted_equals_softmax_invariant_1():
    q, keys, values, kept, _, s = _random_case()
    none = torch.zeros_like(kept)
    out, _ = closed_form(q, keys, values, kept, none, s)
    B, Hq, nq, d = q.shape
    qg = q.reshape(B, 2, 3, nq, d)
    logits = (s * torch.einsum("bhgqd,bhnd->bhgqn", qg, keys)).masked_fill(~kept[:, :, None, None, :], float("-inf"))
    exact = torch.nan_to_num(torch.softmax(logits, -1)) @ values[:, :, None]
    torch.testing.assert_close(out, exact.reshape(B, Hq, nq, d), rtol=0, atol=1e-12)
    torch.testing.assert_close(attend(qg, logits, values, None, s), exact, rtol=0, atol=1e-12)


def test_budget_zero_is_pure_taylor_invariant_2():
    q, keys, values, _, _, s = _random_case(B=1, Hq=2, Hkv=2, nq=1)
    kept = torch.zeros(1, 2, 40, dtype=torch.bool)
    out, _ = closed_form(q, keys, values, kept, ~kept, s)
    for h in range(2):
        x = s * keys[0, h] @ q[0, h, 0]
        taylor = ((1 + x - x.mean()) / x.numel()) @ values[0, h]
        torch.testing.assert_close(out[0, h, 0], taylor, rtol=0, atol=1e-12)


def test_closed_form_equals_brute_force_gqa_batch_invariants_3_6():
    for trial in range(40):
        g = [1, 2, 4][trial % 3]
        q, keys, values, kept, evicted, s = _random_case(B=2, Hq=2 * g, Hkv=2, nq=2, N=int(torch.randint(1, 30, (1,))))
        out, _ = closed_form(q, keys, values, kept, evicted, s)
        ref = brute_force_ptaa(q, keys, values, kept, evicted, s)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # GQA: grouped state == the same computation with K, V and the state repeated per query head (g = 1)
    q, keys, values, kept, evicted, s = _random_case(B=2, Hq=6, Hkv=2, nq=2)
    out, _ = closed_form(q, keys, values, kept, evicted, s)
    rep = [t.repeat_interleave(3, 1) for t in (keys, values, kept, evicted)]
    out_mha, _ = closed_form(q, *rep, s)
    torch.testing.assert_close(out, out_mha, rtol=0, atol=1e-12)


def test_shift_invariance_and_overflow_guard_invariant_4():
    """Kept logits far below the evicted mean: Algorithm 1's literal shift would overflow (spec 11.2)."""
    d, N = 64, 48
    u = torch.nn.functional.normalize(torch.randn(d, generator=GEN, dtype=F64), dim=0)
    evicted = torch.zeros(1, 1, N, dtype=torch.bool)
    evicted[..., : N // 2] = True
    keys = torch.where(evicted[..., None], u, -u) + 0.01 * torch.randn(1, 1, N, d, generator=GEN, dtype=F64)
    values = torch.randn(1, 1, N, d, generator=GEN, dtype=F64)
    q = (480 * u).reshape(1, 1, 1, d)  # x ~ +60 for evicted, -60 for kept keys: exp(mu - kept max) = exp(120)
    for shift in (0.0, 3.0, -7.0):
        ref = brute_force_ptaa(q, keys, values, ~evicted, evicted, d**-0.5, shift=shift)
        out32, _ = closed_form(q.float(), keys.float(), values.float(), ~evicted, evicted, d**-0.5, torch.float32)
        out64, _ = closed_form(q, keys, values, ~evicted, evicted, d**-0.5)
        torch.testing.assert_close(out64, ref, rtol=1e-10, atol=1e-12)
        assert torch.isfinite(out32).all()
        torch.testing.assert_close(out32.double(), ref, rtol=1e-3, atol=1e-3)


def test_jensen_and_positive_denominator_invariant_7():
    negative_weights = 0
    for _ in range(30):
        q, keys, values, kept, evicted, s = _random_case(B=1, Hq=2, Hkv=2, nq=1)
        _, state = closed_form(q, keys, values, kept, evicted, s)
        for h in range(2):
            if not evicted[0, h].any():
                continue
            x = s * keys[0, h] @ q[0, h, 0]
            mu = s * q[0, h, 0] @ state.k_sum[0, h] / state.count[0, h]
            assert state.count[0, h] * torch.exp(mu) <= torch.exp(x[evicted[0, h]]).sum() * (1 + 1e-12)
            den = torch.exp(x[kept[0, h]]).sum() + state.count[0, h] * torch.exp(mu)
            assert den > 0
            negative_weights += int(((1 + x[evicted[0, h]] - mu) < 0).sum())
    assert negative_weights > 0  # negative Taylor weights do occur and are not clamped


def test_empty_rows_give_zeros_not_nan():
    B, Hkv, g, nq, n, d = 2, 1, 2, 1, 5, 4
    q = torch.randn(B, Hkv, g, nq, d, generator=GEN)
    logits = torch.full((B, Hkv, g, nq, n), float("-inf"))
    logits[1, ..., :3] = torch.randn(Hkv, g, nq, 3, generator=GEN)
    values = torch.randn(B, Hkv, n, d, generator=GEN)
    state = LinearState.empty(B, Hkv, d)
    for st in (None, state):
        out = attend(q, logits, values, st, scaling=0.5)
        assert torch.isfinite(out).all() and out.dtype == torch.float32
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out[1], torch.softmax(logits[1], -1) @ values[1][:, None])
    # batch element 0 has only a linear term: pure Taylor attention over its folded tokens
    ev = torch.zeros(B, Hkv, n, dtype=torch.bool)
    ev[0] = True
    state.fold(torch.randn(B, Hkv, n, d, generator=GEN), values, ev)
    out = attend(q, logits, values, state, scaling=0.5)
    assert torch.isfinite(out).all() and out[0].abs().sum() > 0
    torch.testing.assert_close(out[1], torch.softmax(logits[1], -1) @ values[1][:, None])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_finite(dtype):
    q, keys, values, kept, evicted, s = _random_case(B=2, Hq=4, Hkv=2, nq=1, N=300, d=64, dtype=F64)
    keys, values, q = (keys * 6).to(dtype), (values * 50).to(dtype), (q * 6).to(dtype)  # large logits
    out, state = closed_form(q.float(), keys, values, kept, evicted, s, torch.float32)
    assert state.kv.dtype == torch.float32 and torch.isfinite(out).all()
    ref = brute_force_ptaa(q.double(), keys.double(), values.double(), kept, evicted, s)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-2 * float(ref.abs().max()))


# ---------------------------------------------------------------------------------------------- LinearState
def test_linear_state_fold_and_batch_ops():
    B, H, n, d = 3, 2, 7, 4
    keys = torch.randn(B, H, n, d, generator=GEN).half()
    values = torch.randn(B, H, n, d, generator=GEN).half()
    ev = torch.rand(B, H, n, generator=GEN) < 0.5
    keys[~ev] = float("nan")  # unmarked rows are ignored even when non-finite
    st = LinearState.empty(B, H, d)
    st.fold(keys, values, ev)
    assert st.kv.dtype == torch.float32 and torch.isfinite(st.kv).all()
    kf, vf = torch.nan_to_num(keys.float()) * ev[..., None], values.float() * ev[..., None]
    torch.testing.assert_close(st.kv, kf.transpose(-1, -2) @ vf)
    torch.testing.assert_close(st.k_sum, kf.sum(2))
    torch.testing.assert_close(st.v_sum, vf.sum(2))
    assert torch.equal(st.count, ev.sum(-1).float())
    assert st.nbytes() == 4 * (B * H * (2 * d + d * d + 1))
    cl = st.clone()
    cl.fold(keys, values, ~ev)
    assert not torch.equal(cl.count, st.count) and torch.equal(st.count, ev.sum(-1).float())
    ref = st.clone()
    assert st.select_batch(torch.tensor([2, 0])) is st  # in place, as the engine's LayerStore uses it
    assert torch.equal(st.kv, ref.kv[[2, 0]]) and torch.equal(st.count, ref.count[[2, 0]])
    st.repeat_interleave(2)
    assert st.batch_size == 4 and torch.equal(st.v_sum[1], ref.v_sum[2]) and torch.equal(st.v_sum[2], ref.v_sum[0])
    with pytest.raises(ValueError):
        ref.fold(keys[:, :1], values[:, :1], ev[:, :1])
    with pytest.raises(ValueError):
        ref.fold(keys, values, ev.float())
    with pytest.raises(ValueError):
        LinearState.empty(1, 1, 4, dtype=torch.float16)


def test_attend_validates_shapes():
    with pytest.raises(ValueError):
        attend(torch.zeros(1, 1, 1, 1, 4), torch.zeros(1, 1, 1, 1, 3), torch.zeros(1, 1, 2, 4))
    assert math.isclose(
        float(attend(torch.zeros(1, 1, 1, 1, 4), torch.zeros(1, 1, 1, 1, 2), torch.ones(1, 1, 2, 4)).mean()), 1.0
    )


def test_long_folds_run_in_row_blocks_with_the_same_state(monkeypatch):
    """A prefill-sized fold runs 1024 rows at a time (bounded transient copies): same state as one product."""
    from slake.attention import linear_state

    keys, values = torch.randn(2, 3, 2500, 8, generator=GEN), torch.randn(2, 3, 2500, 8, generator=GEN)
    evicted = torch.rand(2, 3, 2500, generator=GEN) < 0.8
    blocked = LinearState.empty(2, 3, 8)
    blocked.fold(keys, values, evicted)
    monkeypatch.setattr(linear_state, "_FOLD_BLOCK", 1 << 30)
    whole = LinearState.empty(2, 3, 8)
    whole.fold(keys, values, evicted)
    torch.testing.assert_close(blocked.aug, whole.aug, rtol=1e-5, atol=1e-3)
    assert torch.equal(blocked.count, evicted.sum(-1).float())
