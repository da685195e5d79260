"""A block of several tokens fed after the prefill (a later chat turn) is scored for its eviction as a prompt chunk is:
from its last ``window`` queries, the observation window, or from every query for rules that accumulate each step's
attention (``Method.decode_accumulates``; :meth:`slake.cache.decoding.Decoder.decode_attention`). The mean over
every query of the block favoured its earlier tokens, which more of its queries see: a 24-token block kept its first
tokens and dropped its later ones."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method

B, HQ, HKV, S, D, C, N = 1, 4, 2, 64, 8, 16, 24


def _data():
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    return (
        rnd(B, HQ, S, D),
        rnd(B, HKV, S, D),
        rnd(B, HKV, S, D),
        rnd(B, HQ, N, D),
        rnd(B, HKV, N, D),
        rnd(B, HKV, N, D),
    )


def _kept(eng: CompressedKV) -> list[list[int]]:
    store = eng.layers[0]
    return [sorted(store.positions[0, h][store.valid[0, h]].tolist()) for h in range(HKV)]


def _after_block(spec: str, chunked: bool) -> CompressedKV:
    """A one-layer engine after a prompt of ``S`` tokens and a block of ``N``: decoded as a block after the prefill,
    or (``chunked``) as the second chunk of a chunked prefill of the ``S + N`` tokens."""
    q, k, v, qn, kn, vn = _data()
    eng = CompressedKV(make_method(spec), C, 1, kernels="torch")
    if chunked:
        eng.begin_chunked_prefill(torch.zeros(B, S + N, dtype=torch.bool))
    eng.prefill_layer(0, q, k, v, None, D**-0.5)
    eng.append(0, kn, vn)
    eng.decode_attention(0, qn, D**-0.5)
    if chunked:
        eng.end_chunked_prefill()
    return eng


@pytest.mark.parametrize(
    "spec", ["snapkv[window=4]", "cake[window=4]", "slake[window=4]", "pyramidkv[window=4]", "tova"]
)
def test_a_decode_block_keeps_what_a_prompt_chunk_of_the_same_tokens_keeps(spec):
    """The same tokens as a later chat turn or as a prompt's second chunk: the same kept positions. Before, the block
    was scored from all 24 of its queries and kept its first tokens (64, 65, ...) where the chunk kept its last."""
    assert _kept(_after_block(spec, chunked=False)) == _kept(_after_block(spec, chunked=True))


def test_an_accumulating_rule_adds_every_query_of_the_block():
    """H2O's running sum takes every query's attention, as that many decode steps would add it: the scores after the
    block are the prefill's plus the block's column sums (group mean), not only the last ``window`` rows'."""
    q, k, v, qn, kn, vn = _data()
    eng = CompressedKV(make_method("h2o[window=4]"), C, 1, kernels="torch")
    eng.prefill_layer(0, q, k, v, None, D**-0.5)
    eng.append(0, kn, vn)
    store = eng.layers[0]
    seen = []
    rule = eng.state.method

    original = type(rule).decode_scores

    def spy(self, inputs):
        seen.append(inputs.probs.shape[2])
        return original(self, inputs)

    type(rule).decode_scores = spy
    try:
        eng.decode_attention(0, qn, D**-0.5)
    finally:
        type(rule).decode_scores = original
    assert seen == [N]
    assert bool((store.counts() == eng.targets[0]).all())
