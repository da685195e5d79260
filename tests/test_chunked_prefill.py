"""Chunked prefill (bounded prefill memory) and the decode path's in-place storage."""

from __future__ import annotations

import pytest
import torch

from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids

METHODS = ["snapkv", "cake", "slake", "h2o", "pyramidkv"]


def _greedy(model, cache: SlakeCache, ids: torch.Tensor, steps: int, chunk: int | None) -> tuple[list, torch.Tensor]:
    logits = prefill(model, cache, ids, prefill_chunk=chunk)
    first = logits
    tok = logits.argmax(-1, keepdim=True)
    out = [tok]
    with torch.inference_mode():
        for _ in range(steps - 1):
            logits = model(tok, **with_cache(model, cache), use_cache=True).logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            out.append(tok)
    return torch.cat(out, -1).tolist(), first


@pytest.mark.parametrize("method", METHODS)
def test_chunk_at_least_prompt_length_is_the_exact_prefill(llama_gqa, method):
    ids = random_ids(96, seed=1)
    L = llama_gqa.config.num_hidden_layers
    exact = _greedy(llama_gqa, SlakeCache(method, 40, L, window=8), ids, 6, None)
    chunked = _greedy(llama_gqa, SlakeCache(method, 40, L, window=8), ids, 6, 96)
    assert exact[0] == chunked[0]
    torch.testing.assert_close(exact[1], chunked[1])


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_chunked_prefill_with_budget_above_prompt_equals_full_cache(llama_gqa, method):
    ids = random_ids(80, seed=2)
    L = llama_gqa.config.num_hidden_layers
    full_tokens, full_logits = _greedy(llama_gqa, SlakeCache("full", 1, L), ids, 6, None)
    cache = SlakeCache(method, 200, L, window=8)
    tokens, logits = _greedy(llama_gqa, cache, ids, 6, 16)
    assert tokens == full_tokens
    torch.testing.assert_close(logits, full_logits, atol=1e-4, rtol=1e-4)
    assert not cache.statistics()["compressed"]


@pytest.mark.parametrize("method", METHODS)
def test_cache_stays_bounded_during_chunked_prefill(llama_gqa, method):
    L = llama_gqa.config.num_hidden_layers
    budget, chunk, n = 24, 16, 160
    cache = SlakeCache(method, budget, L, window=8, prefill_chunk=chunk)
    sizes = []
    engine = cache.compressor
    orig = engine.chunks.evict

    def spy(layer_idx, newest):
        orig(layer_idx, newest)
        sizes.append(max(engine.layers[l].capacity for l in range(L) if engine.layers[l] is not None))

    engine.chunks.evict = spy
    tokens, logits = _greedy(llama_gqa, cache, random_ids(n, seed=3), 4, None)
    assert sizes, "later chunks must be evicted"
    assert torch.isfinite(logits).all()
    # per-layer budgets (cascade, pyramid) may exceed the average, but never L * budget (+ one chunk): the bound
    # does not depend on the prompt length
    assert max(sizes) <= L * budget + chunk
    stats = cache.statistics()
    assert stats["compressed"]
    assert max(stats["kept_tokens_per_layer"]) <= L * budget
    assert engine.seen == [n + 3] * L


