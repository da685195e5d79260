"""Compiled decoding, audit of 2026-12-01 (``docs/compile.md``); each test failed before its fix.

* A hybrid model's sliding-window ring (:class:`~slake.engines.transformers.window_layer.WindowLayer`) is
  ``min(window, max_cache_len)`` slots. Decoded past ``max_cache_len`` with compressed layers that evict (no room to
  count), a ring shorter than the window wrapped and overwrote the oldest position, which the window still sees: the
  eager and the compiled static steps answered silently from a cache that had lost a token (logits off by 0.15-0.27
  on a tiny Gemma 3 from the first such step). Now the eager step refuses it with a ValueError, the compiled one
  with an index error, as an append-only layer past its room does.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_models import hybrid_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PROMPT = 8


def _logits(model, cache: SlakeCache, ids: torch.Tensor, steps: int, compiled: bool = False) -> torch.Tensor:
    """``(1, steps, vocab)`` logits of ``steps`` greedy single-token steps after ``ids`` (batch 1), each step eager
    or through ``torch.compile(fullgraph=True, dynamic=False, backend="eager")``."""
    with torch.inference_mode():
        tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)

    def step(tok, pos):
        return model(input_ids=tok, position_ids=pos, **with_cache(model, cache), use_cache=True).logits[:, -1]

    fn = torch.compile(step, fullgraph=True, dynamic=False, backend="eager") if compiled else step
    out = []
    with torch.inference_mode():
        for t in range(steps):
            logits = fn(tok, torch.tensor([[ids.shape[1] + t]])).clone()
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
    return torch.stack(out, 1)


def test_a_ring_shorter_than_the_window_refuses_a_token_past_max_cache_len():
    """Gemma 3 (window 16), an 8-token prompt, SnapKV evicting at a budget of 4, ``max_cache_len=10``: a ring of 10
    slots. Within them the static steps equal the dynamic cache's; the token at position 10 is refused (before: it
    overwrote position 0 and the logits parted from the dynamic cache's by 0.15)."""
    model = hybrid_model("gemma3")
    ids = random_ids(PROMPT, seed=2)

    def cache(max_cache_len: int | None) -> SlakeCache:
        return SlakeCache("snapkv", 4, config=model.config, window=2, max_cache_len=max_cache_len)

    dynamic = _logits(model, cache(None), ids, 2)
    torch.testing.assert_close(_logits(model, cache(10), ids, 2), dynamic)
    torch.testing.assert_close(_logits(model, cache(10), ids, 2, compiled=True), dynamic)
    with pytest.raises(ValueError, match="max_cache_len=10"):
        _logits(model, cache(10), ids, 3)
    with pytest.raises((RuntimeError, IndexError)):
        _logits(model, cache(10), ids, 3, compiled=True)
    # a ring of the whole window serves any length: no refusal past max_cache_len (the compressed layers evict)
    torch.testing.assert_close(_logits(model, cache(16), ids, 12), _logits(model, cache(None), ids, 12))
