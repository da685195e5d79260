"""A ``SlakeCache`` through transformers' cache interface as a demanding user drives it (2026-12-01 audit).

Beam search, ``num_return_sequences``, left padding, a cache continued over two ``generate`` calls and
``copy.deepcopy`` were found right (each returned beam's score equals a teacher-forced replay of its tokens alone, for
every method, dynamic and fixed-shape, on a plain and a hybrid model). Three things were not:

* a cache built for a hybrid model (``config=`` of Gemma 3: sliding-window layers 0 and 2) and given to a model of
  the same layer count whose layers are all full attention (or slide over another window) was accepted: its bounded
  layers kept a window of the full layers' keys, and the tokens were silently wrong (a tiny Llama: logits off by 0.6);
* a cache continued by a model with other KV heads (or head size) died in torch's reshape or expand errors inside
  slake's store, or transformers' concatenation in a bounded layer;
* in a hybrid model a refused batch operation (an empty selection, a repeat count of 0) or one that the compressed
  layers refuse and transformers' own layers take (a boolean mask, a negative index) had already changed the
  sliding-window layers that come before the first compressed one: the cache was left with layers of different
  batch sizes, although the refusal said nothing was changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import transformers as tf

import slake
from hybrid_models import hybrid_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import random_ids, tiny_model

S = 40


@pytest.fixture(scope="module")
def gemma() -> torch.nn.Module:
    return hybrid_model("gemma3")


def _generate(model: torch.nn.Module, cache: SlakeCache, ids: torch.Tensor, new: int = 6) -> list[list[int]]:
    """Greedy tokens of ``model.generate`` over ``cache`` for the unpadded prompt ``ids``."""
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=new, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def _rows(cache: SlakeCache) -> list[int | None]:
    """Each layer's batch size (None for a layer that holds nothing yet)."""
    out: list[int | None] = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        out.append(int(keys.shape[0]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None)
    return out


def test_a_cache_built_for_another_layer_layout_is_refused(gemma: torch.nn.Module) -> None:
    """A Gemma 3 cache (layers 0 and 2 slide over 16 tokens) on a 4-layer Llama, and on a Gemma 3 whose window is 8:
    refused before any layer runs, naming the layer; the cache built from the model's own config answers as before."""
    llama = tiny_model("llama-gqa", layers=4)
    ids = random_ids(S, seed=3)
    with pytest.raises(ValueError, match=r"layer 0 .*sliding_attention.*full_attention.*config=model.config"):
        _generate(llama, SlakeCache("full", 16, config=gemma.config), ids)
    narrow_cfg = copy.deepcopy(gemma.config)
    narrow_cfg.sliding_window = 8
    torch.manual_seed(0)
    narrow = tf.Gemma3ForCausalLM(narrow_cfg).eval()
    slake.prepare_model(narrow)
    with pytest.raises(ValueError, match=r"layer 0 .*16.*8"):
        _generate(narrow, SlakeCache("full", 16, config=gemma.config), ids)
    same = copy.deepcopy(gemma.config)  # another object of the same layout: accepted
    assert _generate(gemma, SlakeCache("snapkv", 16, config=same, window=4), ids) == _generate(
        gemma, SlakeCache("snapkv", 16, config=gemma.config, window=4), ids
    )


@pytest.mark.parametrize("name", ["llama", "gemma"])
@pytest.mark.parametrize("method", ["snapkv", "full"])
def test_a_cache_continued_by_a_model_with_other_heads_is_refused(gemma: torch.nn.Module, name: str,
                                                                  method: str) -> None:  # fmt: skip
    """Filled by a model of 2 KV heads, continued by one of 4: a ValueError naming both shapes, before the cache
    changes (it then continues with its own model)."""
    if name == "llama":
        first, other = tiny_model("llama-gqa", layers=2), tiny_model("llama-mha", layers=2)
    else:
        first = gemma
        cfg = copy.deepcopy(gemma.config)
        cfg.num_key_value_heads = 4
        torch.manual_seed(0)
        other = tf.Gemma3ForCausalLM(cfg).eval()
        slake.prepare_model(other)
    kw = {} if method == "full" else {"window": 4}
    cache = SlakeCache(method, 16, config=first.config, **kw)
    ids = random_ids(S, seed=3)
    with torch.no_grad():
        first(ids, **with_cache(first, cache), use_cache=True)
        before = cache.statistics()["kv_bytes"]
        with pytest.raises(ValueError, match=r"2 KV heads of size 16.*4 heads of size 16.*new SlakeCache"):
            other(torch.tensor([[5]]), **with_cache(other, cache), use_cache=True)
        assert cache.statistics()["kv_bytes"] == before and cache.get_seq_length() == S
        first(torch.tensor([[5]]), **with_cache(first, cache), use_cache=True)
    assert cache.get_seq_length() == S + 1


def _filled(model: torch.nn.Module) -> SlakeCache:
    """A cache holding a left-padded batch of 2 rows."""
    ids, mask = random_ids(S, seed=3, batch=2), torch.ones(2, S, dtype=torch.long)
    mask[1, :7] = 0
    cache = SlakeCache("snapkv", 16, config=model.config, window=4)
    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(model, cache), use_cache=True)
    return cache


@pytest.mark.parametrize(
    "op, message",
    [
        (lambda c: c.batch_select_indices(torch.tensor([], dtype=torch.long)), "non-empty 1-D integer index"),
        (lambda c: c.batch_select_indices(torch.tensor([-1])), r"indices of the 2 sequences.*got -1"),
        (lambda c: c.batch_select_indices(torch.tensor([2])), r"indices of the 2 sequences.*got 2"),
        (lambda c: c.batch_select_indices(torch.tensor([True])), "boolean mask of 1 for 2 sequences"),
        (lambda c: c.reorder_cache(torch.tensor([0.0, 1.0])), "non-empty 1-D integer index"),
        (lambda c: c.batch_repeat_interleave(0), "integer count >= 1"),
    ],
)
def test_a_refused_batch_operation_leaves_every_layer_of_a_hybrid_cache(
    gemma: torch.nn.Module, op: Callable[[SlakeCache], None], message: str
) -> None:
    cache = _filled(gemma)
    before, rows = cache.statistics()["kv_bytes"], _rows(cache)
    assert rows == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=message):
        op(cache)
    assert _rows(cache) == rows and cache.statistics()["kv_bytes"] == before


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_a_boolean_mask_selects_rows_as_transformers_caches_take_it(gemma: torch.nn.Module, name: str) -> None:
    """``batch_select_indices`` with a boolean mask over the rows (transformers' own layers index with it) selects
    those rows in every layer, as their indices do."""
    model = tiny_model("llama-gqa", layers=2) if name == "llama" else gemma
    by_mask, by_index = _filled(model), _filled(model)
    by_mask.batch_select_indices(torch.tensor([False, True]))
    by_index.batch_select_indices(torch.tensor([1]))
    assert set(_rows(by_mask)) == {1}
    assert by_mask.statistics()["kv_bytes"] == by_index.statistics()["kv_bytes"]
    for a, b in zip(by_mask.layers, by_index.layers, strict=True):
        assert torch.equal(a.keys, b.keys)
