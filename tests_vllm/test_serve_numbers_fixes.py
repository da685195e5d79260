"""Fixes of the numbers the vLLM drivers report (audit of the serving path, findings 1, 3 and 7).

* A batch run reads back a record of every compressed request, however many (the worker's run log kept the last
  256 only, and the driver reported the others as uncompressed with the full cache's bytes); ``compressed`` is the
  configuration's decision, and a compressed request without a record is an error.
* Every engine gets its own KV-cache size (vLLM's ``kv_cache_memory_bytes``): the benchmark's rule for each length,
  ``run_vllm(kv_cache_gib=...)`` for each call, whatever the process-wide ``VLLM_CPU_KVCACHE_SPACE`` says.
* ``slake bench --serve``'s server logs the plugin's INFO start-up line whatever vLLM log level the caller's
  environment sets.

Engines are stubbed (``vllm.LLM`` replaced) where only their arguments matter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import BUDGET
from slake.engines.vllm.runner import run_vllm

BLOCK = 32
GIB = 2**30
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------------------------
# 1. run records


def test_every_compressed_prompt_of_a_run_gets_its_record(tiny_dir, monkeypatch):
    """More compressed prompts than the worker's default run log holds (lowered to 2 here, 256 in the plugin): every
    one is reported compressed, with the budget's kept tokens, not the full cache."""
    from slake.engines.vllm.plugin.state import PluginState

    monkeypatch.setattr(PluginState, "run_log_max", 2)
    prompts = _prompts([100] * 5 + [40])
    run = run_vllm(
        tiny_dir,
        prompts,
        slake={"method": "snapkv", "budget": BUDGET},
        max_new_tokens=3,
        ignore_eos=True,
        block_size=BLOCK,
        max_model_len=256,
    )
    assert run.compressed == [True] * 5 + [False]
    for i in range(5):
        assert run.kept_tokens_per_layer[i] == [float(BUDGET)] * 3, i
        kv = run.kv_bytes[i]
        assert kv["kept"] < kv["full"] and kv["metadata"] > 0, (i, kv)
        assert kv["kept"] + kv["padding"] == kv["blocks_held"], (i, kv)
        assert run.blocks_end[i] == math.ceil((BUDGET + 1) / BLOCK)
    assert run.kept_tokens_per_layer[5] == [float(40 + 3 - 1)] * 3
    assert run.kv_bytes[5]["kept"] == run.kv_bytes[5]["full"]


def test_a_compressed_request_without_a_record_is_an_error(tiny_dir, monkeypatch):
    """When the worker returns no record of a request the configuration compresses, the run fails in one ``slake:``
    line instead of reporting the request as uncompressed with the full cache's bytes."""
    from slake.engines.vllm.plugin import worker

    original = worker.report

    def report_without_runs(w):
        out = original(w)
        if out is not None:
            out["runs"] = []
        return out

    monkeypatch.setattr(worker, "report", report_without_runs)
    with pytest.raises(RuntimeError, match=r"slake: request .* was compressed, but the plugin returned no record"):
        run_vllm(
            tiny_dir,
            _prompts([100, 40]),
            slake={"method": "snapkv", "budget": BUDGET},
            max_new_tokens=2,
            ignore_eos=True,
            block_size=BLOCK,
            max_model_len=256,
        )


# ---------------------------------------------------------------------------------------------------------------
# 3. KV-cache size per engine


class _Stop(Exception):
    pass


@pytest.fixture
def stub_llm(monkeypatch):
    """``vllm.LLM`` replaced: each engine records ``(kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE while built)``
    and stops the driver."""
    import vllm

    seen: list[tuple[int | None, str | None]] = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append((kw.get("kv_cache_memory_bytes"), os.environ.get(KV_SPACE_ENV)))
            raise _Stop

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    return seen


def test_bench_sizes_every_lengths_engine_by_its_rule(tiny_dir, stub_llm, monkeypatch):
    """``step_times`` and ``bench`` at 1024 then 8192 tokens in one process (SmolLM2-135M's KV bytes per token):
    each engine gets the size its rule asks for (the second used to get the first one's, through the process-wide
    variable), and the variable is left as it was."""
    from slake.engines.vllm import bench as B

    monkeypatch.delenv(KV_SPACE_ENV, raising=False)
    per_token = 2 * 30 * 3 * 64 * 4
    monkeypatch.setattr(B, "_kv_bytes_per_token", lambda model_dir, dtype: per_token)
    steps, total = 24, B.step_new_tokens(24, 2)
    for n in (1024, 8192):
        with pytest.raises(_Stop):
            B.step_times(tiny_dir, [[5] * n] * 8, [[5] * n] * 2, slake=None, decode_steps=steps)
        want = max(1, math.ceil(1.5 * 10 * (n + total) * per_token / GIB)) * GIB
        assert stub_llm[-1] == (want, None), n
        with pytest.raises(_Stop):
            B.bench(tiny_dir, requests=8, prompt_len=n, decode_steps=4, methods=[], budget=BUDGET)
        want = max(1, math.ceil(1.5 * 8 * (n + 1 + 4) * per_token / GIB)) * GIB
        assert stub_llm[-1] == (want, None), n
    assert [b for b, _ in stub_llm] == [GIB, GIB, 6 * GIB, 5 * GIB]
    assert KV_SPACE_ENV not in os.environ


