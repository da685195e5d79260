"""Fixes from the 2026-11-30 (thirty-fourth) audit of ``slake bench``.

A compiled row timed sequentially (on CUDA every compiled length is) had no ``decode_vs_eager``, which the docs
promised; ``--isolate`` children interleaved their eager and compiled rows whatever ``--decode-timing`` said;
transformers' own cache was counted by its tensors' views, not the storage a sliding layer holds; and an eager
cache grew room for warm-up steps it never ran (``--warmup 0`` still reserved two).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from slake.engines.base import BenchPlan, ModelSpec
from slake.engines.transformers import bench
from slake.engines.transformers import measure as M
from slake.engines.transformers.shapes import random_model


def test_a_sequential_compiled_row_is_paired_with_its_eager_twin():
    eager = {"method": "snapkv", "budget": 32, "decode_ms_per_token": 10.0, "compile": False}
    compiled = {"method": "snapkv", "budget": 32, "decode_ms_per_token": 4.0, "compile": True}
    other = {"method": "cake", "budget": 32, "decode_ms_per_token": 3.0, "compile": True}
    rows = [eager, compiled, other]
    for row in rows:
        bench._pair_sequential(row, rows)
    assert compiled["decode_vs_eager"] == 0.4
    assert "decode_vs_eager" not in eager and "decode_vs_eager" not in other  # no twin: nothing
    interleaved = {**compiled, "decode_vs_eager": 0.37}
    bench._pair_sequential(interleaved, [eager, interleaved])
    assert interleaved["decode_vs_eager"] == 0.37  # the interleaved ratio is kept


def test_isolated_children_time_sequentially(monkeypatch, tmp_path):
    seen = {}

    def run(argv, **kwargs):
        seen["argv"] = argv
        row = {"method": "snapkv", "length": 64, "kv_dtype": None}
        rows = [{**row, "compile": False}, {**row, "compile": True}]
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps({"rows": rows}) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", run)
    plan = BenchPlan(methods=("snapkv",), budgets=(32,), lengths=(64,), out=Path(tmp_path), isolate=True, compile=True)
    cfg = M.BenchConfig("snapkv", 32, 64)
    bench._isolated(ModelSpec(random="tiny"), plan, cfg)
    argv = seen["argv"]
    assert argv[argv.index("--decode-timing") + 1] == "sequential"


def test_transformers_own_cache_is_counted_by_the_storage_it_holds():
    torch.manual_seed(0)
    model = random_model("tiny-hybrid")
    cfg = M.BenchConfig("transformers", 32, 128, decode_steps=3, warmup=1)
    cache = M._new_cache(model, cfg)
    ids = M._prompt(model, cfg)
    tok = M._prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)
    with torch.inference_mode():
        for _ in range(4):
            tok = M._step(model, cache, tok)
    stats = M._statistics(cache)
    storage = {
        sliding: sum(
            t.untyped_storage().nbytes()
            for layer in cache.layers
            if bool(getattr(layer, "is_sliding", False)) == sliding
            for t in (layer.keys, layer.values)
        )
        for sliding in (False, True)
    }
    assert stats["kv_bytes"] == {"kept": storage[False], "sliding": storage[True]}


def test_an_eager_cache_holds_no_room_for_warm_up_steps_it_does_not_run():
    model = random_model("tiny")
    row = M.measure(model, M.BenchConfig("full", 32, 64, decode_steps=3, warmup=0))
    assert row["kept_tokens_mean"] == 64 + 3
    assert row["kv_bytes_detail"]["slack"] == 0  # before: room for two more tokens
