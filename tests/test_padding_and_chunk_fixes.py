"""Left padding through a chunked prefill, the forward check's refusals (padding after the prompt, right padding),
the charged size of the linear state, and the uncompressed-cache warning (``docs/conventions.md#batches-and-padding``,
``#chunked-prefill``)."""

from __future__ import annotations

import logging

import pytest
import torch

from slake.attention.linear_state import LinearState
from slake.cache.compressed import CompressedKV, linear_state_slots
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill, prefill_position_ids
from tiny_models import random_ids

CHUNK = 16
PADDED = 40  # row 1's left padding: two whole chunks and part of a third


def _padded_batch(n: int = 64, padding: int = PADDED) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(n, seed=4, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    return ids, mask


def _held_padding(cache: SlakeCache, first_real: torch.Tensor) -> int:
    """Valid slots of any layer that hold a row's padding position, or carry a position of none (an empty slot's)."""
    held = 0
    for store in cache.compressor.layers:
        pad = store.positions < first_real.view(-1, 1, 1)
        held += int((store.valid & pad).sum())
    return held


# ---------------------------------------------------------------------------------------------------- chunked padding
@pytest.mark.parametrize(("method", "padding"), [("full", PADDED), ("snapkv", PADDED), ("slake", 48)])
def test_a_chunked_prefill_never_holds_a_rows_padding(llama_gqa, method, padding):
    """Chunks after the first wrote a row's padding as valid keys: attended by the row's real tokens, kept by
    eviction, folded into SLAKE's linear state (12 padding slots kept by snapkv in layer 0 at budget 20). SLAKE's
    first chunk reaches its compressed rows' budget plus a chunk (``first_chunk_end``): row 0's 20 + 16 positions;
    row 1, 16 real tokens within the budget, has its padding's end in the next chunk."""
    ids, mask = _padded_batch(padding=padding)
    first_real = (mask == 0).sum(-1)
    hyper = {} if method == "full" else {"window": 8}
    cache = SlakeCache(method, 20, config=llama_gqa.config, **hyper)
    after_each_chunk = []
    append = cache.compressor.chunks.append

    def spy(layer_idx, keys, values):
        append(layer_idx, keys, values)
        after_each_chunk.append(_held_padding(cache, first_real))

    cache.compressor.chunks.append = spy
    logits = prefill(llama_gqa, cache, ids, mask, prefill_chunk=CHUNK)
    assert after_each_chunk and max(after_each_chunk) == 0
    assert _held_padding(cache, first_real) == 0
    assert torch.isfinite(logits).all()
    for store in cache.compressor.layers:  # an empty slot: no position, score -inf
        assert bool((store.positions[~store.valid] == -1).all())
        assert bool(torch.isneginf(store.scores[~store.valid]).all())


def test_a_chunked_prefill_of_a_padded_batch_gives_each_prompt_its_exact_logits_with_the_full_cache(llama_gqa):
    """Nothing is evicted, so the chunked prefill is exact: each row's last logits equal the row's own exact
    prefill (row 1 was off by 0.4 with its padding attended)."""
    ids, mask = _padded_batch()
    L = llama_gqa.config.num_hidden_layers
    chunked = prefill(llama_gqa, SlakeCache("full", 1, L), ids, mask, prefill_chunk=CHUNK)
    for row in range(2):
        real = ids[row : row + 1, int((mask[row] == 0).sum()) :]
        alone = prefill(llama_gqa, SlakeCache("full", 1, L), real)
        torch.testing.assert_close(chunked[row], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_a_chunked_rows_result_does_not_depend_on_its_padding(llama_gqa, method):
    """Padding is never seen: other padding token ids leave a chunked row's logits, kept sets and linear state as
    they are (its logits moved by 0.18), and SLAKE folds exactly the real tokens it evicted."""
    ids, mask = _padded_batch()
    other = ids.clone()
    other[1, :PADDED] = (other[1, :PADDED] + 77) % 250 + 3

    def run(tokens):
        cache = SlakeCache(method, 20, config=llama_gqa.config, window=8)
        return prefill(llama_gqa, cache, tokens, mask, prefill_chunk=CHUNK), cache.compressor

    (a, ca), (b, cb) = run(ids), run(other)
    torch.testing.assert_close(a[1], b[1], atol=0.0, rtol=0.0)
    for sa, sb in zip(ca.layers, cb.layers):
        assert torch.equal(sa.valid[1], sb.valid[1]) and torch.equal(sa.positions[1], sb.positions[1])
        if method == "slake":
            torch.testing.assert_close(sa.linear.aug[1], sb.linear.aug[1], atol=0.0, rtol=0.0)
            evicted_real = (ids.shape[1] - PADDED) - sa.valid[1].sum(-1)  # per KV head
            assert torch.equal(sa.linear.count[1], evicted_real.float())


def test_the_compressor_leaves_padding_of_a_later_chunk_empty():
    """The engine-agnostic path: a chunk appended with :meth:`CompressedKV.append` inside the prompt's padding."""
    g = torch.Generator().manual_seed(0)
    B, Hq, H, S, d = 2, 4, 2, 48, 8
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :30] = True
    eng = CompressedKV("slake[window=4]", 12, 1, kernels="torch")
    eng.begin_chunked_prefill(pad)
    for c0 in range(0, S, CHUNK):
        q = torch.randn(B, Hq, CHUNK, d, generator=g)
        k, v = torch.randn(B, H, CHUNK, d, generator=g), torch.randn(B, H, CHUNK, d, generator=g)
        if c0 == 0:
            eng.prefill_layer(0, q, k, v, pad[:, :CHUNK], d**-0.5)
        else:
            eng.append(0, k, v)
            assert not bool((eng.layers[0].valid[1] & (eng.layers[0].positions[1] < 30)).any())
            eng.decode_attention(0, q, d**-0.5)
    eng.end_chunked_prefill()
    store = eng.layers[0]
    assert torch.equal(store.linear.count[1], (S - 30 - store.valid[1].sum(-1)).float())


@pytest.mark.parametrize(
    ("method", "hyper"),
    [("expected-attention", {}), ("ada-expected-attention", {}), ("criticalkv", {"scorer": "expected-attention"})],
)
def test_expected_attention_scores_a_chunk_without_the_queries_of_a_rows_padding(llama_gqa, method, hyper):
    """A chunk that holds the end of a row's left padding (positions 16-17 of the chunk 16-31 here) took the
    padding's queries into Expected Attention's statistics, which its prefill leaves out: the row's scores moved by
    up to 7e-3 with other padding token ids, and with ada-expected-attention its kept sets and logits (by 0.03)."""
    padding = 18
    ids, mask = _padded_batch(padding=padding)
    other = ids.clone()
    other[1, :padding] = (other[1, :padding] + 77) % 250 + 3
    L = llama_gqa.config.num_hidden_layers

    def run(tokens):
        cache = SlakeCache(method, 10, L, window=0, **hyper)
        raw = []  # each later chunk's scores of row 1, before its eviction
        evict = cache.compressor.chunks.evict

        def spy(layer_idx, newest):
            store = cache.compressor.layers[layer_idx]
            raw.append(store.scores[1][store.valid[1]].clone())
            evict(layer_idx, newest)

        cache.compressor.chunks.evict = spy
        logits = prefill(llama_gqa, cache, tokens, mask, prefill_chunk=CHUNK)
        return logits, cache.compressor, raw

    (a, ca, ra), (b, cb, rb) = run(ids), run(other)
    assert len(ra) == len(rb) == L * (ids.shape[1] // CHUNK - 1)
    for x, y in zip(ra, rb, strict=True):
        torch.testing.assert_close(x, y, atol=0.0, rtol=0.0)
    torch.testing.assert_close(a[1], b[1], atol=0.0, rtol=0.0)
    for sa, sb in zip(ca.layers, cb.layers):
        assert torch.equal(sa.valid[1], sb.valid[1]) and torch.equal(sa.positions[1], sb.positions[1])


# ------------------------------------------------------------------------------------- the continuation check
@pytest.mark.parametrize("chunk", [8, 16])
def test_a_chunk_that_ends_inside_a_rows_padding_continues_the_cache(llama_gqa, chunk):
    """A chunk ending inside a row's left padding (position id 1 by model.generate's convention) was refused with
    "does not continue it"."""
    ids, mask = _padded_batch()
    cache = SlakeCache("snapkv", 20, config=llama_gqa.config, window=8)
    assert torch.isfinite(prefill(llama_gqa, cache, ids, mask, prefill_chunk=chunk)).all()
    assert cache.compressor.seen[0] == ids.shape[1]


def test_the_continuation_check_still_compares_the_rows_with_real_tokens_during_a_chunked_prefill(llama_gqa):
    ids, mask = _padded_batch()
    pos = prefill_position_ids(mask)
    cache = SlakeCache("snapkv", 20, config=llama_gqa.config, window=8)
    cache.begin_chunked_prefill(mask)
    with torch.inference_mode():
        llama_gqa(input_ids=ids[:, :CHUNK], attention_mask=mask[:, :CHUNK], position_ids=pos[:, :CHUNK],
                  **with_cache(llama_gqa, cache))  # fmt: skip
    L = llama_gqa.config.num_hidden_layers
    end = 2 * CHUNK  # the second chunk ends inside row 1's padding: row 0 alone is compared
    with torch.inference_mode():  # where the cache was filled (outside, it is refused: test_hf_generate_fixes)
        cache.check_forward(L, CHUNK, mask[:, :end], pos[:, CHUNK:end])
        wrong = pos[:, CHUNK:end].clone()
        wrong[0] += 3
        with pytest.raises(ValueError, match="does not continue it"):
            cache.check_forward(L, CHUNK, mask[:, :end], wrong)


def _prefilled(model, **kw) -> tuple[SlakeCache, torch.Tensor, torch.Tensor]:
    ids = random_ids(30, seed=1, batch=2)
    mask = torch.ones_like(ids)
    cache = SlakeCache("full", 10000, config=model.config, **kw)
    prefill(model, cache, ids, mask)
    return cache, ids, mask


@pytest.mark.parametrize("position_ids", [False, True])
def test_padding_after_the_prompt_is_refused(llama_gqa, position_ids):
    """A 0 in the mask of a decode token or a later turn was ignored: the token was kept and attended all the same
    (logits off by 0.03-0.07 against transformers' cache), or refused as "does not continue it"."""
    cache, ids, mask = _prefilled(llama_gqa)
    turn = random_ids(6, seed=3, batch=2)
    full = torch.cat([mask, torch.ones_like(turn)], 1)
    full[1, 30:33] = 0  # row 1's new turn, left-padded in the middle of the sequence
    kw = {"position_ids": (full.cumsum(-1) - 1)[:, -6:].clamp_min(0)} if position_ids else {}
    with pytest.raises(ValueError, match="padding after the prompt is not supported") as refused:
        with torch.inference_mode():
            llama_gqa(input_ids=turn, attention_mask=full, **with_cache(llama_gqa, cache), **kw)
    assert "position 30 of row 1" in str(refused.value) and "padding_side = 'left'" in str(refused.value)
    assert cache.compressor.seen[0] == 30  # refused before any layer ran


def test_a_masked_decode_token_is_refused_and_an_unmasked_one_continues(llama_gqa):
    cache, ids, mask = _prefilled(llama_gqa)
    step = torch.tensor([[5], [6]])
    with torch.inference_mode():
        with pytest.raises(ValueError, match="padding after the prompt is not supported"):
            llama_gqa(input_ids=step, attention_mask=torch.cat([mask, torch.tensor([[1], [0]])], 1),
                      **with_cache(llama_gqa, cache))  # fmt: skip
        llama_gqa(input_ids=step, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                  **with_cache(llama_gqa, cache))  # fmt: skip
    assert cache.compressor.seen[0] == 31


def test_a_static_cache_refuses_padding_after_the_prompt_in_eager_steps():
    from tiny_models import tiny_model

    model = tiny_model("llama-gqa", layers=2)
    cache, ids, mask = _prefilled(model, max_cache_len=40)
    assert cache.compressor.static
    with pytest.raises(ValueError, match="padding after the prompt is not supported"):
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5], [6]]), attention_mask=torch.cat([mask, torch.tensor([[1], [0]])], 1),
                  position_ids=torch.tensor([[30], [30]]), **with_cache(model, cache))  # fmt: skip


