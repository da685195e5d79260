"""Audit of the compression methods (methods, budgets, attention), fifth round: each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

from slake.methods import PrefillInputs, make_method
from slake.methods.lava import lava_entropy

_B, _HQ, _HKV, _S, _D = 1, 4, 2, 64, 16


def _sink_layer(strength: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer whose first token is an attention sink of the given strength (every query leans towards it)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(_B, _HQ, _S, _D, generator=g)
    k = torch.randn(_B, _HKV, _S, _D, generator=g)
    v = torch.randn(_B, _HKV, _S, _D, generator=g)
    u = torch.ones(_D) / _D**0.5
    q = q + 3 * u
    k[:, :, 0] = u * strength
    return q, k, v


def _lava_inputs(q, k, v, pad, window):
    return PrefillInputs(q, k, v, pad, _D**-0.5, window, 0, 2, budget=torch.full((q.shape[0],), 24))


# ====================================================================== LAVa's layer preference with sinks
def test_lava_preference_is_the_entropy_of_its_candidates_not_of_its_protected_sinks():
    # lava[sinks=4]: the sinks are always kept (the layer's cap is S - window - sinks), so, like the window, they are
    # not candidates; the layer's entropy was taken over their scores too, and an attention sink's score (most of the
    # layer's score mass) drove the layer's share of the budget: 0.45 for a strong sink against 0.98 for none, where
    # the candidates' scores barely differ
    m = make_method("lava[sinks=4,window=8]")
    prefs = []
    for strength in (0.0, 20.0):
        q, k, v = _sink_layer(strength)
        out = m.prefill_scores(_lava_inputs(q, k, v, torch.zeros(_B, _S, dtype=torch.bool), 8))
        candidates = out.scores.clone()
        candidates[..., :4] = 0.0  # the sinks (the window's scores are 0 already)
        expected = lava_entropy(candidates, torch.tensor([_HKV * (_S - 8 - 4)]))
        torch.testing.assert_close(out.preference, expected)
        prefs.append(float(out.preference))
        # the sinks left out are each row's first real tokens: a left-padded row's preference is the same
        pad_n = 5
        pad = torch.zeros(1, _S + pad_n, dtype=torch.bool)
        pad[0, :pad_n] = True
        q, k, v = (torch.cat([torch.zeros(*x.shape[:2], pad_n, _D), x], 2) for x in (q, k, v))
        torch.testing.assert_close(m.prefill_scores(_lava_inputs(q, k, v, pad, 8)).preference, expected)
    assert abs(prefs[0] - prefs[1]) < 0.05


# ====================================================================== SLAKE's VABS split with sinks
@pytest.mark.parametrize("split", ["uniform", "window"])
def test_slake_vabs_split_never_linearises_the_always_kept_sinks(split):
    # slake[sinks=3,vabs_split=uniform|window]: the sinks are always kept, yet VABS's provisional split put them among
    # the evicted keys its PTAA map linearises when their indicator ranked low (always, for the "window" split), so
    # the layer's preference described an eviction that never happens. The reference: the split with the sinks
    # ranked first (uniform: C' = C - w kept by indicator; window: exactly the sinks kept).
    from slake.methods.cake import cake_indicator
    from slake.methods.common import window_logits
    from slake.methods.slake import vabs_preference

    g = torch.Generator().manual_seed(5)
    w, S, sinks, budget = 6, 40, 3, 16
    q = torch.randn(2, 4, S, 16, generator=g)
    k = torch.randn(2, 2, S, 16, generator=g)
    v = torch.randn(2, 2, S, 16, generator=g)
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, :9] = True  # the second row is left-padded: its sinks are its first real tokens
    logits = window_logits(q, k, w, 16**-0.5, pad)
    probs = torch.softmax(logits, -1)
    first = pad.sum(-1, keepdim=True)
    sink = (torch.arange(S)[None] >= first) & (torch.arange(S)[None] < first + sinks)
    indicator = cake_indicator(probs[..., : S - w], 200.0, 5, "avg", 2)
    low = indicator.masked_fill(sink[:, None, : S - w], -1.0)  # the sinks rank last: the uniform split evicted them
    m = make_method(f"slake[sinks={sinks},window={w},vabs_split={split},budget_hint={budget}]")
    got = m.layer_preference(PrefillInputs(q, k, v, pad, 16**-0.5, w, 0, 4), logits, probs, low)
    first_ranked = low.masked_fill(sink[:, None, : S - w], float("inf"))
    kept_by_indicator = budget - w if split == "uniform" else sinks
    ref = vabs_preference(
        logits, probs, v, first_ranked, kept_by_indicator, w, m.alpha, m.beta, m.gamma_v, pad, split="uniform"
    )
    torch.testing.assert_close(got, ref)
