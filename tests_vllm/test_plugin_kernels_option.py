"""The plugin's ``kernels`` option: the decode step's implementation (``auto``, ``torch``, ``triton``), as the
transformers engine's ``kernels``.

It is checked when the configuration is parsed (an unknown value fails in one line naming the accepted ones),
resolved when the engine starts (``triton`` on this CPU only through Triton's interpreter), passed to the decode
pool, and what ran is in the engine's report (``PluginState.report``: ``kernels_asked``, ``kernels``,
``kernel_steps``, ``kernel_fallbacks``) and in ``slake bench --engine vllm``'s rows (``kernels_asked``, ``kernels``,
the transformers engine's field names). ``--kernels`` of ``slake generate``/``bench`` reaches the plugin's
configuration instead of being refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import BUDGET
from slake.budgets.budget import Budget
from slake.engines.vllm.plugin.config import parse_config, plugin_config

#: the tiny model's attention layers (conftest.build_tiny)
LAYERS = 3


def _cfg(**extra):
    return parse_config({"slake": {"method": "snapkv", "budget": BUDGET, **extra}})


def _state(cfg):
    from slake.engines.vllm.plugin.paged import CpuAttnLayout
    from slake.engines.vllm.plugin.state import PluginState

    return PluginState(cfg, num_layers=2, kv_heads=2, head_dim=32, block_size=32, max_rows=2, layout=CpuAttnLayout())


# ---------------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("kernels", ["auto", "torch", "triton"])
def test_the_configuration_takes_kernels(kernels):
    assert _cfg(kernels=kernels).kernels == kernels
    assert _cfg().kernels == "auto" and _cfg(kernels=None).kernels == "auto"


@pytest.mark.parametrize("value", ["cuda", "Triton", "fused", 1, True, ["torch"]])
def test_unknown_kernels_fail_in_one_line_naming_the_accepted_ones(value):
    with pytest.raises(ValueError, match="^slake: ") as exc:
        _cfg(kernels=value)
    msg = str(exc.value)
    assert "kernels" in msg and "auto, torch, triton" in msg and repr(value) in msg and "\n" not in msg


def test_the_environment_variable_takes_kernels(monkeypatch):
    monkeypatch.setenv("SLAKE_VLLM", json.dumps({"method": "h2o", "budget": 128, "kernels": "torch"}))
    assert parse_config({}).kernels == "torch"
    monkeypatch.setenv("SLAKE_VLLM", json.dumps({"method": "h2o", "budget": 128, "kernels": "gpu"}))
    with pytest.raises(ValueError, match="auto, torch, triton"):
        parse_config({})


def test_drivers_write_kernels_into_the_configuration():
    b = Budget(BUDGET)
    assert plugin_config("snapkv", b) == {"method": "snapkv", "budget": BUDGET}  # auto: the plugin's default
    assert plugin_config("snapkv", b, kernels="torch") == {"method": "snapkv", "budget": BUDGET, "kernels": "torch"}
    assert plugin_config("slake", b, kernels="triton", alpha=0.5)["kernels"] == "triton"
    assert plugin_config("full", b, kernels="torch") is None
    with pytest.raises(ValueError, match="auto, torch, triton"):
        plugin_config("snapkv", b, kernels="cuda")


# ---------------------------------------------------------------------------------------------------- the state
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, auto is Triton's kernels")
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_the_state_resolves_kernels_and_the_pool_runs_them(kernels):
    """On vLLM's CPU backend ``auto`` is the torch step; the pool is built with the state's choice."""
    state = _state(_cfg(kernels=kernels))
    assert state.kernels == "torch"
    rep = state.report()
    assert rep["kernels_asked"] == kernels and rep["kernels"] == "torch"  # before any step: the choice
    assert rep["kernel_steps"] == {} and rep["kernel_fallbacks"] == {}
    assert state.decode_pool().kernels == "torch"


def test_the_pool_keeps_why_auto_chose_the_torch_step(monkeypatch):
    """The state checks the choice when the engine starts and hands the pool the choice as asked, so the pool's
    report says why ``auto`` chose torch on a GPU (it was handed the resolved ``torch``, and said nothing). The
    device's kind stands in through a patched choice."""
    from slake.engines.vllm.plugin import decode_pool

    state = _state(_cfg(kernels="auto"))
    monkeypatch.setattr(
        decode_pool, "kernel_choice", lambda k, d: ("torch", "Triton not installed" if k == "auto" else None)
    )
    assert state.decode_pool().report.auto == "Triton not installed"
    assert state.report()["kernels"] == "torch (auto: Triton not installed)"


def test_the_report_carries_the_pools_kernel_report():
    """What the pool's ``KernelReport`` counted (steps per implementation, fallbacks and why) is in the report, and
    ``kernels`` is its summary, as ``statistics()["kernels"]`` of the transformers engine."""
    state = _state(_cfg(kernels="torch"))
    pool = state.decode_pool()
    for _ in range(4):
        pool.report.record("torch")
    rep = state.report()
    assert rep["kernels"] == "torch" and rep["kernel_steps"] == {"torch": 4} and rep["kernel_fallbacks"] == {}
    pool.report.record("torch", "a storage layout the kernels do not address")
    rep = state.report()
    assert rep["kernels"] == "torch (fallback: a storage layout the kernels do not address)"
    assert rep["kernel_fallbacks"] == {"a storage layout the kernels do not address": 1}
    json.dumps(rep)  # plain data: it crosses vLLM's process boundary


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, triton needs no interpreter")
def test_triton_without_the_interpreter_fails_when_the_engine_starts(monkeypatch):
    """``triton`` on this CPU needs Triton's interpreter, switched on before Triton is imported (vLLM imports it):
    the state refuses it at start, in one line, rather than at the first compressed request."""
    pytest.importorskip("triton.language")  # imported, as vLLM's import does: too late to switch the interpreter on
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = _cfg(kernels="triton")  # the name is valid: parsing accepts it
    with pytest.raises(ValueError, match="^slake: ") as exc:
        _state(cfg)
    assert "TRITON_INTERPRET=1" in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------------------------- engines
