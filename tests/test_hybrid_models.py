"""Hybrid attention: the full-attention layers are compressed, sliding-window layers keep transformers' own bounded
cache (docs/conventions.md#hybrid-models). Models whose attention slake does not model are refused in one line."""

from __future__ import annotations

import pytest
import torch

import slake
from hybrid_models import ALL_SLIDING, HYBRID, REFUSED, WINDOW, hybrid_model
from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.prefill_once import capture_prefill, greedy_decode, stack_captures
from tiny_models import random_ids

METHODS = [
    "full",
    "streamingllm",
    "h2o",
    "tova",
    "snapkv",
    "pyramidkv",
    "cake",
    "slake",
    "lava",
    "ahakv",
    "sagekv",
    "ada-snapkv",
]


def _generate(model, ids, cache, new_tokens, mask=None):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            **with_cache(model, cache),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
        )


def _reference(model, ids, new_tokens, mask=None):
    """Plain transformers: SDPA and its own cache (sliding layers bounded by DynamicCache(config=...))."""
    model.set_attn_implementation("sdpa")
    try:
        return _generate(model, ids, None, new_tokens, mask)
    finally:
        slake.prepare_model(model)


@pytest.fixture(scope="module", params=HYBRID)
def hybrid(request):
    return request.param, hybrid_model(request.param)


def test_only_the_full_attention_layers_are_compressed(hybrid):
    name, model = hybrid
    types = model.config.layer_types
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    assert full and sliding, name
    cache = SlakeCache("cake", 40, config=model.config)
    _generate(model, random_ids(96, seed=1), cache, 4)
    stats = cache.statistics()
    assert stats["compressed"] is True
    assert stats["compressed_layers"] == full and stats["sliding_layers"] == sliding
    assert len(stats["kept_tokens_per_layer"]) == len(full)
    assert all(k <= 40 for k in stats["kept_tokens_per_layer"])
    # CAKE's layer budgets are allocated across the compressed layers only and sum to their total
    budgets = torch.tensor(stats["layer_budgets"])
    assert budgets.shape == (1, len(full)) and int(budgets.sum()) == (40 - 32) * len(
        full
    )  # selectable tokens (window excluded)
    kv = stats["kv_bytes"]
    # what the layers' storage holds: after a decode step, the window plus the new token (the step's concatenation)
    held = sum(getattr(cache.layers[i], n).untyped_storage().nbytes() for i in sliding for n in ("keys", "values"))
    assert kv["sliding"] == held > 0
    for i in sliding:  # transformers' own bounded layer: at most the window
        assert type(cache.layers[i]).__name__ == "DynamicSlidingWindowLayer"
        assert cache.layers[i].keys.shape[-2] <= WINDOW


def test_the_layout_reads_both_forms_of_transformers_layer_kwargs(hybrid, monkeypatch):
    # transformers 5.17 (the GPU machines' version, the oldest pyproject allows) returns one dict of cache-layer
    # keyword arguments for every layer; later versions return a list with one dict per layer
    from slake.engines.transformers import layer_layout

    name, model = hybrid
    types, kwargs = layer_layout.get_layer_types_and_kwargs(model.config)
    if isinstance(kwargs, dict):
        shared = kwargs
        listed = [dict(kwargs) if t in layer_layout.BOUNDED_TYPES else {} for t in types]
    else:
        shared = {k: v for kw in kwargs for k, v in kw.items()}
        listed = kwargs
    layouts = []
    for form in (shared, listed):
        monkeypatch.setattr(layer_layout, "get_layer_types_and_kwargs", lambda config, form=form: (types, form))
        layouts.append(layer_layout.attention_layout(model.config))
    assert layouts[0] == layouts[1], name
    assert layouts[0].bounded and all(kw == {"sliding_window": WINDOW} for _, kw in layouts[0].bounded.values())


