"""What a cache reports holding against what it holds (audit of 2026-11-29; each test failed before its fix).

* KVzip's second-pass scores, ``(L, B, Hkv, S)`` float32, stayed referenced by the cache for the whole generation and
  were counted nowhere: 4 bytes per prompt token, layer and KV head.
* In a padded batch, a prompt within the budget reported per-layer budgets (``[22, 22, 22]`` for CAKE) although it
  kept everything, breaking "budgets + windows = budget x layers".
* The per-sequence bytes of such a prompt (``slake eval``'s rows) included a share of the batch's SLAKE linear
  state and of the per-slot metadata the compressed rows need, where a batch-1 run of it holds none.
* A multi-token eviction's row buffers (two ``(B, Hkv, e, d + 1)`` float32) stayed on the linear state, uncounted
  (now freed after the fold; a decode step's two single rows are reused workspace).
* ``slake generate`` did not say that its kept entries were 8-bit (``--kv-dtype``).
"""

from __future__ import annotations

import torch

import slake
from slake.attention.linear_state import LinearState
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import prefill_for_generate, random_ids, tiny_model, word_tokenizer


def _padded_batch(n: int = 100, short: int = 30, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(n, batch=2, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, : n - short] = 0
    return ids, mask


def _prefill(method: str, budget: int, ids: torch.Tensor, mask: torch.Tensor, layers: int = 2, **kw) -> SlakeCache:
    model = tiny_model("llama-gqa", layers=layers)
    cache = SlakeCache(method, budget, config=model.config, **kw)
    with torch.inference_mode():
        model(ids, attention_mask=mask, **with_cache(model, cache), use_cache=True)
    return cache


def test_kvzip_drops_its_second_pass_scores_after_the_prefill():
    model = tiny_model("llama-gqa", layers=2)
    ids = random_ids(300)
    cache = SlakeCache("kvzip", 32, config=model.config)
    prefill_for_generate(model, cache, ids)
    assert cache.compressor.info is not None and bool(cache.compressor.info.compress.all())
    assert cache.compressor.pass_scores is None  # before: (2, 1, 2, 299) float32 held for the whole generation


def test_a_prompt_within_the_budget_reports_no_layer_budgets_in_a_padded_batch():
    ids, mask = _padded_batch()
    for method in ("snapkv", "pyramidkv", "cake"):
        stats = _prefill(method, 48, ids, mask, layers=3, window=8).statistics()
        budgets = stats["layer_budgets"]
        assert budgets[1] is None, (method, budgets)  # before: [40, 40, 40] / [22, 22, 22]
        assert len(budgets[0]) == 3 and sum(budgets[0]) + 3 * 8 == 48 * 3, (method, budgets)


def test_the_bytes_of_a_prompt_within_the_budget_are_those_of_a_batch_1_run_of_it():
    ids, mask = _padded_batch(short=25, seed=7)
    for method in ("slake", "sagekv", "criticalkv", "snapkv"):
        batch = _prefill(method, 40, ids, mask)
        alone = _prefill(method, 40, ids[1:, 75:], torch.ones_like(ids[1:, 75:]))
        assert not bool(batch.compressor.info.compress[1])
        assert batch.byte_counts(1) == alone.byte_counts(), method  # before: slake's linear state, sagekv's masks
        compressed_alone = _prefill(method, 40, ids[:1], torch.ones_like(ids[:1]))
        assert batch.byte_counts(0) == compressed_alone.byte_counts(), method  # unchanged for compressed rows


def test_a_large_folds_row_buffers_are_not_kept():
    B, H, d, n = 1, 2, 8, 40
    state = LinearState.empty(B, H, d, "cpu")
    keys, values = torch.randn(B, H, n, d), torch.randn(B, H, n, d)
    base = state.nbytes()
    many = torch.arange(30).view(1, 1, 30).expand(B, H, 30)
    state.fold_slots(keys, values, many, torch.ones_like(many, dtype=torch.bool))
    assert state._row_buffers is None  # before: 2 x (1, 2, 30, 9) float32 held after the fold, uncounted
    one = torch.full((B, H, 1), 35)
    state.fold_slots(keys, values, one, torch.ones_like(one, dtype=torch.bool))
    assert state._row_buffers is not None and state._row_buffers[0].shape == (B, H, 1, d + 1)  # a step's, reused
    assert state.nbytes() == base  # workspace, not state: eager and compiled steps report the same bytes


def test_generate_records_8_bit_kept_entries():
    model = tiny_model("llama-gqa", layers=2)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(80))
    kw = dict(method="snapkv", budget=24, window=8, max_new_tokens=2, chat_template=False)
    res = slake.generate(model, word_tokenizer(), prompt, kv_dtype="int8", **kw)
    assert res.extra["kv_dtype"] == "int8" and res.to_dict()["extra"]["kv_dtype"] == "int8"
    assert "kv_dtype" not in slake.generate(model, word_tokenizer(), prompt, **kw).extra


def test_slake_generate_prints_the_8_bit_storage(capsys, monkeypatch):
    import slake.engines.transformers.models as models
    from slake.cli import main

    model, tok = tiny_model("llama-gqa", layers=2), word_tokenizer()
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, tok))

    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(80))
    args = ["generate", "--method", "snapkv[window=8]", "--budget", "24", "--kv-dtype", "int8", "--max-new-tokens", "2"]
    assert main([*args, "--no-chat-template", "--prompt", prompt]) == 0
    assert "method snapkv  budget 24  kv int8  prompt" in capsys.readouterr().out
