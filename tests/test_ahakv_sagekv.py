"""AhaKV (guide section 2.9) and SAGE-KV (guide section 3.8) invariants on random tensors."""

from __future__ import annotations

import math

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method
from slake.methods.ahakv import ahakv_gain, sg_rows, value_prior
from slake.methods.base import PrefillInputs
from slake.methods.common import group_mean, window_attention
from slake.methods.h2o import accumulated_attention
from slake.methods.sagekv import sagekv_partition

L, B, HQ, HKV, S, D = 2, 2, 4, 2, 96, 8
G = HQ // HKV
SCALE = D**-0.5


def _qkv(seed: int, b: int = B, s: int = S):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, HQ, s, D, generator=g) * 2,
        torch.randn(b, HKV, s, D, generator=g) * 2,
        torch.randn(b, HKV, s, D, generator=g),
    )


def _inputs(q, k, v, window, budget):
    pad = torch.zeros(q.shape[0], k.shape[2], dtype=torch.bool)
    return PrefillInputs(q, k, v, pad, SCALE, window, 0, L, torch.full((q.shape[0],), budget))


def _engine(name, budget, seed=0, **hyper):
    method = make_method(name, **hyper)
    eng = CompressedKV(method, budget, L)
    data = [_qkv(seed + layer) for layer in range(L)]
    for layer, (q, k, v) in enumerate(data):
        eng.prefill_layer(layer, q, k, v, None, SCALE)
    return eng, method, data


