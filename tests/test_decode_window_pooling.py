"""The pooled decode rules leave the protected window's slots out of their neighbours' pooling, as the prefill leaves
the window's columns out (``docs/methods/README.md#pooling``): CAKE's rule, which SnapKV and its descendants
(PyramidKV, the AdaKV variants, CriticalKV's base scorer) and LAVa decode with."""

from __future__ import annotations

import pytest
import torch

from slake.methods import make_method
from slake.methods.base import DecodeInputs

METHODS = ["cake", "snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv", "lava", "slake"]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_attention_on_the_window_does_not_raise_the_scores_of_its_neighbours(name, pooling):
    """All of the step's attention on the window's slots: every slot outside the window scores 0. Before, SnapKV's
    and LAVa's rules pooled the window's attention into the slots just before it (with kernel 5, the two oldest
    slots next to the window scored above every other one), where CAKE's did not."""
    B, Hq, Hkv, n, w = 1, 4, 2, 16, 4
    method = make_method(name, window=w, kernel=5, pooling=pooling)
    positions = torch.arange(n).expand(B, Hkv, n).clone()
    valid = torch.ones(B, Hkv, n, dtype=torch.bool)
    probs = torch.zeros(B, Hq, 1, n)
    probs[..., n - w :] = 1.0 / w  # the step attends to the window only
    scores = method.decode_scores(DecodeInputs(probs, positions, valid, torch.zeros(B, Hkv, n)))
    assert torch.equal(scores[..., : n - w], torch.zeros(B, Hkv, n - w))
