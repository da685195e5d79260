"""The first chunk of a chunked prefill for a layer-preference method (CAKE, SLAKE, LAVa) reaches past the budget by
a chunk (:func:`slake.cache.chunked.first_chunk_end`): the layers' budgets are split by that chunk's preferences, and
SLAKE's measure what a layer loses at its budget, which a chunk within the budget does not show (every layer then got
the same budget for the whole generation)."""

from __future__ import annotations

import logging

import pytest
import torch

from slake.budgets import Budget
from slake.cache.chunked import first_chunk_end
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from slake.methods import make_method
from tiny_models import random_ids


def _padding(S: int, *left: int) -> torch.Tensor:
    cols = torch.arange(S)
    return torch.stack([cols < n for n in left])


@pytest.mark.parametrize(
    ("method", "budget", "left", "chunk", "end"),
    [
        ("slake", 64, (0,), 32, 96),  # within the budget: the budget plus a chunk
        ("slake", 64, (0,), 100, 100),  # past it already: the chunk
        ("slake", 64, (0,), 64, 128),  # exactly the budget shows no loss either
        ("cake", 64, (0,), 32, 96),
        ("lava", 64, (0,), 32, 96),
        ("snapkv", 64, (0,), 32, 32),  # a uniform split: the chunk
        ("pyramidkv", 64, (0,), 32, 32),
        ("slake", 64, (0, 50), 32, 146),  # the padded row reaches its budget 50 positions later
        ("slake", 64, (0, 150), 32, 96),  # a row within its budget (50 tokens) is not compressed: not counted
        ("slake", 0.5, (0,), 32, 132),  # a ratio: 100 of the 200 tokens
        ("slake", 180, (0,), 32, 200),  # never past the prompt
    ],
)  # fmt: skip
def test_where_the_first_chunk_ends(method, budget, left, chunk, end):
    padding = _padding(200, *left)
    assert first_chunk_end(make_method(method, window=8), Budget(budget), padding, chunk) == end


def test_trailing_tokens_count_in_the_whole_prompt():
    # a 60-token prefill with 10 tokens to follow is a 70-token prompt: compressed at budget 64
    padding = _padding(60, 0)
    assert first_chunk_end(make_method("slake", window=8), Budget(64), padding, 16) == 16  # 60 <= 64: no row counted
    assert first_chunk_end(make_method("slake", window=8), Budget(64), padding, 16, trailing_tokens=10) == 60


def test_a_chunked_slake_prefill_within_the_budget_splits_it_across_layers(llama_gqa, caplog):
    # before: the 16-token first chunk showed no layer loss at budget 24, every layer kept 24 tokens (and a warning
    # said so); the first chunk now reaches 24 + 16 tokens and the layers' budgets differ, as in the exact prefill
    L = llama_gqa.config.num_hidden_layers
    ids = random_ids(160, seed=3)
    with caplog.at_level(logging.WARNING, logger="slake"):
        cache = SlakeCache("slake", 24, L, window=8)
        prefill(llama_gqa, cache, ids, prefill_chunk=16)
    budgets = cache.compressor.info.layer_budgets
    assert not bool((budgets == budgets[:, :1]).all()), budgets
    assert "every layer gets the same budget" not in caplog.text
    exact = SlakeCache("slake", 24, L, window=8)
    prefill(llama_gqa, exact, ids)
    assert int(budgets.sum()) == int(exact.compressor.info.layer_budgets.sum())  # the same total, split otherwise
