"""A forward stopped part-way through the model (a Ctrl-C, an error in a layer) leaves some layers holding its tokens
and the others not (2026-11-30 audit): the next turn was accepted, and the short layers stayed a token short from
then on without a word (transformers' own cache fails on the shapes); after an interrupted prefill, the cache's
statistics blamed its construction."""

from __future__ import annotations

import pytest
import torch

from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import random_ids, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


class _Interrupt:
    """Raises KeyboardInterrupt at the ``at``-th forward of the layer it is hooked to."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, module, args, kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def _generate(model, cache, ids, n):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=n, do_sample=False,
        pad_token_id=0,
    )  # fmt: skip


def _interrupted(model, cache, ids, at: int) -> None:
    hook = model.model.layers[1].self_attn.register_forward_pre_hook(_Interrupt(at), with_kwargs=True)
    try:
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            _generate(model, cache, ids, 8)
    finally:
        hook.remove()


@pytest.mark.parametrize("method", ["slake", "snapkv", "h2o"])
def test_a_turn_after_a_step_interrupted_in_a_layer_is_refused(model, method):
    ids = random_ids(64, seed=1)
    cache = SlakeCache(method, 24, config=model.config, window=8)
    _interrupted(model, cache, ids, at=4)  # inside layer 1, at the third decode step: layer 0 holds one more token
    assert [layer.get_seq_length() for layer in cache.layers] == [67, 66]
    turn = torch.cat([ids, random_ids(3, seed=7), random_ids(6, seed=5)], 1)
    with torch.no_grad(), pytest.raises(ValueError, match=r"layers hold different numbers of tokens \(66 to 67\)"):
        _generate(model, cache, turn, 4)


def test_an_interrupted_prefill_is_named_by_statistics_and_refused_after(model):
    ids = random_ids(64, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    _interrupted(model, cache, ids, at=1)  # inside layer 1, during the prefill
    with pytest.raises(ValueError, match="filled 1 layers but this SlakeCache was built for 2: a forward stopped"):
        cache.statistics()
    with torch.no_grad(), pytest.raises(ValueError, match="layers hold different numbers of tokens"):
        _generate(model, cache, torch.cat([ids, random_ids(6, seed=5)], 1), 4)


def test_layers_in_step_continue(model):
    """Not a refusal of every later turn: a completed generation's layers are in step, and a turn continues."""
    ids = random_ids(64, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        out = _generate(model, cache, ids, 3)
        _generate(model, cache, torch.cat([out, random_ids(5, seed=5)], 1), 2)
    assert len({layer.get_seq_length() for layer in cache.layers}) == 1
