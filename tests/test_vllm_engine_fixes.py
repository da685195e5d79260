"""Fixes of the vLLM engine's drivers that need no vLLM (``tests_vllm/test_vllm_fixes.py`` runs them in vLLM): plain
runs state plain vLLM whatever ``SLAKE_VLLM`` holds, the offline benchmark refuses lengths beyond the model's context
before anything starts and times only the decode steps after its warm-up, ``--threads`` is refused and
``--linear-cache`` reaches the plugin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slake.budgets.budget import Budget
from slake.engines.base import BenchPlan
from slake.engines.vllm.bench import run_bench
from slake.engines.vllm.engine import VllmEngine
from slake.engines.vllm.plugin.config import ENV_VAR, parse_config
from slake.engines.vllm.runner import engine_kwargs
from slake.methods import make_method

ENV_CONFIG = '{"method": "streamingllm", "budget": 32}'


def _additional_config(slake: dict | None) -> dict:
    return engine_kwargs("model", slake=slake, block_size=32, dtype="float32", max_model_len=512)["additional_config"]


def test_plain_runs_state_plain_vllm_whatever_the_environment_holds(monkeypatch):
    """``engine_kwargs`` gave plain runs ``additional_config={}``, and the plugin then read ``SLAKE_VLLM``: the
    full-cache rows of ``slake eval/bench/generate --engine vllm`` were compressed with the variable's method."""
    monkeypatch.setenv(ENV_VAR, ENV_CONFIG)
    assert parse_config(_additional_config(None)) is None
    cfg = parse_config(_additional_config({"method": "snapkv", "budget": 64}))
    assert cfg is not None and cfg.method.name == "snapkv" and cfg.budget == 64
    # `vllm serve` without a "slake" key keeps the variable's documented behaviour
    env = parse_config({})
    assert env is not None and env.method.name == "streamingllm" and env.budget == 32
    assert parse_config({"slake": None}) is None and parse_config({"slake": False}) is None


def _model_dir(folder: Path, context: int, vocab: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": context, "vocab_size": vocab}))
    return str(folder)


@pytest.mark.parametrize("method", ["slake", "cake"])
def test_a_window_over_the_budget_is_refused_naming_the_budget(method):
    """CAKE/SLAKE at budget 16 with their window of 32: refused as the transformers engine refuses it, naming the
    budget given. It was refused naming vLLM's layer cap (``max_layer_budget must exceed ... (32), got 32``), a
    hyperparameter the user never set."""
    with pytest.raises(ValueError) as exc:
        parse_config(_additional_config({"method": method, "budget": 16}))
    msg = str(exc.value)
    assert msg.startswith("slake:") and "exceed the budget 16" in msg and "max_layer_budget" not in msg, msg


def test_bench_refuses_lengths_beyond_the_context_before_anything_starts(tmp_path):
    """The default lengths end at 8192, the default model's context: vLLM refused ``max_model_len`` 8246 with a
    multi-line validation error after some rows were written, and no table."""
    model = _model_dir(tmp_path / "model", 8192, 49152)
    plan = BenchPlan(methods=("full", "snapkv"), budgets=(Budget(128),), lengths=(1024, 8192), out=tmp_path / "out")
    with pytest.raises(ValueError) as exc:
        run_bench(plan, model, "float32", "smollm2")
    message = str(exc.value)
    assert "\n" not in message and "--lengths 8192" in message and "context of 8192 tokens" in message
    assert not (tmp_path / "out" / "bench_vllm.jsonl").exists()
    from slake.engines.vllm.bench import check_lengths, step_new_tokens

    new = max(1 + plan.warmup + plan.decode_steps, step_new_tokens(plan.decode_steps, 2))
    check_lengths(BenchPlan(methods=("full",), budgets=(Budget(128),), lengths=(8192 - new,), out=tmp_path), 8192)


def test_bench_prompts_stay_inside_a_small_vocabulary(tmp_path):
    from slake.engines.vllm.bench import token_range

    assert token_range(_model_dir(tmp_path, 4096, 512)) == 512
    assert token_range(_model_dir(tmp_path, 4096, 49152)) == 1000


def test_only_the_decode_steps_after_the_warm_up_are_timed():
    """Two requests, prefilled in one step: 2 warm-up steps, then 3 timed ones (the prefill and the warm-up are
    left out; a step in which not every request decodes, here the last, too)."""
    from slake.engines.vllm.bench import timed_decode_steps

    log = [(9.0, [1, 1]), (5.0, [2, 2]), (5.0, [3, 3]), (1.0, [4, 4]), (2.0, [5, 5]), (3.0, [6, 6]), (7.0, [7, 6])]
    assert timed_decode_steps(log, warmup=2, decode_steps=3) == [1.0, 2.0, 3.0]
    assert timed_decode_steps(log, warmup=2, decode_steps=10) == [1.0, 2.0, 3.0]
    assert timed_decode_steps(log, warmup=0, decode_steps=2) == [5.0, 5.0]


def test_threads_is_refused_with_its_reason(tmp_path):
    plan = BenchPlan(methods=("full",), budgets=(Budget(128),), lengths=(512,), out=tmp_path, threads=4)
    with pytest.raises(ValueError, match=r"does not support --threads \(--threads: vLLM's CPU worker binds"):
        VllmEngine().bench(plan)


def test_linear_cache_reaches_the_plugin(monkeypatch):
    """The plugin honours the linear-state setting (SLAKE with or without it, CAKE with it), so ``--linear-cache``
    is not refused as an option; a method that cannot keep one is refused by the plugin's own check."""
    engine = VllmEngine()
    monkeypatch.setattr(engine, "check_environment", lambda: None)
    engine.check(linear_cache=True)
    engine.check_pair(make_method("slake", linear_cache=False), 128)
    engine.check_pair(make_method("cake", linear_cache=True), 128)
    with pytest.raises(ValueError, match="snapkv with linear_cache=true"):
        engine.check_pair(make_method("snapkv", linear_cache=True), 128)
