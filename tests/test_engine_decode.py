"""Decode over the compressed cache: absolute positions, constant size, padded batches, sampling."""

from __future__ import annotations

import copy

import pytest
import torch

import slake
from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import prefill_for_generate, random_ids, tiny_model


def _generate(model, ids, cache, n, attention_mask=None, **kw):
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
            **kw,
        )


def test_streamingllm_positions_match_a_masked_full_forward(llama_gqa):
    """Token t after an N-token prompt is at position N + t and sees exactly sinks + recent tokens.

    Reference computed directly: the full sequence through plain SDPA with a 4D mask that lets prompt rows see
    everything causally (exact prefill) and each decoded row see only the 4 sinks and the C - 4 most recent tokens.
    """
    model, N, C, steps = llama_gqa, 64, 24, 12
    ids = random_ids(N, seed=5)
    out = _generate(model, ids, SlakeCache("streamingllm", C, model.config.num_hidden_layers), steps)
    seq = out.sequences[:, :-1]  # every token that was fed to the model
    T = seq.shape[1]
    allowed = torch.ones(T, T).tril().bool()
    for row in range(N, T):
        # at the step that feeds token `row`, the cache holds C tokens (sinks + recent) before appending it
        keep = torch.zeros(T, dtype=torch.bool)
        keep[:4] = True
        keep[row - (C - 4) : row + 1] = True
        allowed[row] &= keep
    mask = torch.zeros(1, 1, T, T).masked_fill(~allowed, float("-inf"))
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = model(seq, attention_mask=mask, position_ids=torch.arange(T)[None]).logits
    finally:
        slake.prepare_model(model)
    for t, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits[0], ref[0, N - 1 + t], rtol=1e-4, atol=1e-4, msg=f"step {t}")


@pytest.mark.parametrize("method", ["h2o", "tova", "snapkv", "cake", "slake", "streamingllm"])
def test_cache_size_constant_during_long_decode(llama_gqa, method):
    model = llama_gqa
    L = model.config.num_hidden_layers
    ids = random_ids(96, seed=6)
    cache = SlakeCache(method, 48, L)
    _generate(model, ids, cache, 100)
    counts = [s.counts() for s in cache.compressor.layers]
    after_prefill = cache.compressor.targets
    for layer, (c, t) in enumerate(zip(counts, after_prefill)):
        assert torch.equal(c, t), f"layer {layer}: {c.tolist()} != {t.tolist()}"
    if method in ("h2o", "tova", "snapkv", "streamingllm"):  # uniform layer budgets
        assert all(bool((c == 48).all()) for c in counts)
    else:  # adaptive layer budgets sum exactly to the total
        assert int(sum(c[0, 0] for c in counts)) == 48 * L
    # capacity never grows past budget + one free slot for the incoming token (no per-step reallocation)
    cap = [s.capacity for s in cache.compressor.layers]
    assert max(cap) <= max(int(c.max()) for c in counts) + 256


