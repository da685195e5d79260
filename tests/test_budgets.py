"""Layer-budget allocation (spec slake-cake.md sections 6, 7.2, 7.3; invariants 8, 10, 11 of section 12)."""

from __future__ import annotations

import pytest
import torch

from slake.attention.linear_state import LinearState
from slake.budgets.allocation import largest_remainder, preference_budgets, pyramid_budgets, uniform_budgets, waterfill

GEN = torch.Generator().manual_seed(0)


def _randint(lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi, (1,), generator=GEN))


def _random_prefs(n: int) -> torch.Tensor:
    kind = _randint(0, 4)
    if kind == 0:  # equal integer preferences: real budgets land exactly on integers
        return torch.ones(n, dtype=torch.float64) * _randint(1, 5)
    if kind == 1:  # some zeros
        p = torch.exp(torch.randn(n, generator=GEN, dtype=torch.float64))
        return p * (torch.rand(n, generator=GEN, dtype=torch.float64) > 0.3)
    sigma = [0.3, 1.0, 2.0][kind - 1]
    return torch.exp(sigma * torch.randn(n, generator=GEN, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- waterfill
def test_waterfill_proportional_when_no_cap_binds():
    b = waterfill([1.0, 2.0, 3.0, 4.0], 100.0, 1000.0)
    assert b.dtype == torch.float64
    torch.testing.assert_close(b, torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64))


def test_waterfill_cap_redistributes_proportionally():
    b = waterfill([1.0, 1.0, 8.0], 30.0, 12.0)
    torch.testing.assert_close(b, torch.tensor([9.0, 9.0, 12.0], dtype=torch.float64))
    assert waterfill([1.0, 5.0], 100.0, 10.0).tolist() == [10.0, 10.0]  # n * cap <= total


def test_waterfill_zero_preferences():
    assert waterfill([0.0, 0.0, 0.0, 0.0], 10.0, 5.0).tolist() == [2.5] * 4  # all zero -> uniform
    assert waterfill([0.0, 1.0, 3.0], 8.0, 100.0).tolist() == [0.0, 2.0, 6.0]
    b = waterfill([0.0, 1.0, 0.0], 9.0, 5.0)  # positive layer capped: the rest shared by the zero layers
    assert b.tolist() == [2.0, 5.0, 2.0] and not torch.isnan(b).any()


@pytest.mark.parametrize("scale", [1e-310, 1e-320, 4.9e-324])
def test_waterfill_depends_on_the_proportions_however_small(scale):
    """Subnormal preferences (CAKE with extreme temperatures, ``cake[tau1=tau2=1/13]`` on a tiny model) made
    ``rest / sum`` overflow: every layer counted as capped, then a division by zero (2026-11-30 audit of VABS)."""
    assert waterfill([scale] * 4, 384.0, 4000.0).tolist() == [96.0] * 4
    assert waterfill([scale, 0.0, 0.0], 384.0, 4000.0).tolist() == [384.0, 0.0, 0.0]
    assert waterfill([scale, 1.0], 150.0, 100.0).tolist() == pytest.approx([50.0, 100.0])  # capped: the rest
    assert (
        preference_budgets(torch.tensor([scale] * 4, dtype=torch.float64), 4 * 96, 4000, final=True).tolist()
        == [96] * 4
    )


@pytest.mark.parametrize("scale", [1e308, 1.7e308, 1e300])
def test_waterfill_depends_on_the_proportions_however_large(scale):
    """Finite preferences whose sum overflows float64 (CAKE or VABS with extreme exponents, below the prefill's
    overflow check) made ``c = rest / inf = 0``: every layer got 0 and the final rounding raised "cannot round"."""
    assert waterfill([scale] * 4, 384.0, 4000.0).tolist() == pytest.approx([96.0] * 4)
    assert waterfill([scale, scale, 0.0], 10.0, 100.0).tolist() == pytest.approx([5.0, 5.0, 0.0])
    assert waterfill([scale, scale / 17], 180.0, 1000.0).tolist() == pytest.approx([170.0, 10.0])
    assert waterfill([scale, scale, 1.0], 150.0, 60.0).tolist() == pytest.approx([60.0, 60.0, 30.0])  # capped
    for final in (True, False):
        prefs = torch.tensor([scale] * 32, dtype=torch.float64)
        assert preference_budgets(prefs, 32 * 96, 4000, final=final).tolist() == [96] * 32


@pytest.mark.parametrize("bad", [[], [1.0, -1.0], [float("nan"), 1.0], [[1.0, 2.0]]])
def test_waterfill_rejects_bad_preferences(bad):
    with pytest.raises(ValueError):
        waterfill(bad, 10.0, 5.0)


def test_waterfill_rejects_bad_total_and_cap():
    with pytest.raises(ValueError):
        waterfill([1.0], -1.0, 5.0)
    with pytest.raises(ValueError):
        waterfill([1.0], 1.0, float("inf"))


# ---------------------------------------------------------------------------------------------- rounding
def test_largest_remainder_sum_and_tie_break():
    assert largest_remainder(torch.tensor([0.5, 0.5, 0.5]), 1).tolist() == [1, 0, 0]
    assert largest_remainder(torch.tensor([1.2, 2.7, 3.1]), 7).tolist() == [1, 3, 3]
    out = largest_remainder(torch.tensor([2.0, 3.0]), 5)
    assert out.dtype == torch.int64 and out.tolist() == [2, 3]
    with pytest.raises(ValueError):
        largest_remainder(torch.tensor([1.5, 1.5]), 10)


def test_preference_budgets_validation():
    with pytest.raises(ValueError):
        preference_budgets([1.0, 2.0], -5, 10, True)
    with pytest.raises(ValueError):
        preference_budgets([1.0, 2.0], 5, 2.5, True)
    with pytest.raises(ValueError):
        preference_budgets([1.0, -2.0], 5, 10, True)


def test_final_budgets_invariant_10():
    """sum == min(T, L(S-w)), 0 <= B_l <= S-w, integers, proportional up to rounding when no cap binds."""
    for _ in range(300):
        n = _randint(1, 33)
        cap = _randint(0, 300)
        total = n * _randint(0, 200)
        prefs = _random_prefs(n)
        b = preference_budgets(prefs, total, cap, final=True)
        assert b.dtype == torch.int64
        assert int(b.sum()) == min(total, n * cap)
        assert bool((b >= 0).all()) and bool((b <= cap).all())
        real = waterfill(prefs, total, cap)
        assert bool(((b - real).abs() < 1.0 + 1e-9).all())
        if prefs.sum() > 0 and bool((real < cap).all()):
            ideal = prefs / prefs.sum() * total
            assert bool(((b - ideal).abs() < 1.0 + 1e-9).all())


# ---------------------------------------------------------------------------------------------- cascade
def _keep_topk(scores: torch.Tensor, current: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, current.numel())
    return current[torch.topk(scores[current], k).indices].sort().values


def _cascade(prefs: torch.Tensor, total: int, cap: int, inds: list[torch.Tensor]):
    """Simulate CAKE's cascade (spec 7.3); returns final kept sets, per-stage evicted sets and stage budgets."""
    n = prefs.numel()
    current: list[torch.Tensor] = []
    evicted: list[list[torch.Tensor]] = [[] for _ in range(n)]
    stages = []
    for m in range(n):
        current.append(torch.arange(cap))
        b = preference_budgets(prefs[: m + 1], total, cap, final=(m == n - 1))
        stages.append(b)
        for layer in range(m + 1):
            new = _keep_topk(inds[layer], current[layer], int(b[layer]))
            gone = current[layer][~torch.isin(current[layer], new)]
            evicted[layer].append(gone)
            current[layer] = new
    return current, evicted, stages


def test_proposition_1_and_theorem_1():
    """Stage budgets never increase (Prop. 1) and the cascade equals one-shot eviction (Thm. 1), 150 random cases."""
    for _ in range(150):
        n, w = _randint(2, 17), 8
        c = [16, 24, 40, 72][_randint(0, 4)]
        s = _randint(c + w + 1, 300)
        cap, total = s - w, (c - w) * n
        prefs = _random_prefs(n)
        inds = [torch.randperm(cap, generator=GEN).double() for _ in range(n)]  # distinct scores
        final = preference_budgets(prefs, total, cap, final=True)
        current, _, stages = _cascade(prefs, total, cap, inds)
        for m in range(n - 1):
            assert bool((stages[m + 1][: m + 1] <= stages[m]).all()), (prefs, stages[m], stages[m + 1])
        for layer in range(n):
            one_shot = _keep_topk(inds[layer], torch.arange(cap), int(final[layer]))
            assert torch.equal(current[layer], one_shot)


def test_cascaded_fold_equals_one_shot_fold_invariant_8():
    n, s, w, c, d = 8, 200, 8, 40, 16
    cap, total = s - w, (c - w) * n
    prefs = torch.exp(torch.randn(n, generator=GEN, dtype=torch.float64))
    inds = [torch.randperm(cap, generator=GEN).double() for _ in range(n)]
    keys = torch.randn(n, 1, 1, cap, d, generator=GEN, dtype=torch.float64)
    values = torch.randn(n, 1, 1, cap, d, generator=GEN, dtype=torch.float64)
    current, evicted, _ = _cascade(prefs, total, cap, inds)
    for layer in range(n):
        staged = LinearState.empty(1, 1, d, dtype=torch.float64)
        for gone in evicted[layer]:
            mask = torch.zeros(1, 1, cap, dtype=torch.bool)
            mask[0, 0, gone] = True
            staged.fold(keys[layer], values[layer], mask)
        all_gone = torch.cat(evicted[layer])
        assert all_gone.numel() == all_gone.unique().numel()  # stage-wise evicted sets are disjoint
        once = LinearState.empty(1, 1, d, dtype=torch.float64)
        mask = torch.ones(1, 1, cap, dtype=torch.bool)
        mask[0, 0, current[layer]] = False
        once.fold(keys[layer], values[layer], mask)
        for a, b in [
            (staged.kv, once.kv),
            (staged.k_sum, once.k_sum),
            (staged.v_sum, once.v_sum),
            (staged.count, once.count),
        ]:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert int(once.count) == cap - current[layer].numel()


# ---------------------------------------------------------------------------------------------- fixed schedules
def test_uniform_budgets():
    assert uniform_budgets(3, 96).tolist() == [96, 96, 96]
    assert uniform_budgets(3, 96).dtype == torch.int64
    with pytest.raises(ValueError):
        uniform_budgets(0, 96)
    with pytest.raises(ValueError):
        uniform_budgets(2, -1)


def test_pyramid_budgets_follow_kvcache_factory():
    b = pyramid_budgets(32, 96, 4000, 32)  # min 4, max 188, step 184 // 31 = 5
    assert b.dtype == torch.int64 and b[0] == 188 and b[-1] == 188 - 31 * 5
    assert bool((b[:-1] > b[1:]).all()) and int(b.sum()) >= 32 * 96
    clipped = pyramid_budgets(32, 96, 200, 32)  # max_n clipped to S - w = 168, min_n = 24, step = 4
    assert clipped[0] == 168 and clipped[-1] == 168 - 31 * 4 and bool((clipped <= 168).all())
    assert pyramid_budgets(4, 96, 150, 32).tolist() == [96] * 4  # S < 2 C': uniform SnapKV fallback
    assert pyramid_budgets(4, 96, 100, 32).tolist() == [96] * 4  # S < C: no compression, C' for decode
    assert pyramid_budgets(1, 96, 4000, 32).tolist() == [96]
    assert pyramid_budgets(4, 8, 96, 32).tolist() == [16, 11, 6, 1]  # floored step: sum 34 > 4 * 8
    for layers, sel, s in [(4, 8, 96), (32, 96, 4000), (32, 96, 200), (7, 50, 130), (5, 96, 150)]:
        ex = pyramid_budgets(layers, sel, s, 32, exact=True)
        assert int(ex.sum()) == layers * sel and bool((ex[:-1] >= ex[1:]).all()) and bool((ex >= 0).all())
    with pytest.raises(ValueError):
        pyramid_budgets(4, 96, 4000, 32, beta=0)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("snapkv_fallback", [True, False])
def test_pyramid_budgets_below_beta_1_stay_within_the_candidates(exact, snapkv_fallback):
    """``beta < 1`` (allowed by PyramidKV, layer 0 smallest) capped only ``max_n``: the deepest layer got
    ``C' // beta`` = 181 of 168 candidates (S - w), the engine kept 168, and the layers summed below ``L * C'``."""
    b = pyramid_budgets(4, 100, 200, 32, beta=0.55, exact=exact, snapkv_fallback=snapkv_fallback)
    assert b[0] == 32 and b[-1] == 168 and bool((b[:-1] <= b[1:]).all())  # min_n = 168, max_n = 200 - 168
    assert int(b.sum()) == 400 if exact else int(b.sum()) >= 400
    b = pyramid_budgets(32, 127, 257, 32, beta=0.6, exact=exact, snapkv_fallback=snapkv_fallback)
    assert int(b.max()) <= 257 - 32 and bool((b[:-1] <= b[1:]).all())
    if exact:
        assert int(b.sum()) == 32 * 127
    else:  # the floored (negative) step overshot the deep end by up to L - 2: [43, 49, ..., 223, 229] before
        assert b[0] == 43 and b[-2] == 223 and b[-1] == 225
    if not snapkv_fallback:  # AdaKV's form compresses below 2 C' too: 150 - 32 = 118 candidates
        b = pyramid_budgets(4, 100, 150, 32, beta=0.55, exact=exact, snapkv_fallback=False)
        assert int(b.max()) <= 118 and (int(b.sum()) == 400 or not exact)
    with pytest.raises(ValueError):  # at 0.5 and below the largest layer would get nothing or less
        pyramid_budgets(4, 100, 232, 32, beta=0.5, exact=exact, snapkv_fallback=snapkv_fallback)
