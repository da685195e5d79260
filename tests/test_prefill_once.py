"""Prefill once, compress many: a replayed capture equals live compression (ARCHITECTURE.md section 4)."""

from __future__ import annotations

import pytest
import torch

from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.prefill_once import capture_prefill, greedy_decode, stack_captures
from slake.methods.base import available_methods, make_method
from tiny_models import random_ids


def _padded_batch():
    prompts = [random_ids(n, seed=20 + i)[0] for i, n in enumerate([90, 70])]
    S = 90
    ids = torch.zeros(2, S, dtype=torch.long)
    mask = torch.zeros(2, S, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, S - len(p) :] = p
        mask[i, S - len(p) :] = 1
    return ids, mask


#: every method whose compression needs no second pass over the prompt (KVzip's reconstruction is computed on the
#: capture: docs/methods/kvzip.md), and the variants whose options take other paths through the prefill
ONE_PASS_METHODS = [name for name in available_methods() if make_method(name).second_pass is None] + [
    "ahakv[gain_floor=true]",
    "lava[gqa=mean]",
    "lava[head_budget=uniform]",
    "ada-snapkv[decode_scope=layer]",
    "criticalkv[scorer=expected-attention]",
    "snapkv[linear_cache=true]",
]


@pytest.mark.parametrize("method", ONE_PASS_METHODS)
def test_replayed_capture_equals_live_compression(llama_gqa, method, monkeypatch):
    """Covered only the seven older methods; the newer ones (AhaKV, LAVa, SAGE-KV, KeyDiff, Expected Attention,
    CriticalKV, the AdaKV forms) and the variants above had no test of the prefill-once promise."""
    model = llama_gqa
    ids, mask = _padded_batch()
    L = model.config.num_hidden_layers
    live_cache = SlakeCache(method, 40, L)
    # the tiny config's end token (2) would be suppressed by min_new_tokens in the live run and not in greedy_decode;
    # without one, both run the 10 steps and pick the same tokens
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    with torch.no_grad():
        live = model.generate(
            ids,
            attention_mask=mask,
            **with_cache(model, live_cache),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        )
    assert live.shape[1] == 90 + 10
    capture = capture_prefill(model, ids, mask)
    # one capture feeds several (method, budget) pairs; replay twice to show the capture is not consumed
    for _ in range(2):
        cache = capture.replay(method, 40)
        tokens = greedy_decode(model, capture, cache, 10)
        assert tokens == live[:, 90:].tolist()
    for layer in range(L):
        a, b = live_cache.compressor.layers[layer], cache.compressor.layers[layer]
        assert torch.equal(a.counts(), b.counts())


def test_question_agnostic_mode_feeds_the_question_after_compression(llama_gqa):
    model = llama_gqa
    context, question = random_ids(80, seed=30), random_ids(12, seed=31)
    capture = capture_prefill(model, context)
    cache = capture.replay("snapkv", 40)
    tokens = greedy_decode(model, capture, cache, 5, extra_ids=question)
    assert len(tokens[0]) == 5
    assert cache.compressor.seen[0] == 80 + 12 + 4
    # the question was appended after compression: the context is compressed, the question kept whole
    store = cache.compressor.layers[0]
    assert bool((store.positions[store.valid] >= 80).sum() == 16 * store.keys.shape[1])


def test_the_question_after_a_context_within_the_budget_is_not_warned_about(llama_gqa, caplog):
    """A question-agnostic run whose context fits the budget and whose question takes it past: the question is the
    protocol, not a later turn. The warning meant for a user's multi-turn chat ("pass the whole of it to a new
    SlakeCache") came once per sample and (method, budget) of ``slake eval --question-agnostic``; a chat on a user's
    cache still gets it."""
    import logging

    model = llama_gqa
    context, question = random_ids(80, seed=30), random_ids(12, seed=31)
    capture = capture_prefill(model, context)
    caplog.set_level(logging.WARNING, logger="slake")
    for _ in range(2):
        greedy_decode(model, capture, capture.replay("snapkv", 85), 3, extra_ids=question)
    assert not [r for r in caplog.records if "within its budget" in r.getMessage()]
    cache = capture.replay("snapkv", 85)  # the same cache driven by hand, as a chat's next turn
    with torch.inference_mode():
        mask = torch.ones(1, 92, dtype=torch.long)
        model(
            input_ids=question, attention_mask=mask, **with_cache(model, cache), position_ids=torch.arange(80, 92)[None]
        )
    assert [r for r in caplog.records if "within its budget" in r.getMessage()]