def test_run_vllm_kv_cache_gib_takes_effect_for_every_engine(tiny_dir, stub_llm, monkeypatch):
    """``run_vllm(kv_cache_gib=...)`` sizes each engine of the process (it used to ``setdefault`` the variable, so
    only the first call's size, or the variable's, counted); without it, the variable (or 1 GiB) applies; the
    variable, which vLLM's CPU platform would let override the engine's size, is hidden while an engine is built
    and put back after."""
    monkeypatch.setenv(KV_SPACE_ENV, "1")
    for gib in (2, 3, None):
        with pytest.raises(_Stop):
            run_vllm(tiny_dir, [[5] * 10], slake=None, max_new_tokens=1, kv_cache_gib=gib)
    monkeypatch.setenv(KV_SPACE_ENV, "5")
    with pytest.raises(_Stop):
        run_vllm(tiny_dir, [[5] * 10], slake=None, max_new_tokens=1)
    monkeypatch.delenv(KV_SPACE_ENV)
    with pytest.raises(_Stop):
        run_vllm(tiny_dir, [[5] * 10], slake=None, max_new_tokens=1)
    assert stub_llm == [(2 * GIB, None), (3 * GIB, None), (GIB, None), (5 * GIB, None), (GIB, None)]
    assert KV_SPACE_ENV not in os.environ


def test_an_engine_gets_its_kv_size_despite_the_variable(tiny_dir, monkeypatch):
    """A real engine: 100 blocks' worth of ``kv_cache_memory_bytes`` gives 100 blocks although
    ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB) is set in the process."""
    from slake.engines.vllm.runner import engine_kwargs, new_llm

    monkeypatch.setenv(KV_SPACE_ENV, "1")
    block_bytes = BLOCK * 3 * 2 * 2 * 32 * 4  # tokens x layers x (K, V) x KV heads x head dim x fp32
    llm = new_llm(
        engine_kwargs(
            tiny_dir,
            slake=None,
            block_size=BLOCK,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=2,
            kv_cache_bytes=100 * block_bytes,
        )
    )
    try:
        assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 100
    finally:
        del llm
    assert os.environ[KV_SPACE_ENV] == "1"


# ---------------------------------------------------------------------------------------------------------------
# 7. the server's log level


def test_server_env_keeps_vllms_info_lines():
    """A caller's ``VLLM_LOGGING_LEVEL=WARNING`` (or disabled logging configuration, or a custom one) would hide the
    plugin's INFO start-up line, by which ``slake bench --serve`` knows that the plugin runs."""
    from slake.engines.vllm.serve.server import server_env

    quiet = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CONFIGURE_LOGGING": "0", "VLLM_LOGGING_CONFIG_PATH": "/x.json"}
    assert server_env({**quiet, "A": "1"}) == {"A": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    assert server_env({"VLLM_LOGGING_LEVEL": "debug"})["VLLM_LOGGING_LEVEL"] == "debug"
    assert server_env({"A": "1"}) == {"A": "1"}


def test_the_plugins_start_up_line_reaches_a_quiet_callers_server_log():
    """vLLM's logging in a process started with ``server_env`` of a quiet caller's environment, configured as the
    server configures it (``LoggingConfig`` from the environment): the plugin's logger (under ``vllm.plugins``)
    writes its INFO start-up line."""
    from slake.engines.vllm.serve.server import PLUGIN_LOG_LINE, server_env

    env = server_env({**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CONFIGURE_LOGGING": "0"})
    code = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging_if_needed, init_logger\n"
        "configure_logging_if_needed(LoggingConfig())\n"
        "init_logger('vllm.plugins.slake.engines.vllm.plugin.backend').info("
        f"{PLUGIN_LOG_LINE + ' snapkv@64'!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert PLUGIN_LOG_LINE in out.stdout + out.stderr
