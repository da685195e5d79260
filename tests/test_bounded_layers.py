"""A hybrid model's sliding-window layers hold only their window after the prefill, and ``sliding`` counts what they
hold (``slake.engines.transformers.bounded_layers``).

transformers' dynamic sliding-window layer keeps its last ``window - 1`` tokens as a view of the whole prompt's keys
and values. Before 2026-11-29 each sliding layer of a ``SlakeCache`` therefore held the whole prompt until its first
decode step (a tiny Gemma 3, 400-token prompt: 204,800 bytes held), while ``byte_counts()["sliding"]`` counted the
view's elements (7,680): the memory of a hybrid model's prefill was not bounded, and ``slake eval``'s rows, read
right after the prefill, reported the window only.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_models import HYBRID, WINDOW, hybrid_model
from slake.engines.transformers.bounded_layers import held_bytes
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.prefill_once import capture_prefill
from tiny_models import random_ids

N = 400


def _storage(cache: SlakeCache) -> int:
    return sum(
        getattr(cache.layers[i], name).untyped_storage().nbytes()
        for i in cache.layout.bounded
        for name in ("keys", "values")
    )


def _window_bytes(cache: SlakeCache, tokens: int) -> int:
    layer = cache.layers[next(iter(cache.layout.bounded))]
    B, H, _, d = layer.keys.shape
    return len(cache.layout.bounded) * 2 * B * H * tokens * d * layer.keys.element_size()


@pytest.mark.parametrize("name", HYBRID)
def test_sliding_layers_hold_their_window_after_a_live_prefill_and_sliding_counts_it(name):
    model = hybrid_model(name)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    ids = random_ids(N)
    with torch.inference_mode():
        model(ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), use_cache=True)
    kept = _window_bytes(cache, WINDOW - 1)
    assert _storage(cache) == kept  # before: the whole prompt's 400 tokens per layer
    assert cache.byte_counts()["sliding"] == kept
    with torch.inference_mode():
        mask = torch.ones(1, N + 1, dtype=torch.long)
        model(torch.tensor([[5]]), attention_mask=mask, **with_cache(model, cache), use_cache=True)
    # a decode step's view: the window plus the new token's concatenation, one token more than it keeps
    assert cache.byte_counts()["sliding"] == _storage(cache) == _window_bytes(cache, WINDOW)


def test_an_evaluation_replay_holds_and_reports_the_window_only():
    """``slake eval`` replays one capture per method and reads the bytes right after the prefill."""
    model = hybrid_model("gemma3")
    ids = random_ids(N)
    replayed = capture_prefill(model, ids, torch.ones_like(ids)).replay("snapkv", 24, window=8)
    kept = _window_bytes(replayed, WINDOW - 1)
    assert _storage(replayed) == kept
    assert replayed.byte_counts(0)["sliding"] == kept


def test_held_bytes_counts_a_views_whole_storage_once():
    whole = torch.zeros(2, 3, 100, 4)
    view = whole[:, :, -10:]
    assert held_bytes([view]) == whole.numel() * 4
    assert held_bytes([view, whole]) == whole.numel() * 4  # one storage
    assert held_bytes([view], sequence=0) == whole.numel() * 4 // 2
    assert held_bytes([view.clone()]) == view.numel() * 4
