"""Expected Attention scores a block of several tokens (a later chat turn, a later prompt chunk) from the statistics of
every one of its queries (``Method.reads_block_queries``), as its prefill takes those of every prompt query and
kvpress's press those of every query of a forward; before, the block's last query alone (its observation window at
``window = 0``), without a covariance. The probabilities handed to the rule stay the observation window's."""

from __future__ import annotations

import pytest
import torch

from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from slake.methods import make_method
from tiny_models import random_ids, tiny_model

PROMPT, BLOCK, BUDGET = 48, 12, 16


def _spy(monkeypatch, method) -> list[tuple[int, int]]:
    """Record (query rows, probability rows) of every decode_scores call of ``method``'s class."""
    seen: list[tuple[int, int]] = []
    cls = type(method)
    original = cls.decode_scores

    def spy(self, inputs):
        seen.append((inputs.queries.shape[2], inputs.probs.shape[2]))
        return original(self, inputs)

    monkeypatch.setattr(cls, "decode_scores", spy)
    return seen


@pytest.mark.parametrize(
    "spec, query_rows, prob_rows",
    [
        ("expected-attention", BLOCK, 1),
        ("ada-expected-attention", BLOCK, 1),
        ("expected-attention[window=4]", BLOCK, 4),
        ("criticalkv[scorer=expected-attention,window=0]", BLOCK, 1),
        ("criticalkv[window=4]", 4, 4),  # SnapKV's scorer reads the window's attention: its window's queries
        ("keydiff", 1, 1),
    ],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["later-turn", "later-chunk"])
def test_a_block_hands_the_rule_every_query_where_it_reads_their_statistics(
    monkeypatch, spec, query_rows, prob_rows, chunked
):
    model = tiny_model("llama-gqa", layers=2)
    method = make_method(spec)
    cache = SlakeCache(method, BUDGET, model.config.num_hidden_layers, kernels="torch")
    ids = random_ids(PROMPT + BLOCK)
    seen = _spy(monkeypatch, cache.compressor.state.method)
    with torch.no_grad():
        if chunked:  # the block is the prompt's second chunk
            prefill(model, cache, ids, torch.ones_like(ids), prefill_chunk=PROMPT)
        else:  # the block is a second turn over the compressed prompt
            model(ids[:, :PROMPT], **with_cache(model, cache), use_cache=True)
            seen.clear()  # the prefill's scores are not the decode rule's
            model(ids[:, PROMPT:], **with_cache(model, cache), use_cache=True)
    assert seen and set(seen) == {(query_rows, prob_rows)}, seen
    held = cache.statistics()["kept_tokens_per_layer"]
    assert all(k <= BUDGET for k in held), held