@pytest.mark.parametrize("method", list(slake.available_methods()))
def test_padded_batch_equals_single_prompts(llama_gqa, method):
    model = llama_gqa
    L = model.config.num_hidden_layers
    lengths = [70, 100, 85]
    prompts = [random_ids(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    S = max(lengths)
    ids = torch.zeros(3, S, dtype=torch.long)
    mask = torch.zeros(3, S, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, S - len(p) :] = p
        mask[i, S - len(p) :] = 1
    batch = _generate(model, ids, SlakeCache(method, 40, L), 12, attention_mask=mask)
    for i, p in enumerate(prompts):
        single = _generate(model, p[None], SlakeCache(method, 40, L), 12)
        assert torch.equal(batch.sequences[i, S:], single.sequences[0, len(p) :]), f"{method}: prompt {i} differs"
        for a, b in zip(batch.logits, single.logits):
            torch.testing.assert_close(a[i], b[0], rtol=1e-3, atol=1e-3)


def test_sampling_and_num_return_sequences(llama_gqa):
    model = llama_gqa
    ids = random_ids(90, seed=7)
    cache = SlakeCache("slake", 40, model.config.num_hidden_layers)
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
    assert all(s.keys.shape[0] == 2 for s in cache.compressor.layers)


def test_unrouted_model_raises_instead_of_silently_not_compressing():
    model = tiny_model("llama-gqa")
    model.set_attn_implementation("sdpa")
    ids = random_ids(80, seed=8)
    with pytest.raises(RuntimeError, match="registered attention function"):
        _generate(model, ids, SlakeCache("snapkv", 40, model.config.num_hidden_layers), 3)


@pytest.mark.parametrize("padded", [False, True])
def test_a_layer_that_never_evicts_attends_without_a_mask_when_its_slots_are_a_prefix(llama_gqa, padded):
    """An unpadded batch of the full cache keeps every layer's valid slots as one prefix: the eager step calls SDPA
    over those slots with no mask (what a GPU runs with its decode kernel; the masked call read an H200's cache at a
    twentieth of its bandwidth) and gives the logits of the masked call; a left-padded batch keeps the mask."""
    model = llama_gqa
    ids = torch.cat([random_ids(40, seed=1), random_ids(40, seed=2)])
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    runs = {}
    for prefix in (True, False):
        cache = SlakeCache("full", 16, model.config.num_hidden_layers)
        decoder = cache.compressor.decoder
        if not prefix:  # the masked call: a layer whose slots are not known to be a prefix
            decoder._prefix_of = lambda layer_idx, store: None
        out = _generate(model, ids, cache, 6, attention_mask=mask)
        runs[prefix] = torch.stack(out.logits)
        if prefix:
            kept = [decoder._prefix[i] for i in range(model.config.num_hidden_layers)]
            assert kept == ([-1] * len(kept) if padded else [40 + 5] * len(kept))  # 40 prompt + 5 attended steps
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype, visible", [(None, False), ("int8", False), ("fp8_e4m3", True)])
def test_writing_a_token_into_a_slot_known_on_the_host_writes_what_the_slots_scatter_writes(kv_dtype, visible):
    """``LayerStore.write_at`` (the eager full cache's step, whose first free slot is known on the host) leaves the
    store as ``_write`` by a slot tensor does: keys, values (8-bit codes and scales), position, validity, score and
    per-head visibility."""
    from slake.cache.layer_store import LayerStore

    g = torch.Generator().manual_seed(0)
    B, H, n, d, slot = 2, 3, 10, 8, 6

    def store() -> LayerStore:
        valid = torch.arange(n).expand(B, H, n) < slot
        vis = valid[:, :, None, :].expand(B, H, 2, n).clone() if visible else None
        return LayerStore(
            torch.randn(B, H, n, d, generator=g), torch.randn(B, H, n, d, generator=g),
            torch.where(valid, torch.arange(n), -1), valid.clone(), torch.rand(B, H, n, generator=g), None, vis,
            kv_dtype,
        )  # fmt: skip

    a = store()
    b = copy.deepcopy(a)
    k, v, pos = torch.randn(B, H, 1, d, generator=g), torch.randn(B, H, 1, d, generator=g), torch.tensor(41)
    a._write(torch.full((B, H, 1), slot), k, v, pos.view(1, 1, 1).expand(B, H, 1), 0.0)
    b.write_at(slot, k, v, pos)
    for name in ("keys", "values", "k_scale", "v_scale", "positions", "valid", "scores", "head_visible"):
        assert (getattr(a, name) is None) == (getattr(b, name) is None), name
        if getattr(a, name) is not None:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert b.valid[:, :, slot].all() and (b.positions[:, :, slot] == 41).all()


@pytest.mark.parametrize("masked", [False, True])
def test_the_full_caches_sdpa_step_returns_sdpas_own_dtype(masked):
    """The full cache's step returns SDPA's output in the cache's dtype: a bfloat16 model's output is not cast to
    float32 and back (two kernels per layer and step on a GPU), and its values are those of the cast."""
    from slake.cache.decode_step import sdpa_step

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 8, generator=g).bfloat16()
    k, v = torch.randn(2, 3, 10, 8, generator=g).bfloat16(), torch.randn(2, 3, 10, 8, generator=g).bfloat16()
    valid = torch.arange(10).expand(2, 3, 10) < 7 if masked else None
    out = sdpa_step(q, k, v, valid, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 6, 8)
    kk, vv = (k[:, :, :7], v[:, :, :7]) if masked else (k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.view(2, 3, 2, 8), kk, vv, scale=0.3)
    torch.testing.assert_close(out.float(), ref.reshape(2, 6, 8).float(), rtol=2e-2, atol=2e-2)


def test_unmasked_sdpa_turns_cudnn_off_for_the_call_and_back_on(monkeypatch):
    """The unmasked step's SDPA runs with cuDNN's backend off (on an H200 it picked cuDNN's flash forward, which
    does not split the keys and builds a plan per key length: tests/test_cuda.py checks the kernels there) and
    restores the flag after the call, also when the call raises; its output is the plain call's."""
    from slake.cache import decode_step

    seen = []
    plain = decode_step.F.scaled_dot_product_attention

    def recording(*args, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return plain(*args, **kw)

    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(decode_step.F, "scaled_dot_product_attention", recording)
    out = decode_step._sdpa_without_cudnn(q, k, v, 0.3)
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
    torch.testing.assert_close(out, plain(q, k, v, scale=0.3))

    def failing(*args, **kw):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(decode_step.F, "scaled_dot_product_attention", failing)
    with pytest.raises(RuntimeError, match="no kernel"):
        decode_step._sdpa_without_cudnn(q, k, v, 0.3)
    assert torch.backends.cuda.cudnn_sdp_enabled()