def test_budget_at_prompt_length_equals_plain_transformers(hybrid):
    name, model = hybrid
    ids = random_ids(48, seed=2)  # 3x the window: the sliding layers really slide
    ref = _reference(model, ids, 12)
    for method in METHODS:
        out = _generate(model, ids, SlakeCache(method, 48, config=model.config), 12)
        assert torch.equal(out.sequences, ref.sequences), f"{name}/{method}: tokens differ"
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{name}/{method} decode logits")


def test_compression_changes_decoding(hybrid):
    """The budget really bites on the full layers (a test that cannot fail is no test)."""
    name, model = hybrid
    ids = random_ids(120, seed=3)
    ref = _reference(model, ids, 4)
    out = _generate(model, ids, SlakeCache("snapkv", 40, config=model.config), 4)
    assert not torch.allclose(out.logits[1], ref.logits[1], atol=1e-4), name


@pytest.mark.parametrize("method", ["snapkv", "cake", "slake"])
def test_padded_batch_equals_each_prompt_alone(hybrid, method):
    name, model = hybrid
    a, b = random_ids(96, seed=4)[0], random_ids(80, seed=5)[0]
    ids = torch.zeros(2, 96, dtype=torch.long)
    mask = torch.zeros(2, 96, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 16:], mask[1, 16:] = b, 1
    batch = _generate(model, ids, SlakeCache(method, 40, config=model.config), 6, mask)
    for row, single in ((0, a), (1, b)):
        alone = _generate(model, single[None], SlakeCache(method, 40, config=model.config), 6)
        assert torch.equal(batch.sequences[row, -6:], alone.sequences[0, -6:]), f"{name}/{method} row {row}"


@pytest.mark.parametrize("method", ["snapkv", "cake", "slake"])
def test_prefill_once_replay_equals_live_compression(hybrid, method):
    """The evaluation's prefill-once path records the sliding layers too and rebuilds them exactly."""
    name, model = hybrid
    ids = random_ids(96, seed=6)
    live = _generate(model, ids, SlakeCache(method, 40, config=model.config), 6)
    capture = capture_prefill(model, ids)
    cache = capture.replay(method, 40)
    tokens = greedy_decode(model, capture, cache, 6)
    assert tokens[0] == live.sequences[0, -6:].tolist(), f"{name}/{method}"
    # stacked captures of different lengths replay into a padded batch with the same tokens
    other = random_ids(72, seed=7)
    stacked = stack_captures([capture_prefill(model, ids), capture_prefill(model, other)])
    batch = greedy_decode(model, stacked, stacked.replay(method, 40), 6)
    single = capture_prefill(model, other)
    alone = greedy_decode(model, single, single.replay(method, 40), 6)
    assert batch[0] == tokens[0] and batch[1] == alone[0], f"{name}/{method} stacked"


@pytest.mark.parametrize("name", ALL_SLIDING)
def test_all_sliding_models_compress_within_the_window_and_refuse_beyond_it(name):
    """No full layer to compress: within the window a sliding layer is a full layer (equivalence holds); a longer
    sequence is refused in one line rather than silently attending beyond the window."""
    model = hybrid_model(name)
    ids = random_ids(12, seed=8)
    ref = _reference(model, ids, 3)
    for method in ("full", "snapkv", "cake", "slake"):
        out = _generate(model, ids, SlakeCache(method, 40, config=model.config), 3)
        assert torch.equal(out.sequences, ref.sequences), f"{name}/{method}"
    with pytest.raises(ValueError, match="sliding-window attention .* slake compresses full-attention layers only"):
        _generate(model, random_ids(64, seed=9), SlakeCache("snapkv", 40, config=model.config), 2)


@pytest.mark.parametrize("name", REFUSED)
def test_models_with_attention_slake_does_not_model_are_refused_naming_the_model(name):
    model = hybrid_model(name, prepare=False)
    with pytest.raises(ValueError, match=type(model).__name__) as err:
        slake.prepare_model(model)
    assert "\n" not in str(err.value)
    assert ("soft-capping" if name == "gemma2" else "attention sinks") in str(err.value)


