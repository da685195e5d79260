"""Engine-level invariants on random tensors: kept entries are the top-scored ones, budgets are exact."""

from __future__ import annotations

import pytest
import torch

from slake.budgets.budget import Budget
from slake.cache.compressed import CompressedKV
from slake.methods import make_method

L, B, HQ, HKV, S, D = 4, 2, 4, 2, 96, 8


def _prefill(method_name, budget, padding=None, seed=0, q_scales=None, **hyper):
    g = torch.Generator().manual_seed(seed)
    method = make_method(method_name, **hyper)
    eng = CompressedKV(method, budget, L)
    captured = []
    for layer in range(L):
        q = torch.randn(B, HQ, S, D, generator=g) * (2 if q_scales is None else q_scales[layer])
        k = torch.randn(B, HKV, S, D, generator=g) * 2
        v = torch.randn(B, HKV, S, D, generator=g)
        captured.append((q, k, v))
        eng.prefill_layer(layer, q, k, v, padding, D**-0.5)
    return eng, method, captured


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "streamingllm", "pyramidkv", "cake", "slake"])
def test_kept_entries_are_the_top_scored_ones(name):
    eng, method, captured = _prefill(name, 40)
    final = eng.info.layer_budgets  # (B, L) selectable budgets
    for layer, (q, k, v) in enumerate(captured):
        inputs_budget = torch.full((B,), 40)
        from slake.methods.base import PrefillInputs

        res = method.prefill_scores(
            PrefillInputs(q, k, v, torch.zeros(B, S, dtype=torch.bool), D**-0.5, method.window, layer, L, inputs_budget)
        )
        scores = res.scores.clone()
        pos = torch.arange(S)
        protected = torch.zeros(S, dtype=torch.bool)
        if not method.newest_evictable:
            protected |= pos >= S - method.window
        protected |= pos < method.sinks
        store = eng.layers[layer]
        for b in range(B):
            n_sel = int(final[b, layer])
            for h in range(HKV):
                s = scores[b, h].masked_fill(protected, float("-inf"))
                expect = set(torch.sort(s, descending=True, stable=True).indices[:n_sel].tolist())
                expect |= set(pos[protected].tolist())
                got = set(store.positions[b, h][store.valid[b, h]].tolist())
                assert got == expect, f"{name} layer {layer} b{b} h{h}"


@pytest.mark.parametrize("name", ["snapkv", "cake", "slake", "pyramidkv"])
def test_layer_budgets_sum_exactly_to_the_total(name):
    eng, method, _ = _prefill(name, 40, seed=3)
    sel = eng.info.layer_budgets
    assert sel.shape == (B, L)
    assert bool((sel >= 0).all())
    assert sel.sum(-1).tolist() == [L * (40 - method.protected)] * B
    kept = torch.stack([s.counts() for s in eng.layers], -1)  # (B, H, L)
    assert kept.sum(-1).tolist() == [[L * 40] * HKV] * B


def test_budget_errors():
    with pytest.raises(ValueError, match="exceed the budget"):
        CompressedKV(make_method("snapkv"), 16, L)
    for bad in [0, -3, 1.5, "abc", True, float("nan")]:
        with pytest.raises(ValueError):
            Budget(bad)
    assert Budget("0.25").tokens(400) == 100
    assert Budget(128.0).value == 128
    assert Budget(Budget("0.5")).value == 0.5  # regression: the CLI passes an already-parsed budget
    with pytest.raises(ValueError, match="unknown method"):
        make_method("nope")
    with pytest.raises(ValueError, match="no hyperparameter"):
        make_method("snapkv", wndow=3)


def test_ratio_budget_per_sequence_and_padding_never_kept():
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :30] = True  # second sequence is 66 real tokens
    eng, method, _ = _prefill("snapkv", "0.5", padding=pad)
    assert eng.info.budget.tolist() == [48, 33]
    for store in eng.layers:
        assert store.counts()[0].tolist() == [48] * HKV
        assert store.counts()[1].tolist() == [33] * HKV
        assert bool((store.positions[1][store.valid[1]] >= 30).all())


def test_a_layer_is_never_emptied_even_at_the_smallest_budget():
    eng, method, _ = _prefill("cake", 32)  # budget == window: zero selectable tokens
    for store in eng.layers:
        assert bool((store.counts() == 32).all())


def test_h2o_window_tokens_keep_their_accumulated_attention():
    """Regression: window tokens used to get score 0 at decode (their +inf protection was dropped)."""
    from slake.methods.common import group_mean
    from slake.methods.h2o import accumulated_attention

    eng, method, captured = _prefill("h2o", 48)
    q, k, v = captured[0]
    acc = group_mean(accumulated_attention(q, k, D**-0.5, None), HKV)
    store = eng.layers[0]
    window = store.valid & (store.positions >= S - method.window)
    assert bool(window.any())
    expect = acc.gather(-1, store.positions.clamp_min(0))
    torch.testing.assert_close(store.scores[window], expect[window])


@pytest.mark.parametrize("name", ["cake", "slake"])
def test_max_layer_budget_caps_every_layer_and_keeps_the_total(name):
    """A cap below the largest uncapped layer budget binds: no layer keeps more than the cap (window included), the
    budgets still sum to the total, and a cap no layer reaches changes nothing (``max_layer_budget`` of CAKE)."""
    scales = [0.3, 1.0, 3.0, 8.0]  # flat to peaked attention: uneven layer preferences
    free, method, _ = _prefill(name, 24, window=4, q_scales=scales)
    sel = free.info.layer_budgets
    assert int(sel.max()) > 24  # the preference allocation is uneven
    cap = int(sel.max()) - 1 + method.protected  # one token under the largest layer's budget: binds
    capped, method, _ = _prefill(name, 24, window=4, q_scales=scales, max_layer_budget=cap)
    csel = capped.info.layer_budgets
    assert int(csel.max()) <= cap - method.protected
    assert torch.equal(csel.sum(-1), sel.sum(-1))
    for store in capped.layers:
        assert int(store.counts().max()) <= cap
    loose, _, _ = _prefill(name, 24, window=4, q_scales=scales, max_layer_budget=S)
    assert torch.equal(loose.info.layer_budgets, sel)
    for a, b in zip(loose.layers, free.layers):
        assert torch.equal(a.positions, b.positions)


def test_max_layer_budget_below_the_budget_or_the_window_is_refused():
    with pytest.raises(ValueError, match="max_layer_budget"):
        make_method("cake", window=8, max_layer_budget=8)
    with pytest.raises(ValueError, match="below the average budget"):
        _prefill("cake", 40, max_layer_budget=39)
