"""SnapKV's family with ``window=0`` (no recent token protected) still scores the prompt: from its last query, as
its decode rule does. Before, no query observed, every prefill score was 0 and each head kept the prompt's first
tokens (``snapkv``, ``pyramidkv``), or one head took the layer's whole budget (``ada-snapkv``)."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method
from slake.methods.base import PrefillInputs
from slake.methods.common import group_mean, pool1d

B, HQ, HKV, S, D = 2, 4, 2, 40, 8


def _inputs(window: int) -> PrefillInputs:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (HQ, HKV, HKV))
    return PrefillInputs(q, k, v, torch.zeros(B, S, dtype=torch.bool), D**-0.5, window, 0, 1, torch.tensor([8, 8]))


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv"])
def test_window_0_scores_from_the_last_query(name):
    method = make_method(f"{name}[window=0]")
    inputs = _inputs(0)
    scores = method.prefill_scores(inputs).scores
    last = torch.softmax((inputs.queries[:, :, -1:] @ inputs.keys.repeat_interleave(2, 1).transpose(-1, -2)) * D**-0.5,
                         -1).sum(2)  # fmt: skip
    if method.group_first:  # AdaKV's order: the group's mean, then pooling
        expected = pool1d(group_mean(last, HKV), method.kernel, method.pooling)
    else:
        expected = group_mean(pool1d(last, method.kernel, method.pooling), HKV)
    torch.testing.assert_close(scores, expected)
    assert float(scores.std()) > 0  # before: all 0


def test_window_0_keeps_what_the_last_query_attends_to():
    eng = CompressedKV(make_method("snapkv[window=0]"), 8, 1, kernels="torch")
    inputs = _inputs(0)
    eng.prefill_layer(0, inputs.queries, inputs.keys, inputs.values, None, D**-0.5)
    store = eng.layers[0]
    kept = [sorted(store.positions[b, h][store.valid[b, h]].tolist()) for b in range(B) for h in range(HKV)]
    assert all(len(k) == 8 for k in kept)
    assert any(k != list(range(8)) for k in kept)  # before: the first 8 positions in every head
    scores = make_method("snapkv[window=0]").prefill_scores(inputs).scores
    for (b, h), k in zip([(b, h) for b in range(B) for h in range(HKV)], kept, strict=True):
        assert k == sorted(scores[b, h].topk(8).indices.tolist())


def test_a_window_scores_as_before():
    """window >= 1: the window's queries score and its columns are left out (unchanged)."""
    for w in (1, 8):
        inputs = _inputs(w)
        a = torch.softmax(
            (inputs.queries[:, :, -w:] @ inputs.keys.repeat_interleave(2, 1).transpose(-1, -2)) * D**-0.5
            + torch.ones(w, S, dtype=torch.bool).triu(S - w + 1).float().mul(-1e30),
            -1,
        ).sum(2)
        a[..., S - w :] = 0
        torch.testing.assert_close(make_method(f"snapkv[window={w}]").prefill_scores(inputs).scores,
                                   group_mean(pool1d(a, 5, "avg"), HKV))  # fmt: skip