@pytest.mark.parametrize("method", ["snapkv", "slake", "sagekv"])
def test_stacked_single_captures_equal_a_padded_batch_capture(llama_gqa, method):
    """Prefilling each prompt alone and left-padding the records gives the padded batch's capture."""
    model = llama_gqa
    ids, mask = _padded_batch()
    batch = capture_prefill(model, ids, mask)
    singles = [capture_prefill(model, ids[i : i + 1, mask[i] == 1]) for i in range(2)]
    stacked = stack_captures(singles)
    assert torch.equal(stacked.attention_mask, mask)
    assert torch.allclose(stacked.last_logits, batch.last_logits, atol=1e-4)
    for (q1, k1, v1, p1, s1), (q2, k2, v2, p2, s2) in zip(stacked.records, batch.records):
        real = mask.bool()[:, None, :, None]
        assert s1 == s2 and torch.equal(p1, p2 if p2 is not None else torch.zeros_like(p1))
        for a, b in ((q1, q2), (k1, k2), (v1, v2)):
            assert torch.allclose(a * real, b * real, atol=1e-4)
    want = greedy_decode(model, batch, batch.replay(method, 40), 8)
    assert greedy_decode(model, stacked, stacked.replay(method, 40), 8) == want
    released = stack_captures(singles, release=True)  # same records, inputs emptied (lower peak memory)
    assert all(c.records == [] for c in singles)
    assert len(released.records) == len(stacked.records) == model.config.num_hidden_layers
    for r1, r2 in zip(released.records, stacked.records, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(r1[:4], r2[:4]))


def test_stack_captures_rejects_bad_input(llama_gqa):
    with pytest.raises(ValueError, match="at least one"):
        stack_captures([])
    ids, mask = _padded_batch()
    with pytest.raises(ValueError, match="batch size 1"):
        stack_captures([capture_prefill(llama_gqa, ids, mask)])


def test_accumulated_attention_blocks_match_brute_force_with_padding():
    """H2O's column sums: any row-block size (bounded by max_elements for big batches), causal key truncation and
    left padding give the brute-force full causal softmax's column sums."""
    from slake.methods.h2o import accumulated_attention

    torch.manual_seed(0)
    B, Hq, Hkv, S, d = 2, 4, 2, 37, 8
    q, k = torch.randn(B, Hq, S, d), torch.randn(B, Hkv, S, d)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :9] = True
    kk = k.repeat_interleave(Hq // Hkv, 1)
    x = (q @ kk.transpose(-1, -2)) * 0.3
    x = x.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    x = x.masked_fill(pad[:, None, None, :], float("-inf"))
    a = torch.softmax(x, -1).nan_to_num(0.0).masked_fill(pad[:, None, :, None], 0.0)
    want = a.sum(2)
    for chunk, max_elements in [(512, 1 << 26), (5, 1 << 26), (512, B * Hq * S * 3), (512, 1)]:
        torch.testing.assert_close(accumulated_attention(q, k, 0.3, pad, chunk, max_elements), want)


def test_budget_independent_scores_are_computed_once_per_capture(llama_gqa, monkeypatch):
    """H2O's prefill scores ignore the budget: replays at several budgets share them, with the same caches."""
    from slake.methods.h2o import H2O

    model = llama_gqa
    ids, mask = _padded_batch()
    L = model.config.num_hidden_layers
    calls = []
    real = H2O.prefill_scores
    monkeypatch.setattr(H2O, "prefill_scores", lambda self, inputs: calls.append(1) or real(self, inputs))
    capture = capture_prefill(model, ids, mask)
    caches = [capture.replay("h2o", b) for b in (40, 60, 40)]
    assert len(calls) == L
    for budget, cache in zip((40, 60, 40), caches):
        fresh = capture_prefill(model, ids, mask).replay("h2o", budget)
        for layer in range(L):
            a, b = cache.compressor.layers[layer], fresh.compressor.layers[layer]
            assert torch.equal(a.positions, b.positions) and torch.equal(a.scores, b.scores)
    assert len(calls) == L + 3 * L
    capture.replay("h2o", 40, window=8)  # another configuration computes its own scores
    assert len(calls) == 5 * L
