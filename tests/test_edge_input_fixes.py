"""Inputs at the edges that failed deep inside torch or with a message about something else (2026-11-29 audit):
a layer preference that overflowed its float64 powers (an allocator error naming no hyperparameter), a batch row with
no real token (accepted, then "does not continue" an earlier prompt), an empty ``prefill`` (a reshape error) and a
budget past int64 (an overflow when unpacking)."""

from __future__ import annotations

import pytest
import torch

from slake.budgets.budget import Budget
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


@pytest.mark.parametrize(
    "method, hyper, named", [("cake", {"tau1": 1e-3}, "'tau1': 0.001"), ("slake", {"beta": 100.0}, "'beta': 100.0")]
)
def test_an_overflowed_layer_preference_names_the_exponents(model, method, hyper, named):
    cache = SlakeCache(method, 24, config=model.config, kernels="torch", window=8, **hyper)
    with torch.inference_mode(), pytest.raises(ValueError, match=rf"preference overflowed .*{named}"):
        model(random_ids(48, seed=1), **with_cache(model, cache), use_cache=True)


def test_a_row_of_padding_only_is_refused_before_the_prefill(model):
    ids = random_ids(12, seed=0, batch=2)
    mask = torch.ones_like(ids)
    mask[1] = 0
    cache = SlakeCache("snapkv", 4, config=model.config, window=2, kernels="torch")
    with torch.inference_mode(), pytest.raises(ValueError, match="row 1 of the batch is all padding"):
        model(ids, attention_mask=mask, **with_cache(model, cache), use_cache=True)
    assert cache.compressor.layers[0] is None


def test_a_chunk_of_padding_only_in_a_row_is_still_taken(model):
    """A row's left padding longer than the first chunk: that chunk is all padding in the row, the prompt is not."""
    ids = random_ids(24, seed=0, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :12] = 0
    cache = SlakeCache("snapkv", 8, config=model.config, window=2, kernels="torch")
    with torch.inference_mode():
        prefill(model, cache, ids, mask, prefill_chunk=8)
    assert all(k <= 8 for k in cache.statistics()["kept_tokens_per_layer"])


def test_an_empty_prefill_is_refused(model):
    cache = SlakeCache("snapkv", 8, config=model.config, window=2)
    with pytest.raises(ValueError, match="at least one token"):
        prefill(model, cache, random_ids(1)[:, :0], trailing_tokens=1)


def test_a_budget_past_int64_is_refused():
    with pytest.raises(ValueError, match="below 2\\*\\*62"):
        Budget(2**63)
