"""A method's prefill score that overflows float32 to +inf read as a protected slot: the layer kept every such token
and went over its budget without a word (``statistics()`` still gave the budgeted split). Scores are brought back to
float32's largest before the protected slots are marked, and a hyperparameter beyond float32's range (infinite in the
float32 scores) is refused where the method is made."""

from __future__ import annotations

import pytest
import torch

from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.methods import make_method
from tiny_models import random_ids, tiny_model

PROMPT, BUDGET = 48, 24


# criticalkv's epsilon is at most 1e6 since 2026-11-30 (tests/test_option_type_fixes.py): its scores reach float32's
# largest only with value norms where the model's own activations overflow
@pytest.mark.parametrize("method, hyper", [("expected-attention", {"epsilon": 1e38})])
def test_an_overflowed_score_does_not_take_the_layer_past_its_budget(method, hyper):
    """``(attention + epsilon) * ||v||`` with value norms above 3.4: +inf in float32 for every slot."""
    model = tiny_model("llama-gqa", layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(100.0)
    cache = SlakeCache(method, BUDGET, config=model.config, kernels="torch", **hyper)
    with torch.inference_mode():
        model(random_ids(PROMPT, seed=1), **with_cache(model, cache), use_cache=True)
    kept = [int(store.counts().max()) for store in cache.compressor.layers]
    budgets = cache.statistics()["layer_budgets"][0]
    protected = cache.method.protected
    assert all(k <= b + protected for k, b in zip(kept, budgets, strict=True)), (kept, budgets)
    assert max(kept) < PROMPT


@pytest.mark.parametrize("spec", ["cake[gamma=1e39]", "expected-attention[epsilon=1e300]", "slake[alpha=-1e40]"])
def test_a_hyperparameter_beyond_float32_is_refused(spec):
    with pytest.raises(ValueError, match="within float32's range"):
        make_method(spec)