# -------------------------------------------------------------------------------------------------- right padding
def test_right_padding_is_refused_by_the_compressor():
    g = torch.Generator().manual_seed(0)
    B, Hq, H, S, d = 1, 2, 1, 60, 8
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, 40:] = True
    q, k, v = torch.randn(B, Hq, S, d, generator=g), torch.randn(B, H, S, d, generator=g), torch.randn(B, H, S, d)
    eng = CompressedKV("streamingllm", 12, 1, kernels="torch")
    with pytest.raises(ValueError, match=r"left padding only.*row 0.*position 40.*padding_side = 'left'"):
        eng.prefill_layer(0, q, k, v, pad, d**-0.5)
    with pytest.raises(ValueError, match="left padding only"):
        CompressedKV("snapkv[window=4]", 12, 1, kernels="torch").begin_chunked_prefill(pad)
    inner = torch.zeros(B, S, dtype=torch.bool)
    inner[0, 10:20] = True
    with pytest.raises(ValueError, match="left padding only"):
        CompressedKV("snapkv[window=4]", 12, 1, kernels="torch").prefill_layer(0, q, k, v, inner, d**-0.5)


@pytest.mark.parametrize("chunk", [None, 16])
def test_right_padding_is_refused_by_the_engine_before_any_layer_runs(llama_gqa, chunk):
    ids = random_ids(64, seed=4, batch=2)
    mask = torch.ones_like(ids)
    mask[1, 44:] = 0
    cache = SlakeCache("snapkv", 20, config=llama_gqa.config, window=8)
    with pytest.raises(ValueError, match=r"left padding only.*row 1.*padding_side = 'left'"):
        prefill(llama_gqa, cache, ids, mask, prefill_chunk=chunk)
    assert all(store is None for store in cache.compressor.layers)


