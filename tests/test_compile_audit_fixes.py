"""Compiled decoding, audit of 2026-12-01 (``docs/compile.md``); each test failed before its fix.

* A hybrid model's sliding-window ring (:class:`~slake.engines.transformers.window_layer.WindowLayer`) is
  ``min(window, max_cache_len)`` slots. Decoded past ``max_cache_len`` with compressed layers that evict (no room to
  count), a ring shorter than the window wrapped and overwrote the oldest position, which the window still sees: the
  eager and the compiled static steps answered silently from a cache that had lost a token (logits off by 0.15-0.27
  on a tiny Gemma 3 from the first such step). Now the eager step refuses it with a ValueError, the compiled one
  with an index error, as an append-only layer past its room does.
* Compiled steps, then eager ones, on one static cache: a compiled step counts nothing on the host, so the eager
  steps after it believed the room :meth:`~slake.cache.decoding.Decoder.prepare_static` made was still whole. Past
  it, an append-only layer whose free slots are searched at each step (not two runs) wrote its token into slot 0,
  over a kept one, and a ring shorter than the window overwrote its oldest position; both answered silently. The
  eager static step now also refuses on the device what its host count cannot see.
* An eager static step whose ``position_ids`` do not continue the cache (the positions of a step before, or of
  another prompt): the dynamic cache refuses them with a ValueError; the static one took them silently, rotating the
  new token to a position other than the one it records for it. Now refused on the device.
* ``slake.generate(compile=True)`` (and ``slake bench --compile``'s step) on a model that transformers declines to
  compile (quantized by a method torch.compile does not take, or offloaded by accelerate): ``model.generate`` warned
  and decoded eagerly, and the result reported its first eager step as ``compile_s``. Now a ValueError up front.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybrid_models import hybrid_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids, tiny_model, word_tokenizer

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PROMPT = 8


def _logits(
    model, cache: SlakeCache, ids: torch.Tensor, steps: int, compiled: bool = False, compiled_steps: int | None = None
) -> torch.Tensor:
    """``(1, steps, vocab)`` logits of ``steps`` greedy single-token steps after ``ids`` (batch 1), each step eager
    or through ``torch.compile(fullgraph=True, dynamic=False, backend="eager")``; ``compiled_steps``: the first so
    many steps compiled, the others eager."""
    with torch.inference_mode():
        tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)

    def step(tok, pos):
        return model(input_ids=tok, position_ids=pos, **with_cache(model, cache), use_cache=True).logits[:, -1]

    graph = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
    out = []
    with torch.inference_mode():
        for t in range(steps):
            on_graph = compiled if compiled_steps is None else t < compiled_steps
            logits = (graph if on_graph else step)(tok, torch.tensor([[ids.shape[1] + t]])).clone()
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


@pytest.mark.parametrize("compiled_steps", [1, 2])
def test_eager_steps_after_compiled_ones_refuse_a_ring_past_max_cache_len(compiled_steps):
    """The ring of the test above, its room spent partly by compiled steps, then eager ones: the third token past
    the prompt is refused (before: the eager steps counted only themselves and it overwrote position 0)."""
    model = hybrid_model("gemma3")
    ids = random_ids(PROMPT, seed=2)
    cache = SlakeCache("snapkv", 4, config=model.config, window=2, max_cache_len=10)
    with pytest.raises((ValueError, RuntimeError), match="max_cache_len=10"):
        _logits(model, cache, ids, 3, compiled_steps=compiled_steps)


def test_eager_steps_after_compiled_ones_refuse_an_append_only_layer_past_its_room():
    """A full cache whose rows' free slots are not two runs (a slot inside the prompt free, the room's last one
    taken, so each step searches the first free one): room for 2 tokens past the prompt, 1 step compiled and 2 eager.
    The last is refused (before: the eager count saw one slot left and the token overwrote the row's slot 0)."""
    model = tiny_model("qwen2", layers=2)
    ids = random_ids(PROMPT, seed=3)

    def run(compiled_steps: int | None, steps: int) -> torch.Tensor:
        cache = SlakeCache("full", 64, config=model.config, max_cache_len=PROMPT + 2)
        real = cache.compressor.prepare_static

        def with_holes(decode_tokens: int) -> None:  # free slots: [1, 2) and the room but its last slot
            real(decode_tokens)
            for layer in cache.compressor.layers:
                layer.valid[..., 1] = False
                layer.valid[..., -1] = True
            cache.compressor.decoder._runs[:] = [None] * len(cache.compressor.decoder._runs)

        cache.compressor.prepare_static = with_holes
        return _logits(model, cache, ids, steps, compiled_steps=compiled_steps)

    run(None, 2)  # in room
    with pytest.raises(ValueError, match="room for 2 new tokens"):
        run(None, 3)  # eager only: counted on the host
    run(1, 2)
    with pytest.raises(RuntimeError, match=f"max_cache_len={PROMPT + 2}: after its prompt"):
        run(1, 3)


@pytest.mark.parametrize("static", [False, True])
def test_a_step_whose_position_ids_do_not_continue_the_cache_is_refused(static):
    """A two-row batch, the second row left-padded by 3: after the prompt, an eager step must give each row its next
    position (the real tokens it has seen). The dynamic cache refused a step of other positions with a ValueError;
    a static one took it and answered with the cache's own positions for its keys (before: no check)."""
    model = tiny_model("qwen2", layers=2)
    ids = random_ids(PROMPT, seed=4, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = SlakeCache("snapkv", 4, config=model.config, window=2, max_cache_len=PROMPT + 4 if static else None)
    with torch.inference_mode():
        tok = prefill(model, cache, ids, mask).argmax(-1, keepdim=True)
        good = torch.tensor([[PROMPT], [PROMPT - 3]])
        full = torch.ones(2, PROMPT + 1, dtype=mask.dtype)
        full[:, :PROMPT] = mask

        def step(pos, attention_mask):
            return model(input_ids=tok, position_ids=pos, attention_mask=attention_mask, **with_cache(model, cache))

        step(good, full)
        full = torch.cat([full, torch.ones(2, 1, dtype=mask.dtype)], 1)
        with pytest.raises((ValueError, RuntimeError), match="not continue it"):
            step(good, full)  # the positions of the step before


_HQQ = SimpleNamespace(is_compileable=False, quantization_config=SimpleNamespace(quant_method="hqq"))


@pytest.mark.parametrize(
    "quirk, match",
    [
        ({"hf_quantizer": _HQQ}, "quantized by a method that torch.compile does not take \\(hqq\\)"),
        ({"hf_device_map": {"model.embed_tokens": 0, "model.layers.0": "cpu"}}, "its weights to the CPU"),
        ({"hf_device_map": {"model.embed_tokens": "cpu", "model.layers.0": "disk"}}, "to disk"),
    ],
)
def test_compiled_decoding_refuses_a_model_transformers_would_not_compile(quirk, match):
    """transformers' ``model.generate`` declines to compile these (a warning, then eager steps): slake refuses them
    before the model runs, in ``slake.generate`` and in the benchmark's compiled step."""
    import slake
    from slake.engines.transformers.measure import compiled_step

    model = tiny_model("llama-gqa", layers=2)
    for name, value in quirk.items():
        setattr(model, name, value)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(20))
    with pytest.raises(ValueError, match=match):
        slake.generate(model, word_tokenizer(), prompt, method="snapkv", budget=8, max_new_tokens=3,
                       chat_template=False, compile=True)  # fmt: skip
    cache = SlakeCache("snapkv", 8, config=model.config, window=2, max_cache_len=32)
    with pytest.raises(ValueError, match=match):
        compiled_step(model, cache)


def test_a_model_on_one_device_or_quantized_compileably_still_compiles():
    """What transformers compiles is not refused: a whole model on the CPU (``{"": "cpu"}``), or a quantization that
    torch.compile takes."""
    from slake.engines.transformers.compile_options import uncompilable_reason

    model = tiny_model("llama-gqa", layers=2)
    assert uncompilable_reason(model) is None
    model.hf_device_map = {"": "cpu"}
    assert uncompilable_reason(model) is None
    model.hf_device_map = {"a": 0, "b": 1}
    assert uncompilable_reason(model) is None
    model.hf_quantizer = SimpleNamespace(is_compileable=True)
    assert uncompilable_reason(model) is None
