"""A chunked prefill with a rule that accumulates every query's attention (H2O, AhaKV: ``Method.decode_accumulates``).

H2O's prefill score is the column sum of the whole prompt's causal attention. Before 2026-11-29 a later chunk was
scored from its last ``window`` queries only, and the chunk's protected tokens (window, sinks) were left at ``+inf``
after its eviction, which the next chunk's rule (and the first decode step) read as a running score of 0: a window
token's sum so far was lost when it left the window. Now every query of a later chunk adds its attention (block by
block, as the attention goes), and the protected tokens keep their own running scores, as after an exact prefill.

Check: when the first chunk is within the budget (nothing is evicted before the last chunk), every later query sees
the whole prompt, so the chunked scores are the exact prefill's column sums and the kept sets are the exact prefill's.
"""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method

B, HQ, HKV, N, D, C, W = 2, 4, 2, 200, 8, 64, 8
PAD = 30  # row 1's left padding


def _data():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, N, D, generator=g) * 2 for h in (HQ, HKV, HKV))
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, :PAD] = True
    return q, k, v, pad


def _exact(method: str):
    q, k, v, pad = _data()
    eng = CompressedKV(make_method(method, window=W), C, 1, kernels="torch")
    eng.prefill_layer(0, q, k, v, pad, D**-0.5)
    return eng.layers[0]


def _chunked(method: str, cuts: list[int]):
    q, k, v, pad = _data()
    eng = CompressedKV(make_method(method, window=W), C, 1, kernels="torch")
    eng.begin_chunked_prefill(pad)
    first = cuts[0]
    eng.prefill_layer(0, q[:, :, :first], k[:, :, :first], v[:, :, :first], pad[:, :first], D**-0.5)
    for s, e in zip(cuts, [*cuts[1:], N]):
        eng.append(0, k[:, :, s:e], v[:, :, s:e])
        eng.decode_attention(0, q[:, :, s:e], D**-0.5)
        assert not bool(torch.isposinf(eng.layers[0].scores).any()), "a protected slot lost its running score"
    eng.end_chunked_prefill()
    return eng.layers[0]


def _by_position(store) -> list[list[dict[int, float]]]:
    return [
        [
            {int(p): float(s) for p, s, ok in zip(store.positions[b, h], store.scores[b, h], store.valid[b, h]) if ok}
            for h in range(HKV)
        ]
        for b in range(B)
    ]


@pytest.mark.parametrize("first", [16, 48, C])
def test_h2o_chunked_with_a_first_chunk_within_the_budget_equals_the_exact_prefill(first):
    """A first chunk within the budget ``C`` (nothing evicted), then the rest of the prompt: the kept positions and
    their scores equal the exact prefill's (before, the second chunk was scored from its last 8 queries and the first
    chunk's window tokens restarted from 0)."""
    exact, chunked = _by_position(_exact("h2o")), _by_position(_chunked("h2o", [first]))
    for b in range(B):
        for h in range(HKV):
            assert sorted(chunked[b][h]) == sorted(exact[b][h]), (b, h)
            for pos, score in exact[b][h].items():
                assert chunked[b][h][pos] == pytest.approx(score, rel=1e-5, abs=1e-5), (b, h, pos)


@pytest.mark.parametrize("method", ["h2o", "ahakv"])
def test_protected_tokens_keep_their_running_score_across_chunks(method):
    """After every chunk (and at the end of the prefill) no kept slot holds ``+inf``: the window's tokens carry their
    own accumulated scores into the next chunk and the decode, as after an exact prefill (:func:`_chunked` checks
    every chunk)."""
    store = _chunked(method, [48, 90, 130, 170])
    exact = _exact(method)
    assert not bool(torch.isposinf(exact.scores[exact.valid]).any())  # the exact prefill's convention
    assert bool(torch.isfinite(store.scores[store.valid]).all())


def test_h2o_chunk_scores_add_every_query_of_the_chunk():
    """One later chunk after a first chunk within the budget: a kept slot's score is its column sum over every
    query of the prompt (computed here by brute force), not over the chunk's last ``window`` queries."""
    q, k, v, pad = _data()
    store = _chunked("h2o", [48])
    x = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(HQ // HKV, 1)) * D**-0.5
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    x = x.masked_fill(~causal | pad[:, None, None, :], float("-inf"))
    a = torch.softmax(x, -1).nan_to_num(0.0)
    a = a.masked_fill(pad[:, None, :, None], 0.0)  # padded queries add nothing
    sums = a.sum(2).view(B, HKV, HQ // HKV, N).mean(2)
    for b in range(B):
        for h in range(HKV):
            ok = store.valid[b, h]
            got = store.scores[b, h][ok]
            want = sums[b, h][store.positions[b, h][ok]]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