# ------------------------------------------------------------------------------------- linear state, warning
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("itemsize", [4, 2, (64 + 4) / 64])
def test_the_charged_slots_cover_the_linear_state(head_dim, itemsize):
    """The state is ``(d + 1)^2`` float32 numbers; ``d^2 + 2d`` charged one slot too few at d = 64 (33 fp32 slots
    for 16,900 bytes)."""
    state = LinearState.empty(1, 1, head_dim, torch.device("cpu")).nbytes()
    slots = linear_state_slots(head_dim, itemsize)
    slot_bytes = 2 * head_dim * itemsize
    assert (slots - 1) * slot_bytes < state <= slots * slot_bytes


def test_the_charged_slots_at_head_dim_64():
    assert linear_state_slots(64, 4) == 34 and linear_state_slots(64, 2) == 67


def test_the_full_cache_never_warns_that_it_compresses_nothing(caplog):
    """The full cache keeps every token by design: "this SlakeCache's first prompt ... compresses nothing" was
    logged for it; a method that could have compressed still says so."""
    g = torch.Generator().manual_seed(0)
    B, Hq, H, S, d = 1, 2, 1, 30, 8

    def grow(method: str) -> None:
        eng = CompressedKV(method, 40, 1, kernels="torch")
        eng.prefill_layer(0, torch.randn(B, Hq, S, d, generator=g), torch.randn(B, H, S, d, generator=g),
                          torch.randn(B, H, S, d, generator=g), None, d**-0.5)  # fmt: skip
        eng.append(0, torch.randn(B, H, 20, d, generator=g), torch.randn(B, H, 20, d, generator=g))

    with caplog.at_level(logging.WARNING, logger="slake"):
        grow("full")
        assert not [r for r in caplog.records if "compresses nothing" in r.getMessage()]
        grow("snapkv[window=4]")
        assert [r for r in caplog.records if "compresses nothing" in r.getMessage()]
