"""Prefill once, compress many: a replayed capture equals live compression (ARCHITECTURE.md section 4)."""

from __future__ import annotations

import pytest
import torch

from slake import SlakeCache
from slake.hf.prefill_once import capture_prefill, greedy_decode

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
