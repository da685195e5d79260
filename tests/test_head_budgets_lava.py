"""Per-head budgets in the engine (cross-head top-k, AdaKV safeguard) and LAVa's invariants (guide section 1.9)."""

from __future__ import annotations

import math

import pytest
import torch

from slake.budgets.allocation import cross_head_counts, safeguarded_head_counts
from slake.cache.compressed import CompressedKV
from slake.methods import make_method
from slake.methods.base import PrefillInputs
from slake.methods.common import window_attention
from slake.methods.lava import lava_entropy, lava_scores

L, B, HQ, HKV, S, D = 4, 2, 4, 2, 96, 8


def _qkv(seed: int, layers: int = L, vscale: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        q = torch.randn(B, HQ, S, D, generator=g) * 2
        k = torch.randn(B, HKV, S, D, generator=g) * 2
        v = torch.randn(B, HKV, S, D, generator=g) * torch.rand(1, HKV, 1, 1, generator=g) * 3
        out.append((q, k, v))
    return out


def _prefill(name, budget, seed=0, padding=None, **hyper):
    method = make_method(name, **hyper)
    eng = CompressedKV(method, budget, L)
    data = _qkv(seed)
    for layer, (q, k, v) in enumerate(data):
        eng.prefill_layer(layer, q, k, v, padding, D**-0.5)
    return eng, method, data


def _inputs(q, k, v, window, layer=0, budget=40, padding=None):
    pad = torch.zeros(q.shape[0], k.shape[2], dtype=torch.bool) if padding is None else padding
    return PrefillInputs(q, k, v, pad, D**-0.5, window, layer, L, torch.full((q.shape[0],), budget))


def _kept(store, b, h):
    return set(store.positions[b, h][store.valid[b, h]].tolist())


# ---------------------------------------------------------------------------------------------- budgets helpers
def _random_scores(seed, b=3, h=4, n=50):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(b, h, n, generator=g)
    s[torch.rand(b, h, n, generator=g) < 0.1] = float("inf")
    s[torch.rand(b, h, n, generator=g) < 0.2] = float("-inf")
    s[0, 1, :45] = float("-inf")  # a head with few candidates
    return s


@pytest.mark.parametrize("seed", range(3))
def test_cross_head_counts_are_the_global_top_k(seed):
    s = _random_scores(seed)
    cand = torch.isfinite(s)
    total = torch.tensor([0, 37, 10_000])
    counts = cross_head_counts(s, total)
    assert counts.dtype == torch.int64 and bool((counts >= 0).all()) and bool((counts <= cand.sum(-1)).all())
    assert counts.sum(-1).tolist() == torch.minimum(total, cand.flatten(1).sum(-1)).tolist()
    for b in range(3):
        vals = s[b][cand[b]]
        if 0 < total[b] < vals.numel():
            thr = torch.sort(vals, descending=True).values[int(total[b]) - 1]
            assert int((vals > thr).sum()) <= int(total[b]) <= int((vals >= thr).sum())
            for h in range(4):  # each head's count = its entries above the threshold, up to ties
                above, at_least = (s[b, h] > thr) & cand[b, h], (s[b, h] >= thr) & cand[b, h]
                assert int(above.sum()) <= int(counts[b, h]) <= int(at_least.sum())


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_safeguarded_counts_sum_exactly_and_respect_the_floor(alpha):
    s = _random_scores(4)
    s[0, 1] = torch.rand(50)  # every head has enough candidates
    per_head = torch.tensor([5, 12, 9])
    counts = safeguarded_head_counts(s, per_head, alpha)
    cand = torch.isfinite(s).sum(-1)
    assert bool((counts >= 0).all()) and bool((counts <= cand).all())
    assert counts.sum(-1).tolist() == (per_head * 4).tolist()
    floor = (per_head.double() * alpha).floor().long().view(-1, 1)
    assert bool((counts >= torch.minimum(floor, cand)).all())
    if alpha == 0.0:
        assert torch.equal(counts, cross_head_counts(s, per_head * 4))
    if alpha == 1.0:
        assert torch.equal(counts, per_head.view(-1, 1).expand(-1, 4))


def test_default_head_budgets_are_the_uniform_split():
    s = _random_scores(5)
    out = make_method("snapkv").head_budgets(s, torch.tensor([3, 7, 100]))
    assert torch.equal(out, torch.minimum(torch.tensor([3, 7, 100]).view(-1, 1), torch.isfinite(s).sum(-1)))


# ---------------------------------------------------------------------------------------------- engine, per head
@pytest.mark.parametrize(
    "name, hyper", [("lava", {}), ("ada-snapkv", {}), ("ada-snapkv", {"alpha_safeguard": 0.0}), ("ada-pyramidkv", {})]
)
def test_per_head_budgets_sum_exactly_and_stay_in_range(name, hyper):
    eng, method, _ = _prefill(name, 40, seed=1, **hyper)
    sel = eng.info.layer_budgets
    assert sel.sum(-1).tolist() == [L * (40 - method.window)] * B
    varied = False
    for layer, store in enumerate(eng.layers):
        counts = store.counts()  # (B, H), window included
        assert bool((counts >= method.window).all()) and bool((counts <= S).all())
        assert (counts - method.window).sum(-1).tolist() == (sel[:, layer] * HKV).tolist()
        assert torch.equal(eng.targets[layer], counts)
        varied |= bool((counts[:, 0] != counts[:, 1]).any())
        for b in range(B):
            for h in range(HKV):
                assert set(range(S - method.window, S)) <= _kept(store, b, h)  # the window is always kept
    assert varied, "heads never received different budgets"


def test_lava_keeps_the_global_top_k_of_its_scores():
    eng, method, data = _prefill("lava", 40, seed=2)
    final = eng.info.layer_budgets
    w = method.window
    for layer, (q, k, v) in enumerate(data):
        s = method.prefill_scores(_inputs(q, k, v, w, layer)).scores[..., : S - w]
        for b in range(B):
            n = int(final[b, layer]) * HKV
            flat = torch.sort(s[b].flatten(), descending=True, stable=True).indices[:n]
            expect = [set((flat[flat // (S - w) == h] % (S - w)).tolist()) | set(range(S - w, S)) for h in range(HKV)]
            assert [_kept(eng.layers[layer], b, h) for h in range(HKV)] == expect


def _one_shot(name, budget, final, **hyper):
    method = make_method(name, **hyper)
    eng = CompressedKV(method, budget, L)
    real_evict = eng.prefill.evict_to
    # store every layer at full length, then evict once with the final budgets
    eng.prefill.evict_to = lambda *a, **k: None
    for layer, (q, k, v) in enumerate(_qkv(3)):
        eng.prefill_layer(layer, q, k, v, None, D**-0.5)
    for layer in range(L):
        real_evict(layer, final[:, layer], final=True)
    return eng


@pytest.mark.parametrize("floor_mode", ["paper", "reference", "adakv"])
def test_lava_cascade_equals_one_shot_and_stage_budgets_never_grow(floor_mode):
    method = make_method("lava", floor_mode=floor_mode)
    eng = CompressedKV(method, 40, L)
    stages: dict[int, list[list[int]]] = {}
    real_evict = eng.prefill.evict_to

    def recording(layer, sel, final=True):
        stages.setdefault(layer, []).append(sel.tolist())
        real_evict(layer, sel, final=final)

    eng.prefill.evict_to = recording
    for layer, (q, k, v) in enumerate(_qkv(3)):
        eng.prefill_layer(layer, q, k, v, None, D**-0.5)
    for layer, seq in stages.items():
        for a, b in zip(seq, seq[1:]):
            assert all(y <= x for x, y in zip(a, b)), f"layer {layer}: {seq}"
    ref = _one_shot("lava", 40, eng.info.layer_budgets, floor_mode=floor_mode)
    for layer in range(L):
        for b in range(B):
            for h in range(HKV):
                assert _kept(eng.layers[layer], b, h) == _kept(ref.layers[layer], b, h), (layer, b, h)


def test_lava_reference_floor_exceeds_the_paper_total_as_documented():
    eng, method, _ = _prefill("lava", 40, seed=1, floor_mode="reference")
    kept = sum(int((s.counts() - method.window).sum()) for s in eng.layers)
    assert kept >= L * (40 - method.window) * HKV * B  # floor int(0.2 * 40) = 8 per head on top of 0.8 * count


# ---------------------------------------------------------------------------------------------- LAVa scoring
def test_lava_score_matches_the_guide_formula():
    q, k, v = _qkv(6, layers=1)[0]
    w = 32
    s = lava_scores(_inputs(q, k, v, w))
    assert s.shape == (B, HKV, S) and bool((s >= 0).all()) and bool((s[..., S - w :] == 0).all())
    a = window_attention(q, k, w, D**-0.5)[..., : S - w].mean(2)  # (B, Hq, S-w)
    p = torch.nn.functional.max_pool1d(a.reshape(-1, 1, S - w), 7, 1, 3).reshape(B, HQ, S - w)
    vbar = v.abs().sum(-1).amax(-1)  # paper: all N tokens
    ref = vbar[..., None] * p.reshape(B, HKV, HQ // HKV, S - w).amax(2)
    torch.testing.assert_close(s[..., : S - w], ref)
    vbar_c = v[:, :, : S - w].abs().sum(-1).amax(-1)  # reference code: candidates only
    torch.testing.assert_close(
        lava_scores(_inputs(q, k, v, w), value_norm="candidates")[..., : S - w],
        vbar_c[..., None] * p.reshape(B, HKV, HQ // HKV, S - w).amax(2),
    )


def test_lava_value_scaling_of_one_head_scales_only_its_scores():
    q, k, v = _qkv(7, layers=1)[0]
    v2 = v.clone()
    v2[:, 1] *= 3.0
    s1, s2 = lava_scores(_inputs(q, k, v, 32)), lava_scores(_inputs(q, k, v2, 32))
    torch.testing.assert_close(s2[:, 1], 3.0 * s1[:, 1])
    torch.testing.assert_close(s2[:, 0], s1[:, 0])


def test_lava_entropy_range_and_limits():
    assert math.isclose(float(lava_entropy(torch.ones(1, 2, 10), torch.tensor([20]))), 1.0, rel_tol=1e-5)
    one_hot = torch.zeros(1, 2, 10)
    one_hot[0, 1, 3] = 5.0
    assert float(lava_entropy(one_hot, torch.tensor([20]))) < 1e-6
    q, k, v = _qkv(8, layers=1)[0]
    pref = make_method("lava").prefill_scores(_inputs(q, k, v, 32)).preference
    assert pref.shape == (B,) and bool(((pref >= 0) & (pref <= 1)).all())


def test_lava_padding_does_not_change_scores_or_preference():
    q, k, v = _qkv(9, layers=1)[0]
    n = 70
    method = make_method("lava")
    single = method.prefill_scores(_inputs(q[:1, :, -n:], k[:1, :, -n:], v[:1, :, -n:], 32))
    pad = torch.zeros(1, S, dtype=torch.bool)
    pad[0, : S - n] = True
    kk = k[:1].clone()
    kk[:, :, : S - n] = 100.0  # garbage in the padding must not matter
    padded = method.prefill_scores(
        _inputs(q[:1], kk, v[:1] * (~pad)[:, None, :, None] + 50 * pad[:, None, :, None], 32, padding=pad)
    )
    torch.testing.assert_close(padded.scores[..., S - n :], single.scores)
    torch.testing.assert_close(padded.preference, single.preference)


def test_lava_options_are_validated():
    for bad in [dict(value_norm="l2"), dict(floor_mode="x"), dict(gqa="min"), dict(kernel=4), dict(floor_alpha=2.0)]:
        with pytest.raises(ValueError):
            make_method("lava", **bad)
    assert make_method("lava", layers="uniform").layer_budgets == "uniform"
    assert make_method("lava").layer_budgets == "preference"
    with pytest.raises(ValueError):
        make_method("ada-snapkv", alpha_safeguard=1.5)


def test_floor_alpha_one_gives_uniform_head_budgets():
    eng, method, _ = _prefill("lava", 40, seed=1, layers="uniform", floor_mode="adakv", floor_alpha=1.0)
    for store in eng.layers:
        assert bool((store.counts() == 40).all())
    eng, method, _ = _prefill("ada-snapkv", 40, seed=1, alpha_safeguard=1.0)
    ref, _, _ = _prefill("snapkv", 40, seed=1, kernel=7, pooling="max", group_first=True)
    for a, b in zip(eng.layers, ref.layers):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)


def test_lava_uniform_without_value_norm_equals_ada_snapkv_pure_cross_head_top_k():
    """Guide 1.9 (ii): Vbar = 1, uniform layers, alpha = 0 is AdaKV's cross-head top-k (with AdaKV's group mean)."""
    eng, _, _ = _prefill("lava", 40, seed=4, layers="uniform", value_norm="none", gqa="mean")
    ref, _, _ = _prefill("ada-snapkv", 40, seed=4, alpha_safeguard=0.0, group_first=False)
    for a, b in zip(eng.layers, ref.layers):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)
