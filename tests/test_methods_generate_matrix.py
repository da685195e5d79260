"""Every evicting method x linear_cache end to end through ``model.generate``, plus the generate-level limiting cases
of LAVa / SAGE-KV and the padded-batch equivalence of the LAVa, AhaKV, SAGE-KV and Ada-* methods."""

from __future__ import annotations

import pytest
import torch

from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import prefill_for_generate, random_ids

EVICTING = [
    "snapkv",
    "pyramidkv",
    "h2o",
    "tova",
    "streamingllm",
    "cake",
    "lava",
    "ahakv",
    "sagekv",
    "ada-snapkv",
    "ada-pyramidkv",
    "keydiff",
    "expected-attention",
    "ada-expected-attention",
    "criticalkv",
    "ada-criticalkv",
    "kvzip",
]
NEW = [
    "lava",
    "ahakv",
    "sagekv",
    "ada-snapkv",
    "ada-pyramidkv",
    "keydiff",
    "expected-attention",
    "ada-expected-attention",
    "criticalkv",
    "ada-criticalkv",
    "kvzip",
]
PROMPT, BUDGET, STEPS = 96, 40, 30


def _generate(model, ids, cache, n, attention_mask=None):
    prefill_for_generate(model, cache, ids, attention_mask)  # KVzip's second pass, as slake.generate runs it
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
            **with_cache(model, cache),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
        )


@pytest.fixture(scope="module")
def prompt_and_reference(llama_gqa):
    ids = random_ids(PROMPT, seed=21)
    with torch.no_grad():
        first = llama_gqa(ids).logits[0, -1]  # plain transformers cache (no SlakeCache: SDPA fallback)
    return ids, first


@pytest.mark.parametrize("linear", [False, True], ids=["evict", "ptaa"])
@pytest.mark.parametrize("method", EVICTING)
def test_every_method_with_and_without_linear_cache(llama_gqa, prompt_and_reference, method, linear):
    model = llama_gqa
    ids, first = prompt_and_reference
    cache = SlakeCache(method, BUDGET, model.config.num_hidden_layers, linear_cache=linear)
    eng = cache.compressor
    sizes: list[list[torch.Tensor]] = []
    decode = eng.decode_attention

    def recording(layer_idx, queries, scaling):
        out = decode(layer_idx, queries, scaling)
        sizes.append([layer_idx, eng.layers[layer_idx].counts().clone()])
        return out

    eng.decode_attention = recording
    out = _generate(model, ids, cache, STEPS)
    assert len(out.logits) == STEPS and all(bool(torch.isfinite(lg).all()) for lg in out.logits)
    # prefill is exact, also for a second-pass method (KVzip), whose prefill slake runs and hands to model.generate
    torch.testing.assert_close(out.logits[0][0], first, rtol=1e-4, atol=1e-4)
    assert len(sizes) == (STEPS - 1) * model.config.num_hidden_layers
    for layer, counts in sizes:  # constant per (sequence, KV head) size after every decode step
        assert torch.equal(counts, eng.targets[layer]), f"{method}: layer {layer}"
        assert int(counts.max()) <= PROMPT
    kept = sum(int(t.sum()) for t in eng.targets)
    assert kept <= BUDGET * model.config.num_hidden_layers * model.config.num_key_value_heads
    if linear:
        assert all(int(s.linear.count.min()) > 0 for s in eng.layers)  # evicted tokens were folded
    stats = cache.statistics()
    assert stats["compressed"], f"{method}: a {PROMPT}-token prompt over a budget of {BUDGET} was not compressed"
    if linear:
        assert stats["kv_bytes"]["linear_state"] > 0  # the folded state is charged
    else:
        assert stats["kv_bytes"]["linear_state"] == 0  # no linear cache, no state


@pytest.mark.parametrize("method", NEW)
def test_budget_at_prompt_length_equals_full_cache(llama_gqa, method):
    model = llama_gqa
    ids = random_ids(40, seed=22)
    with torch.no_grad():
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
        )
    out = _generate(model, ids, SlakeCache(method, 64, model.config.num_hidden_layers), 6)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _logits(model, ids, method, budget, **hyper):
    return _generate(model, ids, SlakeCache(method, budget, model.config.num_hidden_layers, **hyper), 20).logits


def test_lava_uniform_without_value_scaling_is_snapkv_maxpool(llama_gqa, prompt_and_reference):
    """Guide 1.9 (i): uniform layer and head budgets; Vbar does not change ranks within a head."""
    ids, _ = prompt_and_reference
    ours = _logits(llama_gqa, ids, "lava", BUDGET, layers="uniform", head_budget="uniform", gqa="mean")
    ref = _logits(llama_gqa, ids, "snapkv", BUDGET, kernel=7, pooling="max")
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lava_uniform_no_vnorm_is_ada_snapkv_without_safeguard(llama_gqa, prompt_and_reference):
    """Guide 1.9 (ii): Vbar = 1, uniform layer budgets, alpha = 0 is AdaKV's cross-head top-k."""
    ids, _ = prompt_and_reference
    ours = _logits(llama_gqa, ids, "lava", BUDGET, layers="uniform", value_norm="none", gqa="mean")
    ref = _logits(llama_gqa, ids, "ada-snapkv", BUDGET, alpha_safeguard=0.0, group_first=False)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sagekv_with_k_zero_is_streamingllm(llama_gqa, prompt_and_reference):
    """Guide 3.8: k = 0 is StreamingLLM with sink S = B/4 and the rest of the budget as a sliding window."""
    ids, _ = prompt_and_reference
    ours = _logits(llama_gqa, ids, "sagekv", BUDGET, k=0)
    ref = _logits(llama_gqa, ids, "streamingllm", BUDGET, sinks=BUDGET // 4)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["sagekv", "lava"])
def test_sampling_with_num_return_sequences_carries_per_head_state(llama_gqa, method):
    """repeat_batch / select_batch carry the per-query-head visibility and the per-head sizes."""
    model = llama_gqa
    ids = random_ids(90, seed=23)
    cache = SlakeCache(method, 40, model.config.num_hidden_layers)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **with_cache(model, cache),
            max_new_tokens=8,
            do_sample=True,
            top_k=20,
            num_return_sequences=2,
            pad_token_id=0,
        )
    assert out.shape == (2, 98)
    for store, target in zip(cache.compressor.layers, cache.compressor.targets):
        assert store.keys.shape[0] == 2 and torch.equal(store.counts(), target)
        if method == "sagekv":
            assert store.head_visible is not None and store.head_visible.shape[:2] == (2, 2)
            assert store.head_visible.shape[-1] == store.capacity