def test_an_engine_reports_which_step_ran(tiny_dir, prompts):
    """vLLM with the plugin and no ``kernels``: ``auto``, the torch step on this CPU, one layer-step per layer and
    decode step (the two requests decode together), no fallback."""
    from slake.engines.vllm.runner import run_vllm

    new = 4
    run = run_vllm(
        tiny_dir, [prompts[0], prompts[3]], slake={"method": "snapkv", "budget": BUDGET}, max_new_tokens=new,
        ignore_eos=True, max_model_len=512,
    )  # fmt: skip
    rep = run.plugin
    assert rep["kernels_asked"] == "auto" and rep["kernels"] == "torch"
    assert rep["kernel_steps"] == {"torch": LAYERS * (new - 1)} and rep["kernel_fallbacks"] == {}


#: run in a fresh process with TRITON_INTERPRET=1 (it must be set before vLLM imports Triton): the same requests
#: with kernels torch and triton
_BOTH = """
import json, sys
from slake.engines.vllm.runner import run_vllm
out = {}
for k in ("torch", "triton"):
    run = run_vllm(sys.argv[1], json.loads(sys.argv[2]), slake={"method": sys.argv[3], "budget": int(sys.argv[4]),
                   "kernels": k}, max_new_tokens=5, ignore_eos=True, max_model_len=512)
    out[k] = {"tokens": run.tokens, **{f: run.plugin[f] for f in ("kernels_asked", "kernels", "kernel_steps",
                                                                   "kernel_fallbacks")}}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for machines without a GPU")
@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_triton_through_the_interpreter_gives_the_torch_steps_tokens(tiny_dir, prompts, method):
    """``"kernels": "triton"`` runs the pool's decode through the fused kernels (Triton's interpreter on this CPU):
    the report says so, with no fallback, and the tokens are the torch step's."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    args = [tiny_dir, json.dumps([prompts[0], prompts[1]]), method, str(BUDGET)]
    done = subprocess.run([sys.executable, "-c", _BOTH, *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    torch_run, triton_run = out["torch"], out["triton"]
    assert torch_run["kernels"] == "torch" and set(torch_run["kernel_steps"]) == {"torch"}
    assert triton_run["kernels_asked"] == "triton" and triton_run["kernels"] == "triton"
    assert triton_run["kernel_steps"] == {"triton": LAYERS * 4} and triton_run["kernel_fallbacks"] == {}
    assert triton_run["kernel_steps"]["triton"] == torch_run["kernel_steps"]["torch"]
    assert triton_run["tokens"] == torch_run["tokens"]


def test_bench_rows_carry_kernels(tiny_dir):
    """``slake bench --engine vllm``'s rows name the choice (``kernels_asked``) and what ran (``kernels``), as the
    transformers engine's rows; plain vLLM runs no plugin step (None); the table shows ``kernels``."""
    from slake.engines.vllm.bench import bench, markdown

    rows = bench(
        tiny_dir, requests=1, prompt_len=160, decode_steps=2, methods=["snapkv"], budget=BUDGET, kernels="torch"
    )
    by = {r["method"]: r for r in rows}
    assert set(by) == {"full", "snapkv"}
    assert by["snapkv"]["kernels_asked"] == "torch" and by["snapkv"]["kernels"] == "torch"
    assert by["full"]["kernels_asked"] == "torch" and by["full"]["kernels"] is None
    header = markdown(rows).splitlines()[0]
    assert "| kernels |" in header and "kernels_asked" not in header


# ---------------------------------------------------------------------------------------------------- the CLI's engine
def test_the_vllm_engine_passes_kernels_to_the_plugin(monkeypatch, tmp_path):
    """``--kernels`` with ``--engine vllm`` is no longer refused: generate and bench hand it to the plugin's
    configuration (what reaches vLLM is checked above)."""
    import slake.engines.vllm.bench as vbench
    import slake.engines.vllm.generate as vgen
    from slake.engines.base import BenchPlan, BenchReport
    from slake.engines.vllm.engine import VllmEngine

    engine = VllmEngine(block_size=16)
    engine.check(kernels="torch")
    engine.check(kernels="triton")
    seen: dict = {}

    def fake_generate(prompt, **kw):
        seen["generate"] = kw
        return "generated"

    def fake_bench(plan, model_dir, dtype, model_name, **kw):
        seen["bench"] = kw
        return BenchReport(rows=[], table="")

    monkeypatch.setattr(vgen, "generate_vllm", fake_generate)
    monkeypatch.setattr(vbench, "run_bench", fake_bench)
    out = engine.generate("hi", method="snapkv", budget=BUDGET, max_new_tokens=2, kernels="torch", window=8)
    assert out == "generated" and seen["generate"]["kernels"] == "torch" and seen["generate"]["window"] == 8
    engine.generate("hi", method="snapkv", budget=BUDGET, max_new_tokens=2)
    assert seen["generate"]["kernels"] == "auto"
    engine._model_dir = str(tmp_path)  # no conversion of the default model
    plan = BenchPlan(methods=("snapkv",), budgets=(Budget(BUDGET),), lengths=(256,), out=tmp_path, kernels="triton")
    engine.bench(plan)
    # the engine's block size reaches the offline benchmark as it does the serve one (it always ran at 32)
    assert seen["bench"] == {"kernels": "triton", "block_size": 16}