def test_generate_reports_compressed_and_sliding_bytes(hybrid):
    """``kv_bytes`` counts both kinds of layer: the compressed ones (kept, linear state ...) and the sliding ones
    (``sliding``); ``full`` is what plain transformers would hold (every token of the full layers, the sliding
    layers bounded as they are)."""
    from test_eval_runner import TinyTokenizer

    name, model = hybrid
    prompt = " ".join(f"w{i}" for i in range(150))
    res = slake.generate(
        model, TinyTokenizer(), prompt, method="slake", budget=40, max_new_tokens=4, chat_template=False
    )
    kv = res.kv_bytes
    n_full = sum(t == "full_attention" for t in model.config.layer_types)
    tokens = res.prompt_tokens[0] + res.new_tokens[0] - 1  # the last new token is never fed back into a cache
    per_token = 2 * model.config.num_key_value_heads * 16 * 4  # keys + values, head dim 16, fp32
    assert res.compressed and kv["sliding"] > 0 and kv["linear_state"] > 0
    assert kv["full"] == n_full * per_token * tokens + kv["sliding"], name
    assert len(res.kept_tokens_per_layer) == n_full


def test_the_vllm_plugin_refuses_models_with_sliding_layers():
    """The plugin compresses every layer, so it refuses hybrid and sliding-window models in one line (the
    transformers engine serves them); plain full-attention configs pass."""
    from types import SimpleNamespace

    from slake.engines.vllm.plugin.validate import check_layer_types

    check_layer_types(SimpleNamespace(layer_types=["full_attention"] * 4, sliding_window=None))
    check_layer_types(SimpleNamespace(sliding_window=None))
    for cfg in (
        SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=512),
        SimpleNamespace(sliding_window=4096),
    ):
        with pytest.raises(ValueError, match="full-attention models only"):
            check_layer_types(cfg)


