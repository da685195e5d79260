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


@pytest.fixture
def default_limits():
    """dynamo's default recompile limits for the test, the process's own restored after it."""
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        yield


@pytest.mark.usefixtures("default_limits")
def test_slake_generate_makes_room_for_its_graphs_and_explains_the_limit(monkeypatch):
    """``slake.generate(compile=True)`` died at the ninth cache shape of a process with dynamo's bare
    ``FailOnRecompileLimitHit`` (its default limit is 8; every prompt length of an uncompressed cache, every batch
    size, method or budget is a shape). It now raises the limit to at least 64 graphs and, when that is reached too,
    says why and what to do."""
    import slake
    from tiny_models import word_tokenizer

    model = tiny_model("llama-gqa", layers=2)

    def limit_hit(*args, **kwargs):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

    monkeypatch.setattr(model, "generate", limit_hit)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(30))
    with pytest.raises(ValueError, match=r"one graph per cache shape.*torch._dynamo.reset\(\)"):
        slake.generate(model, word_tokenizer(), prompt, method="full", max_new_tokens=2, chat_template=False,
                       compile=True)  # fmt: skip
    assert torch._dynamo.config.recompile_limit >= 64
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # uncompiled: not ours to explain
        slake.generate(model, word_tokenizer(), prompt, method="full", max_new_tokens=2, chat_template=False)


@pytest.mark.usefixtures("default_limits")
def test_room_for_graphs_is_raised_never_lowered():
    from slake.engines.transformers.compile_options import make_room_for_graphs

    make_room_for_graphs(200)  # a bench of 100 compiled configurations
    assert torch._dynamo.config.recompile_limit == 200
    assert torch._dynamo.config.accumulated_recompile_limit == 1600
    make_room_for_graphs(10)
    assert torch._dynamo.config.recompile_limit == 200
