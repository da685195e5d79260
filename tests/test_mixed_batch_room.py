"""A padded batch whose prompts are not all over the budget (2026-11-30 audit of the Python API): at the first decode
step, the compressed rows had no free slot and the layer, whose rows did not all evict, grew by 256 slots for every
row, although a row that evicts needs one slot and the row within the budget still had free ones (snapkv at budget
48: 4.7 times the full cache's memory, reported as slack). Now the rows that keep every token alone decide when the
layer grows; the rows that evict get the one slot they need, once. Each row still equals its prompt alone."""

from __future__ import annotations

import pytest
import torch

from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import random_ids, tiny_model

BUDGET, LONG, SHORT = 24, 60, 20


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


def _generate(model, spec, ids, mask, steps, kernels):
    cache = SlakeCache(spec, BUDGET, config=model.config, kernels=kernels)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **with_cache(model, cache), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[:, ids.shape[1] :].tolist(), cache


def _batch():
    long, short = random_ids(LONG, seed=1), random_ids(SHORT, seed=2)
    ids = torch.cat([long, torch.cat([torch.zeros(1, LONG - SHORT, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, : LONG - SHORT] = 0
    return ids, mask, (long, short)


SPECS = ["snapkv[window=4]", "ada-snapkv[window=4]", "slake[window=4]", "ada-snapkv[window=4,decode_scope=layer]"]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("spec", SPECS)
def test_the_evicting_rows_get_one_slot_and_the_layer_grows_no_further(model, spec, kernels):
    ids, mask, _ = _batch()
    _, cache = _generate(model, spec, ids, mask, 2, kernels)
    state = cache.compressor.state
    for i, store in enumerate(cache.compressor.layers):
        held = int(store.valid.sum(-1).max())
        bound = int(state.decode_bound(i).max())  # a head may grow to it (per-head budgets, a layer-wide eviction)
        assert store.capacity <= max(held, bound) + 1, (spec, store.capacity, held, bound)


@pytest.mark.parametrize("spec", SPECS)
def test_each_row_still_equals_its_prompt_alone_past_the_growth(model, spec):
    """Past the short row's free slots (the layer then grows by 256), for 12 steps."""
    ids, mask, prompts = _batch()
    together, _ = _generate(model, spec, ids, mask, 12, "torch")
    for row, prompt in enumerate(prompts):
        alone, _ = _generate(model, spec, prompt, torch.ones_like(prompt), 12, "torch")
        assert together[row] == alone[0], (spec, row)
