"""The compressed cache equals transformers' own cache when nothing is evicted, on every architecture."""

from __future__ import annotations

import pytest
import torch

import slake
from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import ARCHS, random_ids, tiny_model

METHODS = ["full", "streamingllm", "h2o", "tova", "snapkv", "pyramidkv", "cake", "slake"]


def _reference(model, ids, new_tokens):
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(ids).logits
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                min_new_tokens=new_tokens,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=0,
            )
    finally:
        slake.prepare_model(model)
    return logits, out


def _ours(model, ids, method, budget, new_tokens):
    slake.prepare_model(model)
    L = model.config.num_hidden_layers
    with torch.no_grad():
        logits = model(ids, **with_cache(model, SlakeCache(method, budget, L))).logits
        cache = SlakeCache(method, budget, L)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **with_cache(model, cache),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
        )
    return logits, out, cache


@pytest.mark.parametrize("arch", ARCHS)
def test_budget_at_prompt_length_equals_full_cache(arch):
    model = tiny_model(arch)
    ids = random_ids(48, seed=1)
    ref_logits, ref = _reference(model, ids, 20)
    for method in METHODS:
        logits, out, cache = _ours(model, ids, method, budget=48, new_tokens=20)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"{arch}/{method} prompt logits")
        assert torch.equal(out.sequences, ref.sequences), f"{arch}/{method}: tokens differ"
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{arch}/{method} decode logits")
        stats = cache.statistics()
        assert stats["compressed"] is False
        # the last generated token is never fed back, so the cache holds 48 + 19 tokens
        assert stats["kept_tokens_per_layer"] == [67.0] * model.config.num_hidden_layers


def test_prefill_logits_are_exact_even_when_compressing(llama_gqa):
    """Compression happens after each layer's attention, so prompt logits equal the full cache (spec 12.15)."""
    ids = random_ids(80, seed=2)
    ref_logits, _ = _reference(llama_gqa, ids, 1)
    for method in METHODS:
        logits, _, _ = _ours(llama_gqa, ids, method, budget=40, new_tokens=1)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=method)


def test_compression_changes_decoding(llama_gqa):
    """A test that cannot fail is no test: at a small budget decoded logits differ from the full cache."""
    ids = random_ids(120, seed=3)
    _, ref = _reference(llama_gqa, ids, 5)
    _, out, cache = _ours(llama_gqa, ids, "snapkv", 40, 5)
    assert cache.statistics()["compressed"] is True
    assert not torch.allclose(out.logits[1], ref.logits[1], atol=1e-4)
