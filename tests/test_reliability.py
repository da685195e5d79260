"""Reliability (issue 14): no silent wrong answers, no lost rows, every bad input a clear error before the slow part.

The table :data:`BAD_INPUTS` is the list of documented bad inputs of every command: each exits with code 2 and one
line on stderr naming the problem, prints nothing on stdout, loads no model and writes nothing. The API misuse cases
below give a clear exception.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from transformers import DynamicCache

import slake
from slake import SlakeCache
from slake.cli import main
from slake.eval.results import ResultsWriter, read_results, scan_results
from slake.eval.summary import write_summary

from tiny_models import random_ids, tiny_model

CUDA = torch.cuda.is_available()


# ====================================================================== SlakeCache misuse (items 1 and 2)
def _gen(model, ids, cache, n=4):
    return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("new_len", [40, 62, 63])
def test_reusing_a_cache_for_a_new_prompt_raises(llama_gqa, new_len):
    """A cache holding 63 tokens (60 prompt + 3 fed back) refuses an unrelated prompt that is not longer than it,
    instead of answering from the first prompt."""
    cache = SlakeCache("snapkv", 48, config=llama_gqa.config)
    _gen(llama_gqa, random_ids(60, seed=1), cache)
    assert cache.get_seq_length() == 63
    with pytest.raises(ValueError, match="already holds 63 tokens of an earlier prompt"):
        _gen(llama_gqa, random_ids(new_len, seed=2), cache)


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_multi_turn_continuation_equals_the_full_cache(llama_gqa, method):
    """Two turns on one SlakeCache (the second passes the whole conversation) give the same tokens as transformers'
    own cache when nothing is evicted."""
    turn1 = random_ids(40, seed=3)
    follow = random_ids(12, seed=4)

    def run(cache_factory):
        cache = cache_factory()
        first = _gen(llama_gqa, turn1, cache, 5)
        second = _gen(llama_gqa, torch.cat([first, follow], 1), cache, 6)
        return first, second

    ours = run(lambda: SlakeCache(method, 4096, config=llama_gqa.config))
    llama_gqa.set_attn_implementation("sdpa")
    try:
        ref = run(DynamicCache)
    finally:
        slake.prepare_model(llama_gqa)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.mark.parametrize("layers", [2, 4, 40])
def test_num_layers_that_do_not_match_the_model_raise_before_any_work(llama_gqa, layers):
    cache = SlakeCache("slake", 48, layers)
    with pytest.raises(ValueError, match=f"built for {layers} layers but the model has 3"):
        _gen(llama_gqa, random_ids(60, seed=1), cache)
    assert cache.get_seq_length() == 0


def test_cache_takes_the_model_config(llama_gqa):
    assert len(SlakeCache("cake", 48, config=llama_gqa.config).layers) == 3
    assert len(SlakeCache("cake", 48, llama_gqa.config).layers) == 3  # positional, as DynamicCache(config)
    assert len(SlakeCache("cake", 48, 3, config=llama_gqa.config).layers) == 3
    with pytest.raises(ValueError, match="disagrees with the config"):
        SlakeCache("cake", 48, 4, config=llama_gqa.config)
    with pytest.raises(ValueError, match="needs the model's config"):
        SlakeCache("cake", 48)
    with pytest.raises(ValueError, match="positive integer"):
        SlakeCache("cake", 48, 0)


def test_unprepared_layer_index_and_unfilled_layers_are_clear_errors():
    """Without the forward check (a direct cache call), a layer the cache lacks and layers the model never filled
    still give a clear error, not an IndexError or silent phantom layers."""
    cache = SlakeCache("full", 48, 2)
    k = torch.zeros(1, 2, 5, 16)
    with pytest.raises(ValueError, match="updated layer 2, but this SlakeCache was built for 2 layers"):
        cache.update(k, k, 2)
    cache = SlakeCache("snapkv", 48, 4)
    cache.engine.prefill_layer(0, torch.zeros(1, 4, 5, 16), k, k, None, 0.25)
    with pytest.raises(ValueError, match="the model filled 1 layers but this SlakeCache was built for 4"):
        cache.statistics()


# ====================================================================== honest statistics (item 7)
def test_kv_bytes_separate_growth_slack_from_padding_and_no_linear_state_without_eviction(llama_gqa):
    ids = random_ids(43, seed=5)
    cache = SlakeCache("slake", 128, config=llama_gqa.config)  # 43 tokens fit: nothing is evicted
    _gen(llama_gqa, ids, cache, 3)
    kv = cache.statistics()["kv_bytes"]
    assert cache.statistics()["compressed"] is False
    assert kv["padding"] == 0 and kv["linear_state"] == 0
    per_token = 2 * 16 * 4 * 2 * 3  # K+V, d=16, fp32, 2 KV heads, 3 layers
    assert kv["kept"] == 45 * per_token
    assert kv["slack"] > 0  # room allocated for later decode tokens, reported as such


def test_kv_bytes_padding_counts_uneven_heads_only(llama_gqa):
    ids = random_ids(120, seed=6)
    cache = SlakeCache("ada-snapkv", 48, config=llama_gqa.config)
    _gen(llama_gqa, ids, cache, 3)
    eng = cache.engine
    kv = cache.statistics()["kv_bytes"]
    per_slot = 2 * 16 * 4
    expected_padding = sum(int((s.counts().max() - s.counts()).sum()) for s in eng.layers) * per_slot
    expected_slack = sum(s.valid.shape[0] * s.valid.shape[1] * (s.capacity - int(s.counts().max()))
                         for s in eng.layers) * per_slot
    assert kv["padding"] == expected_padding > 0
    assert kv["slack"] == expected_slack


def test_linear_state_is_allocated_when_something_is_evicted(llama_gqa):
    cache = SlakeCache("slake", 48, config=llama_gqa.config)
    _gen(llama_gqa, random_ids(120, seed=7), cache, 3)
    kv = cache.statistics()["kv_bytes"]
    assert kv["linear_state"] == 3 * 2 * (16 * 16 + 2 * 16 + 1) * 4


# ====================================================================== the results reader (item 3)
ROW = {"suite": "needle", "task": "needle", "sample_id": "a", "model": "m", "method": "full", "budget": None,
       "length": 64, "score": 1.0}


def _row(**kw):
    return json.dumps({**ROW, **kw})


def test_rows_with_missing_fields_are_skipped_and_reported_not_crashing_the_summary(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [_row(), json.dumps({k: v for k, v in ROW.items() if k != "length"}), "[1, 2]", "not json",
             _row(sample_id="b", score="high"), _row(sample_id="c")]
    path.write_text("\n".join(lines) + "\n")
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a", "c"]
    assert [n for n, _ in scan.skipped] == [2, 3, 4, 5]
    assert "missing length" in scan.skipped[0][1]
    note = scan.describe_skipped()
    assert note.startswith("skipped 4 lines of results.jsonl") and "line 2 (missing length)" in note
    md, _ = write_summary(tmp_path)  # used to raise KeyError: 'length'
    assert "needle" in md.read_text()
    with ResultsWriter(tmp_path) as store:
        assert not store.write(ROW)
    assert path.read_text().splitlines() == lines  # nothing deleted


def test_complete_last_row_without_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + _row(sample_id="b"))
    with ResultsWriter(tmp_path) as store:
        assert not store.write({**ROW, "sample_id": "b"})  # already done: not recomputed
        assert store.write({**ROW, "sample_id": "c"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b", "c"]


def test_partial_last_line_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + _row(sample_id="b")[:-9])
    with ResultsWriter(tmp_path) as store:
        assert store.write({**ROW, "sample_id": "b"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b"]
    assert scan_results(tmp_path).skipped == []


def test_non_utf8_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(_row().encode() + b"\n" + b'{"task": "caf\xe9"}\n' + _row(sample_id="b").encode() + b"\n")
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a", "b"]
    assert scan.skipped == [(2, "not UTF-8")]
    with ResultsWriter(tmp_path) as store:
        assert store.done and store.write({**ROW, "sample_id": "c"})
    assert len(read_results(tmp_path)) == 3