def test_chunked_prefill_batch_with_padding_is_finite(llama_gqa):
    L = llama_gqa.config.num_hidden_layers
    ids = random_ids(64, seed=4, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    cache = SlakeCache("snapkv", 24, L, window=8)
    logits = prefill(llama_gqa, cache, ids, mask, prefill_chunk=16)
    assert torch.isfinite(logits).all()
    for store in cache.compressor.layers:
        assert not bool((store.valid & (store.positions < 10) & (store.positions >= 0))[1].any())


def test_a_prefill_chunk_below_one_is_refused():
    from slake.engines.transformers.cache import SlakeCache as C

    with pytest.raises(ValueError):
        C("snapkv", 16, 2, prefill_chunk=0)


def _spy_chunks(monkeypatch) -> list[tuple[int, int]]:
    """Record ``(layer, tokens)`` of every later prompt chunk appended during a chunked prefill (the first chunk is
    prefilled exactly; :meth:`ChunkedPrefill.append` is only reached between ``begin`` and ``end``)."""
    from slake.cache.chunked import ChunkedPrefill

    appended: list[tuple[int, int]] = []
    orig = ChunkedPrefill.append

    def append(self, layer_idx, keys, values):
        appended.append((layer_idx, keys.shape[2]))
        return orig(self, layer_idx, keys, values)

    monkeypatch.setattr(ChunkedPrefill, "append", append)
    return appended


def test_slake_generate_prefills_in_chunks_of_prefill_chunk(monkeypatch):
    """``slake.generate(prefill_chunk=16)`` on a 65-token prompt prefills it in chunks of 16 and a last one of 1
    (the first exact, the others appended and evicted in every layer), then decodes from the last chunk's logits, as
    ``slake eval`` does (before 2026-11-30 the last prompt token was a decode step); the cache stays within its
    budget."""
    import slake
    from slake.engines.transformers.shapes import random_model
    from tiny_models import word_tokenizer

    appended = _spy_chunks(monkeypatch)
    model = random_model("tiny", seed=0)
    L = model.config.num_hidden_layers
    prompt = " ".join(f"w{3 + (5 * i) % 250}" for i in range(65))
    out = slake.generate(
        model, word_tokenizer(), prompt, method="snapkv", budget=24, window=8, max_new_tokens=4,
        chat_template=False, prefill_chunk=16,
    )  # fmt: skip
    assert out.prompt_tokens == [65] and out.compressed
    assert sorted(appended) == sorted(
        [(layer, 16) for layer in range(L) for _ in range(3)] + [(layer, 1) for layer in range(L)]
    )
    assert max(out.kept_tokens_per_layer) <= 24 + 4


@pytest.mark.parametrize("method", ["snapkv", "cake", "slake", "h2o"])
def test_decode_reuses_storage_in_place(llama_gqa, method):
    """No decode step reallocates a layer: the storage tensors keep their data_ptr once the first step has
    reserved a free slot per row (slot reuse after each eviction)."""
    L = llama_gqa.config.num_hidden_layers
    cache = SlakeCache(method, 32, L, window=8)
    ids = random_ids(120, seed=5)
    tok = prefill(llama_gqa, cache, ids).argmax(-1, keepdim=True)
    ptrs = None
    with torch.inference_mode():
        for step in range(12):
            tok = llama_gqa(tok, **with_cache(llama_gqa, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            now = [
                (s.keys.data_ptr(), s.values.data_ptr(), s.positions.data_ptr(), s.valid.data_ptr())
                + ((s.linear.kv.data_ptr(),) if s.linear is not None else ())
                for s in cache.compressor.layers
            ]
            if step >= 1:
                assert now == ptrs, f"a layer was reallocated at decode step {step}"
            ptrs = now


def test_model_generate_continues_after_a_chunked_prefill(llama_gqa):
    """A cache prefilled in chunks with all prompt tokens but the last continues under plain ``model.generate``,
    which feeds the last token as its first step (the pattern of ``slake.generate(prefill_chunk=...)`` before
    2026-11-30; it now prefills the whole prompt and hands the last chunk's logits over)."""
    L = llama_gqa.config.num_hidden_layers
    ids = random_ids(100, seed=6)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    cache = SlakeCache("slake", 32, L, window=8)
    prefill(llama_gqa, cache, ids[:, :-1], prefill_chunk=24)
    with torch.inference_mode():
        out = llama_gqa.generate(ids, attention_mask=torch.ones_like(ids), **with_cache(llama_gqa, cache), **kw)
    assert out.shape == (1, 105)
    assert cache.compressor.seen == [104] * L and not cache.compressor.chunked_prefill
    # budget above the prompt: chunked + generate equals plain generate with the full cache
    ref_cache, big = SlakeCache("full", 1, L), SlakeCache("snapkv", 400, L, window=8)
    prefill(llama_gqa, big, ids[:, :-1], prefill_chunk=24)
    with torch.inference_mode():
        ref = llama_gqa.generate(ids, attention_mask=torch.ones_like(ids), **with_cache(llama_gqa, ref_cache), **kw)
        got = llama_gqa.generate(ids, attention_mask=torch.ones_like(ids), **with_cache(llama_gqa, big), **kw)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize(("method", "chunk"), [("snapkv", 8), ("h2o", 8), ("slake", 8), ("kvzip", None)])
def test_a_prompt_of_budget_plus_one_is_compressed_after_a_split_prefill(method, chunk, monkeypatch):
    """A prompt of ``budget + 1`` tokens is compressed by a chunked (or KVzip's two-pass) prefill as by the exact
    one. When ``slake.generate`` fed the last prompt token as a decode step (before 2026-11-30), such a prompt was
    once left uncompressed (the prefilled part held ``budget``), its cache growing by every generated token; it now
    prefills the whole prompt (the last chunk holds that token)."""
    import slake
    from slake.engines.transformers.shapes import random_model
    from tiny_models import word_tokenizer

    budget, new = 40, 6
    model = random_model("tiny", seed=0)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(budget + 1))
    common = dict(method=method, budget=budget, max_new_tokens=new, chat_template=False, window=8)
    exact = slake.generate(model, word_tokenizer(), prompt, **common)
    appended = _spy_chunks(monkeypatch)
    split = slake.generate(model, word_tokenizer(), prompt, prefill_chunk=chunk, **common)
    assert exact.prompt_tokens == split.prompt_tokens == [budget + 1]
    if chunk is not None and method == "slake":  # its first chunk reaches the budget plus a chunk: the prompt
        assert appended == []
    elif chunk is not None:  # five chunks of 8 and one of 1: the first exact, the others appended in each layer
        L = model.config.num_hidden_layers
        chunks = [chunk] * (budget // chunk - 1) + [1]
        assert sorted(appended) == sorted((layer, n) for layer in range(L) for n in chunks)
    else:
        assert appended == []
    assert exact.compressed and split.compressed
    assert max(split.kept_tokens_per_layer) <= max(exact.kept_tokens_per_layer) + 1


def test_trailing_prompt_tokens_are_refused_when_negative_or_after_the_prefill(llama_gqa):
    L = llama_gqa.config.num_hidden_layers
    cache = SlakeCache("snapkv", 16, L, window=4)
    with pytest.raises(ValueError, match=">= 0"):
        cache.compressor.expect_trailing_prompt_tokens(-1)
    prefill(llama_gqa, cache, random_ids(40, seed=2))
    with pytest.raises(RuntimeError, match="before the prefill"):
        cache.compressor.expect_trailing_prompt_tokens(1)
