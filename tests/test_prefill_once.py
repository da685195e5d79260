"""Prefill once, compress many: a replayed capture equals live compression (ARCHITECTURE.md section 4)."""

from __future__ import annotations

import pytest
import torch

from slake import SlakeCache
from slake.hf.prefill_once import capture_prefill, greedy_decode, stack_captures

from tiny_models import random_ids


def _padded_batch():
    prompts = [random_ids(n, seed=20 + i)[0] for i, n in enumerate([90, 70])]
    S = 90
    ids = torch.zeros(2, S, dtype=torch.long)
    mask = torch.zeros(2, S, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, S - len(p):] = p
        mask[i, S - len(p):] = 1
    return ids, mask


@pytest.mark.parametrize("method", ["snapkv", "h2o", "tova", "cake", "slake", "pyramidkv", "full"])
def test_replayed_capture_equals_live_compression(llama_gqa, method):
    model = llama_gqa
    ids, mask = _padded_batch()
    L = model.config.num_hidden_layers
    live_cache = SlakeCache(method, 40, L)
    with torch.no_grad():
        live = model.generate(ids, attention_mask=mask, past_key_values=live_cache, max_new_tokens=10,
                              min_new_tokens=10, do_sample=False, pad_token_id=0)
    capture = capture_prefill(model, ids, mask)
    # one capture feeds several (method, budget) pairs; replay twice to show the capture is not consumed
    for _ in range(2):
        cache = capture.replay(method, 40)
        tokens = greedy_decode(model, capture, cache, 10)
        assert tokens == live[:, 90:].tolist()
    for layer in range(L):
        a, b = live_cache.engine.layers[layer], cache.engine.layers[layer]
        assert torch.equal(a.counts(), b.counts())


def test_question_agnostic_mode_feeds_the_question_after_compression(llama_gqa):
    model = llama_gqa
    context, question = random_ids(80, seed=30), random_ids(12, seed=31)
    capture = capture_prefill(model, context)
    cache = capture.replay("snapkv", 40)
    tokens = greedy_decode(model, capture, cache, 5, extra_ids=question)
    assert len(tokens[0]) == 5
    assert cache.engine.seen[0] == 80 + 12 + 4
    # the question was appended after compression: the context is compressed, the question kept whole
    store = cache.engine.layers[0]
    assert bool((store.positions[store.valid] >= 80).sum() == 16 * store.keys.shape[1])


@pytest.mark.parametrize("method", ["snapkv", "slake", "sagekv"])
def test_stacked_single_captures_equal_a_padded_batch_capture(llama_gqa, method):
    """Prefilling each prompt alone and left-padding the records gives the padded batch's capture."""
    model = llama_gqa
    ids, mask = _padded_batch()
    batch = capture_prefill(model, ids, mask)
    singles = [capture_prefill(model, ids[i:i + 1, mask[i] == 1]) for i in range(2)]
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
    for r1, r2 in zip(released.records, stacked.records):
        assert all(torch.equal(a, b) for a, b in zip(r1[:4], r2[:4]))


def test_stack_captures_rejects_bad_input(llama_gqa):
    with pytest.raises(ValueError, match="at least one"):
        stack_captures([])
    ids, mask = _padded_batch()
    with pytest.raises(ValueError, match="batch size 1"):
        stack_captures([capture_prefill(llama_gqa, ids, mask)])