def _padded_pair(long: int, short: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded to the first's length."""
    ids = torch.zeros(2, long, dtype=torch.long)
    mask = torch.zeros(2, long, dtype=torch.long)
    ids[0], mask[0] = random_ids(long, seed=6)[0], 1
    ids[1, long - short :], mask[1, long - short :] = random_ids(short, seed=7)[0], 1
    return ids, mask


@pytest.mark.parametrize("method", ["full", "snapkv", "slake"])
def test_fixed_shape_decoding_of_a_hybrid_model_equals_its_dynamic_decoding(hybrid, method):
    """With ``max_cache_len`` the sliding-window layers are fixed rings (:class:`WindowLayer`): the same tokens and
    logits at every step as transformers' dynamic sliding layers, for a padded batch whose short row has padding
    inside the kept window (40 and 10 tokens, a window of 16), and for a prompt shorter than the window; 20 new
    tokens wrap the ring."""
    from slake.engines.transformers.window_layer import WindowLayer

    name, model = hybrid
    hp = {} if method == "full" else {"window": 4}
    for ids, mask in (_padded_pair(40, 10), (random_ids(12, seed=8), None)):
        new = 20
        dynamic_cache = SlakeCache(method, 24, config=model.config, **hp)
        dynamic = _generate(model, ids, dynamic_cache, new, mask)
        cache = SlakeCache(method, 24, config=model.config, max_cache_len=ids.shape[1] + new, **hp)
        fixed = _generate(model, ids, cache, new, mask)
        assert torch.equal(fixed.sequences, dynamic.sequences), f"{name}/{method}: tokens differ"
        for a, b in zip(fixed.logits, dynamic.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{name}/{method} decode logits")
        rings = [cache.layers[i] for i in cache.layout.bounded]
        assert rings and all(isinstance(r, WindowLayer) and r.window == WINDOW for r in rings)
        assert cache.is_compileable
        # the rings' bytes: their keys and values as `sliding`, each slot's int64 position in `metadata`; the dynamic
        # layers keep window - 1 tokens as a view of the step's concatenation of window tokens, all of it held
        ours, theirs = cache.byte_counts(), dynamic_cache.byte_counts()
        B, H, _, d = rings[0].keys.shape
        slot = 2 * B * H * d * rings[0].keys.element_size()
        assert ours["sliding"] == len(rings) * WINDOW * slot and theirs["sliding"] == len(rings) * WINDOW * slot
        assert ours["metadata"] - cache.compressor.byte_counts()["metadata"] == len(rings) * B * WINDOW * 8


def test_a_fixed_shape_hybrid_cache_at_the_prompts_length_equals_plain_transformers(hybrid):
    name, model = hybrid
    ids = random_ids(48, seed=2)  # 3x the window
    ref = _reference(model, ids, 12)
    out = _generate(model, ids, SlakeCache("full", 48, config=model.config, max_cache_len=60), 12)
    assert torch.equal(out.sequences, ref.sequences), name
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_a_recorded_prefill_replays_into_a_fixed_shape_hybrid_cache(hybrid, method):
    """The evaluation's prefill-once path (and KVzip's second pass) stores the prompt into the sliding layers without
    their attention: the rings' padded slots are marked from the capture's mask. A stacked batch of 96 and 10 tokens
    (86 of padding, 6 of them inside the short row's window) decodes the dynamic replay's tokens."""
    name, model = hybrid
    stacked = stack_captures([capture_prefill(model, random_ids(96, seed=6)), capture_prefill(model, random_ids(10))])
    dynamic = greedy_decode(model, stacked, stacked.replay(method, 40, window=4), 8)
    fixed = stacked.replay_into(SlakeCache(method, 40, config=model.config, max_cache_len=96 + 8, window=4))
    ring = fixed.layers[min(fixed.layout.bounded)]
    assert int((ring.positions[1] >= 0).sum()) == 10 and int((ring.positions[0] >= 0).sum()) == WINDOW
    assert greedy_decode(model, stacked, fixed, 8) == dynamic, f"{name}/{method}"


def test_a_compiled_hybrid_decode_step_is_one_graph(hybrid, fresh_dynamo):
    """``torch.compile(fullgraph=True, dynamic=False)`` over the decode step of a hybrid model: one graph for every
    step, the window full and wrapping (transformers' own static sliding layer makes a graph per step: the window's
    offset is a Python int its mask reads), and the same tokens as the eager dynamic cache."""
    from compiled_decode import decode

    name, model = hybrid
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, _, _ = decode(model, "slake", 6, static=False, kernels="torch")
    compiled, _, cache = decode(model, "slake", 6, backend="aot_eager", kernels="torch")
    assert torch.equal(compiled, eager), name
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert all(int(cache.layers[i].counter) == 40 + 6 for i in cache.layout.bounded)


def test_what_a_fixed_shape_hybrid_cache_does_not_take_is_refused(hybrid, monkeypatch):
    """A chunked prefill (the ring takes the prompt once) and several tokens after the prompt; chunked-attention
    layers (Llama 4's) have no ring."""
    from slake.engines.transformers.layer_layout import AttentionLayout

    name, model = hybrid
    with pytest.raises(ValueError, match="takes its prompt in one prefill"):
        SlakeCache("snapkv", 40, config=model.config, max_cache_len=128, prefill_chunk=32)
    cache = SlakeCache("snapkv", 24, config=model.config, max_cache_len=128, window=4)
    ring = cache.layers[min(cache.layout.bounded)]
    ring.update(torch.zeros(1, 2, 30, 16), torch.zeros(1, 2, 30, 16))
    with pytest.raises(ValueError, match="one token per step"):
        ring.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    kinds = ["chunked_attention", "full_attention"] * 2
    chunked = AttentionLayout(kinds, [1, 3], {0: ("chunked_attention", {}), 2: ("chunked_attention", {})})
    import slake.engines.transformers.cache as cache_module

    monkeypatch.setattr(cache_module, "attention_layout", lambda config: chunked)
    with pytest.raises(ValueError, match=r"chunked-attention layers \(layers \[0, 2\]\)"):
        SlakeCache("snapkv", 40, config=model.config, max_cache_len=128)
