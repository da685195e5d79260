"""CriticalKV's decode rule counts the protected slots (window, sinks) inside its first stage, as its prefill does
(``docs/methods/criticalkv.md#decode-rule``): of the ``int(r n)`` first-stage places, the protected slots take
theirs and the best unprotected slots by base score the rest."""

from __future__ import annotations

import pytest
import torch

from slake.methods import make_method
from slake.methods.base import DecodeInputs, LayerContext
from slake.methods.criticalkv import FIRST


def _inputs(sinks_attention: float, *, B=1, Hkv=2, g=2, d=8, n=40, first_real=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    newest = first_real + n - 1
    positions = torch.arange(first_real, first_real + n).expand(B, Hkv, n).clone()
    valid = torch.ones(B, Hkv, n, dtype=torch.bool)
    probs = torch.rand(B, Hkv * g, 1, n, generator=gen)
    probs[..., :4] += sinks_attention  # the sinks draw the step's attention, as attention sinks do
    probs = probs / probs.sum(-1, keepdim=True)
    values = torch.randn(B, Hkv, n, d, generator=gen)
    out_proj = torch.randn(16, Hkv * g * d, generator=gen)
    return DecodeInputs(
        probs=probs,
        positions=positions,
        valid=valid,
        stored=torch.zeros(B, Hkv, n),
        newest=torch.full((B, 1, 1), newest),
        queries=torch.randn(B, Hkv * g, 1, d, generator=gen),
        keys=torch.randn(B, Hkv, n, d, generator=gen),
        values=values,
        layer=LayerContext(out_proj=out_proj),
    )


@pytest.mark.parametrize("name", ["criticalkv", "ada-criticalkv"])
@pytest.mark.parametrize("sinks_attention", [0.0, 50.0])
@pytest.mark.parametrize("first_real", [0, 7])
def test_first_stage_exempts_int_r_n_minus_the_protected_slots(name, sinks_attention, first_real):
    """With 4 sinks that draw most of the attention and a window of 4, exactly ``int(0.5 n) - 8`` unprotected slots
    are exempt. Before, the sinks took first-stage places by their base scores and the window's slots by their
    neighbours' pooled values, so 20 - 4 or more unprotected slots were exempt."""
    n, w, sinks = 40, 4, 4
    method = make_method(name, window=w, sinks=sinks)
    inputs = _inputs(sinks_attention, n=n, first_real=first_real)
    scores = method.decode_scores(inputs)
    pos = inputs.positions
    protected = (pos > first_real + n - 1 - w) | ((pos >= first_real) & (pos < first_real + sinks))
    exempt = scores >= FIRST / 2
    assert torch.equal((exempt & ~protected).sum(-1), torch.full((1, 2), n // 2 - w - sinks))
    # the exempt unprotected slots are the best by base score (max pooling ties neighbours: compare values)
    base = method._base().decode_scores(inputs).float()
    free = ~protected & ~exempt
    assert (
        base.masked_fill(~(exempt & ~protected), float("inf")).amin(-1) >= base.masked_fill(~free, -1.0).amax(-1)
    ).all()


def test_more_protected_slots_than_first_stage_places_exempt_none():
    """A window wider than ``int(r n)``: no unprotected slot is exempt (the prefill's ``clamp_min(0)``)."""
    n = 40
    method = make_method("criticalkv", window=24)
    scores = method.decode_scores(_inputs(0.0, n=n))
    unprotected = torch.arange(n) <= n - 1 - 24
    assert not (scores[..., unprotected] >= FIRST / 2).any()


def test_the_sinks_attention_moves_no_first_stage_place():
    """Raising the attention on the sinks (kernel 1: no pooling into their neighbours) changes no unprotected slot's
    score. Before, the sinks then took 4 first-stage places from unprotected slots."""
    n, sinks = 40, 4
    method = make_method("criticalkv", window=4, sinks=sinks, kernel=1)
    inputs = _inputs(0.0, n=n)
    unprotected = (torch.arange(n) >= sinks) & (torch.arange(n) <= n - 1 - 4)
    before = method.decode_scores(inputs)[..., unprotected]
    probs = inputs.probs.clone()
    probs[..., :sinks] += 10.0
    inputs.probs = probs
    assert torch.equal(method.decode_scores(inputs)[..., unprotected], before)