def _decode_step(eng, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for layer in range(L):
        k, v = torch.randn(B, HKV, 1, D, generator=g) * 2, torch.randn(B, HKV, 1, D, generator=g)
        eng.append(layer, k, v)
        eng.decode_attention(layer, torch.randn(B, HQ, 1, D, generator=g) * 2, SCALE)


def _kept(store, b, h):
    return set(store.positions[b, h][store.valid[b, h]].tolist())


# ============================================================================================== AhaKV
def test_gain_is_one_at_b_sqrt_e_and_matches_the_guide_numbers():
    assert math.isclose(float(ahakv_gain(1000 * math.exp(0.5), 1000)), 1.0, rel_tol=1e-12)
    for n, c in [(1300, 0.72), (2000, 1.18), (8000, 2.04), (32000, 2.63)]:
        assert abs(float(ahakv_gain(n, 1000)) - c) < 0.01
    assert float(ahakv_gain(500, 1000)) > 0 and float(ahakv_gain(500, 1000, floor=True)) == 1.0
    assert float(ahakv_gain(1300, 1000, floor=True)) == 1.0


def test_scoring_rows_equal_standard_attention_when_prompt_is_b_sqrt_e():
    q, k, v = _qkv(1)
    budget = S / math.exp(0.5)  # N = B * e^0.5
    gain = ahakv_gain(torch.full((B,), S), torch.full((B,), budget))
    torch.testing.assert_close(gain, torch.ones(B, dtype=torch.float64))
    inputs = _inputs(q, k, v, 32, 58)
    torch.testing.assert_close(sg_rows(inputs, gain), window_attention(q, k, 32, SCALE))


def test_sg_entropy_decreases_with_gain_and_rows_sum_to_r():
    q, k, v = _qkv(2)
    inputs = _inputs(q, k, v, 32, 40)
    ents = []
    for c in [0.5, 1.0, 1.5, 2.0, 3.0]:
        p = sg_rows(inputs, torch.full((B,), c))
        torch.testing.assert_close(p.sum((2, 3)), torch.full((B, HQ), 32.0))  # sum_j F_h[j] == r
        ents.append(float(-(p * torch.log(p + 1e-30)).sum()))
    assert all(b <= a + 1e-4 for a, b in zip(ents, ents[1:]))


def test_value_prior_range_and_scale_invariance():
    _, _, v = _qkv(3)
    pad = torch.zeros(B, S, dtype=torch.bool)
    gbar = value_prior(v, pad)
    assert bool((gbar > 0).all()) and bool((gbar <= 1).all())
    torch.testing.assert_close(gbar.amax(-1), torch.ones(B, HKV))
    v2 = v.clone()
    v2[:, 0] *= 7.0
    torch.testing.assert_close(value_prior(v2, pad), gbar)


def test_h2o_limit_of_the_score():
    """c = 1, no value prior, no pooling and r = N rows give H2O's causal column sums."""
    q, k, v = _qkv(4)
    rows = sg_rows(_inputs(q, k, v, S, 40), torch.ones(B))
    torch.testing.assert_close(
        group_mean(rows.sum(2), HKV), group_mean(accumulated_attention(q, k, SCALE, None), HKV), rtol=1e-4, atol=1e-4
    )


def test_ahakv_prefill_keeps_top_candidates_plus_recent_and_seeds_acc():
    eng, method, data = _engine("ahakv", 40)
    w = method.window
    for layer, (q, k, v) in enumerate(data):
        store = eng.layers[layer]
        assert bool((store.counts() == 40).all())
        ref = method.prefill_scores(_inputs(q, k, v, w, 40)).scores
        for b in range(B):
            for h in range(HKV):
                top = torch.sort(ref[b, h, : S - w], descending=True, stable=True).indices[: 40 - w]
                assert _kept(store, b, h) == set(top.tolist()) | set(range(S - w, S))
                valid = store.valid[b, h]  # acc of every kept slot (the recent window included) = refined score
                torch.testing.assert_close(store.scores[b, h][valid], ref[b, h][store.positions[b, h][valid]])


def test_ahakv_decode_evicts_the_smallest_acc_and_acc_only_grows():
    eng, method, _ = _engine("ahakv", 40, seed=5)
    captured = {}
    decode = method.decode_scores

    def spy(inputs):
        out = decode(inputs)
        captured["before"] = (inputs.stored.clone(), inputs.positions.clone(), inputs.valid.clone())
        captured["after"] = out.clone()
        return out

    method.decode_scores = spy
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        store = eng.layers[0]
        k, v = torch.randn(B, HKV, 1, D, generator=g) * 2, torch.randn(B, HKV, 1, D, generator=g)
        eng.append(0, k, v)
        eng.decode_attention(0, torch.randn(B, HQ, 1, D, generator=g) * 2, SCALE)
        stored, pos, valid = captured["before"]
        acc = captured["after"]
        newest = S + step
        assert bool((acc[valid] >= stored[valid] - 1e-6).all())  # acc only grows (new slot starts at 0)
        assert bool((store.counts() == 40).all())
        for b in range(B):
            for h in range(HKV):
                gone = set(pos[b, h][valid[b, h]].tolist()) - _kept(store, b, h)
                assert len(gone) == 1
                assert set(range(newest - method.window + 1, newest + 1)) <= _kept(store, b, h)
                old = valid[b, h] & (pos[b, h] <= newest - method.window)
                victim = pos[b, h][old][acc[b, h][old].argmin()]
                assert gone == {int(victim)}


# ============================================================================================== SAGE-KV
def test_sagekv_partition_sums_to_the_budget():
    for budget, g in [(8192, 4), (8192, 7), (40, 2), (33, 3)]:
        s, k, r = (int(t) for t in sagekv_partition(torch.tensor([budget]), g))
        assert s + g * k + r == budget and s == budget // 4 and k == budget // (2 * g) and r >= budget // 4
    s, k, r = (int(t) for t in sagekv_partition(torch.tensor([8192]), 7, k=512))  # Qwen2.5 example, guide 3.3
    assert (s, k, r + 0) == (2048, 512, 8192 - 2048 - 7 * 512)


def test_sagekv_selection_visibility_and_sizes():
    budget = 40
    eng, method, data = _engine("sagekv", budget)
    s_n, k_n, r_n = (int(t) for t in sagekv_partition(torch.tensor([budget]), G))
    for layer, (q, k, _v) in enumerate(data):
        store = eng.layers[layer]
        assert bool((store.counts() <= budget).all())
        for b in range(B):
            for h in range(HKV):
                kept = _kept(store, b, h)
                union = set()
                for m in range(G):
                    logit = (q[b, h * G + m, -1] @ k[b, h].T)[s_n : S - r_n]
                    top = set((torch.sort(logit, descending=True, stable=True).indices[:k_n] + s_n).tolist())
                    union |= top
                    vis = store.head_visible[b, h, m] & store.valid[b, h]
                    seen = set(store.positions[b, h][vis].tolist())
                    assert seen == set(range(s_n)) | top | set(range(S - r_n, S)), (layer, b, h, m)
                assert kept == set(range(s_n)) | union | set(range(S - r_n, S))
                assert len(kept) == s_n + len(union) + r_n


def test_sagekv_masked_attention_equals_per_query_head_gathered_cache():
    eng, method, data = _engine("sagekv", 40, seed=7)
    s_n, k_n, r_n = (int(t) for t in sagekv_partition(torch.tensor([40]), G))
    q, k, v = data[0]
    g = torch.Generator().manual_seed(3)
    kn, vn, qn = (
        torch.randn(B, HKV, 1, D, generator=g),
        torch.randn(B, HKV, 1, D, generator=g),
        torch.randn(B, HQ, 1, D, generator=g),
    )
    eng.append(0, kn, vn)
    out = eng.decode_attention(0, qn, SCALE)  # (B, Hq, 1, d)
    K, V = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
    for b in range(B):
        for hq in range(HQ):
            h = hq // G
            logit = (q[b, hq, -1] @ k[b, h].T)[s_n : S - r_n]
            top = (torch.sort(logit, descending=True, stable=True).indices[:k_n] + s_n).tolist()
            idx = list(range(s_n)) + sorted(top) + list(range(S - r_n, S + 1))
            att = torch.softmax((qn[b, hq, 0] @ K[b, h, idx].T) * SCALE, -1)
            torch.testing.assert_close(out[b, hq, 0], att @ V[b, h, idx], rtol=1e-5, atol=1e-5)


def test_sagekv_decode_slides_the_recent_region_only():
    budget = 40
    eng, method, _ = _engine("sagekv", budget, seed=8)
    s_n, k_n, r_n = (int(t) for t in sagekv_partition(torch.tensor([budget]), G))
    static0 = [[_kept(st, b, h) - set(range(S - r_n, S)) for h in range(HKV) for b in range(B)] for st in eng.layers]
    counts0 = [st.counts().clone() for st in eng.layers]
    for step in range(r_n + 5):  # longer than the recent region: every prompt recent token leaves
        _decode_step(eng, step)
        newest = S + step
        for layer, st in enumerate(eng.layers):
            assert torch.equal(st.counts(), counts0[layer])
            for i, (h, b) in enumerate((h, b) for h in range(HKV) for b in range(B)):
                kept = _kept(st, b, h)
                recent = set(range(newest - r_n + 1, newest + 1))
                assert kept == static0[layer][i] | recent, (layer, step)


def test_sagekv_validation():
    for bad in [dict(window=4), dict(sinks=4), dict(sink_fraction=1.0), dict(k=-1)]:
        with pytest.raises(ValueError):
            make_method("sagekv", **bad)
    eng = CompressedKV(make_method("sagekv", k=20), 40, L)
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match="no room"):
        eng.prefill_layer(0, q, k, v, None, SCALE)
