"""Compiled decoding (audit of 2026-11-29; each test failed before its fix).

* A model whose every layer slides (Mistral-7B-v0.1, Phi-3: slake compresses them as full layers while the sequence
  fits in the window) could not be compiled: the attention function branched in Python on the static cache's device
  position counter (``torch._dynamo.exc.Unsupported: Data-dependent branching``), even for a sequence within the
  window. A static step now checks the window on the device.
* A compiled static step of an append-only row with no free slot left (decoded past its ``max_cache_len``) wrote
  the new token over the row's slot 0 and went on, where the eager static cache refuses: a silent wrong answer for
  scored, linear-state and per-head-visibility layers (a mixed batch, ``slake[decode_eviction=false]``, SAGE-KV
  without decode eviction).
  The torch step now gives such a row an index past the store, which the write refuses.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_models import WINDOW, hybrid_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _static_decode(model, cache: SlakeCache, ids: torch.Tensor, steps: int, compiled: bool) -> torch.Tensor:
    """Greedy decode ``steps`` tokens after ``ids`` (batch 1) on a static cache, each step eager or through
    ``torch.compile(fullgraph=True, backend="eager")``."""
    with torch.inference_mode():
        tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)

    def step(tok, pos):
        out = model(input_ids=tok, position_ids=pos, **with_cache(model, cache), use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    fn = torch.compile(step, fullgraph=True, dynamic=False, backend="eager") if compiled else step
    out = []
    with torch.inference_mode():
        for t in range(steps):
            tok = fn(tok, torch.tensor([[ids.shape[1] + t]])).clone()
            out.append(tok)
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", ["mistral-swa", "phi3-swa"])
def test_an_all_sliding_model_compiles_within_its_window_and_equals_eager(name):
    model = hybrid_model(name)
    ids = random_ids(10, seed=2)
    steps = WINDOW - 10  # the cache ends with WINDOW - 1 tokens, within the window

    def cache():
        return SlakeCache("snapkv", 6, config=model.config, window=2, max_cache_len=10 + steps + 1)

    eager = _static_decode(model, cache(), ids, steps, compiled=False)
    compiled = _static_decode(model, cache(), ids, steps, compiled=True)  # before: Unsupported
    assert torch.equal(eager, compiled)


def _decode_to(model, cache: SlakeCache, prompt: int, until: int) -> int:
    """Feed single tokens after a ``prompt``-token prefill until a step fails; the sequence length that failed."""
    n = prompt
    with torch.inference_mode():
        model(random_ids(prompt), attention_mask=torch.ones(1, n, dtype=torch.long), **with_cache(model, cache))
        while n < until:
            n += 1
            try:
                model(torch.tensor([[5]]), attention_mask=torch.ones(1, n, dtype=torch.long),
                      cache_position=torch.tensor([n - 1]), **with_cache(model, cache))  # fmt: skip
            except (RuntimeError, ValueError) as exc:
                assert "uses sliding-window attention (16 tokens)" in str(exc)
                return n
    return -1


def test_a_static_cache_refuses_the_first_token_past_the_window_as_the_dynamic_one_does():
    """The device check (a RuntimeError on the CPU) refuses the same step as the dynamic cache's ValueError (before,
    an eager static step compared the new token's position, one less than the sequence's length, and let the first
    token past the window through)."""
    model = hybrid_model("mistral-swa")
    dynamic = SlakeCache("snapkv", 6, config=model.config, window=2)
    static = SlakeCache("snapkv", 6, config=model.config, window=2, max_cache_len=40)
    assert _decode_to(model, dynamic, 10, 30) == WINDOW + 1
    assert _decode_to(model, static, 10, 30) == WINDOW + 1


@pytest.mark.parametrize("spec", ["slake[decode_eviction=false]", "sagekv[decode_eviction=false]"])
def test_a_compiled_step_past_the_static_room_fails_instead_of_overwriting_slot_0(spec):
    """An append-only layer of a static cache built for 4 new tokens, decoded for 8: the eager static step refuses
    (ValueError, counted on the host); the compiled one wrote the 5th token over slot 0 and went on (logits off by
    up to 0.8 later); now its write fails."""
    model = tiny_model("llama-gqa", layers=2)
    ids = random_ids(40, seed=1)
    hp = {"window": 4} if spec.startswith("slake") else {}

    def cache():
        return SlakeCache(spec, 16, config=model.config, max_cache_len=40 + 4, **hp)

    with pytest.raises(ValueError, match="max_cache_len"):
        _static_decode(model, cache(), ids, 8, compiled=False)
    with pytest.raises((RuntimeError, IndexError)):
        _static_decode(model, cache(), ids, 8, compiled=True)
    # within the room, the compiled steps equal the eager ones
    assert torch.equal(_static_decode(model, cache(), ids, 3, True), _static_decode(model, cache(), ids, 3, False))
