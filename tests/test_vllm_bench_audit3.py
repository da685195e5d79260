"""Third audit of the vLLM measurement tools (``slake bench --engine vllm`` with and without ``--serve``, and the GGUF
conversion cache); none of these tests needs vLLM: engines and servers are replaced by fakes where only what the
drivers do with them matters.

* ``bench_vllm.jsonl`` is appended to run after run, but its rows did not say the model dtype, block size, seed,
  warm-up and timed steps they were measured with, nor which run they came from: a float16 run and a float32 run
  (or two seeds) appended to one file could not be told apart. ``bench_serve.jsonl`` rows had no run id either (a
  run resumed after a crash appends the same (configuration, concurrency) rows again).
* A dtype other than float32 was counted as 2 bytes per value when sizing each engine's KV cache: ``float64`` (a
  ``--dtype`` the vLLM engine does not refuse for a model folder) sized the cache for half of what it needs and
  started vLLM; now refused before any engine or server starts, as the runner refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slake.engines.vllm.bench as vbench
from slake.budgets.budget import Budget
from slake.engines.base import BenchPlan, ServePlan
from slake.engines.vllm.runner import VllmRun


def _model_dir(tmp_path: Path) -> str:
    """A model folder with the ``config.json`` the drivers read (a SmolLM2-135M-like shape)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
    }
    (d / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(d)


def _fake_run(prompts: list[list[int]], new_tokens: int, slake: dict | None, block_size: int) -> VllmRun:
    n = len(prompts[0])
    held = -(-(n + new_tokens) // block_size) if slake is None else 5
    return VllmRun(
        tokens=[[7] * new_tokens for _ in prompts],
        prompt_tokens=[n] * len(prompts),
        blocks_after_prefill=[held] * len(prompts),
        blocks_end=[held] * len(prompts),
        block_size=block_size,
        compressed=[slake is not None] * len(prompts),
        kept_tokens_per_layer=[None] * len(prompts),
        kv_bytes=[{}] * len(prompts),
        preemptions=[0] * len(prompts),
        prefill_s=[0.1] * len(prompts),
        decode_ms_per_token=[1.0] * len(prompts),
        wall_s=2.0,
        config=slake,
        model_info={"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float32"},
        plugin=None if slake is None else {"profile": None, "kernels": "torch"},
    )


@pytest.fixture
def fake_engines(monkeypatch):
    """``run_vllm`` and ``step_bench`` replaced: the throughput run returns a fixed run, the step timing fixed
    rows; each records the keyword arguments it got."""
    import slake.engines.vllm.runner as runner

    calls: dict[str, list[dict]] = {"run": [], "steps": []}

    def run_vllm(model_dir, prompts, *, slake, max_new_tokens, block_size=32, **kw):
        calls["run"].append({"block_size": block_size, "dtype": kw.get("dtype"), "slake": slake})
        return _fake_run(prompts, max_new_tokens, slake, block_size)

    def step_bench(model_dir, *, methods, budget, **kw):
        calls["steps"].append(kw)
        return [
            {"method": m, "budget": None if m == "full" else budget, "decode_step_ms": 1.0, "load_avg_1m": [0, 0]}
            for m in ["full", *methods]
        ]

    monkeypatch.setattr(runner, "run_vllm", run_vllm)
    monkeypatch.setattr(vbench, "step_bench", step_bench)
    return calls


def _plan(tmp_path: Path, **kw) -> BenchPlan:
    base = dict(methods=("full", "snapkv"), budgets=(Budget(128),), lengths=(512,), out=tmp_path / "out")
    return BenchPlan(**{**base, **kw})


def test_offline_rows_record_the_settings_they_ran_with(tmp_path, fake_engines):
    """Two runs appended to one ``bench_vllm.jsonl`` (float16 then float32, other seeds and step counts): each row
    says its dtype, block size, seed, warm-up and timed steps, and the rows of one run share one ``run_id``."""
    model = _model_dir(tmp_path)
    first = vbench.run_bench(_plan(tmp_path, seed=3, warmup=1, decode_steps=4), model, "float16", "m")
    second = vbench.run_bench(_plan(tmp_path, seed=5, warmup=2, decode_steps=6), model, "float32", "m")
    lines = (tmp_path / "out" / "bench_vllm.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert len(rows) == 4 and rows[:2] == first.rows and rows[2:] == second.rows
    for row, (dtype, seed, warmup, steps) in zip(rows, [("float16", 3, 1, 4)] * 2 + [("float32", 5, 2, 6)] * 2):
        assert (row["dtype"], row["seed"], row["warmup"], row["decode_steps"]) == (dtype, seed, warmup, steps), row
        assert row["block_size"] == 32
    assert rows[0]["run_id"] == rows[1]["run_id"] != rows[2]["run_id"] == rows[3]["run_id"]
    assert [c["dtype"] for c in fake_engines["run"]] == ["float16"] * 2 + ["float32"] * 2


def test_offline_table_says_the_runs_settings_once(tmp_path, fake_engines):
    """The settings common to the run are said above ``bench_vllm.md``'s table, not repeated in its columns."""
    report = vbench.run_bench(_plan(tmp_path, seed=9), _model_dir(tmp_path), "bfloat16", "smollm2")
    md = (tmp_path / "out" / "bench_vllm.md").read_text()
    run_id = report.rows[0]["run_id"]
    assert f"run {run_id}" in md and "(bfloat16)" in md and "seed 9" in md
    header = report.table.splitlines()[0]
    assert "run_id" not in header and "dtype" not in header and "blocks_end" in header


def test_offline_block_size_reaches_every_engine_and_row(tmp_path, fake_engines):
    """``run_bench(block_size=...)`` runs the throughput and the step engines at that block size (they ran at 32
    whatever was asked) and the rows record it."""
    report = vbench.run_bench(_plan(tmp_path), _model_dir(tmp_path), "float32", "m", block_size=64)
    assert {c["block_size"] for c in fake_engines["run"]} == {64}
    assert {c["block_size"] for c in fake_engines["steps"]} == {64}
    assert {r["block_size"] for r in report.rows} == {64}


def test_unknown_dtype_is_refused_not_counted_as_two_bytes(tmp_path, fake_engines):
    """``float64`` sized each engine's KV cache at 2 bytes a value and reached vLLM; refused in one line before any
    engine starts, as the runner refuses it."""
    model = _model_dir(tmp_path)
    with pytest.raises(ValueError, match="unknown model dtype 'float64'"):
        vbench.bench_kv_cache_bytes(model, "float64", 4, 1024)
    with pytest.raises(ValueError, match="unknown model dtype 'float64'"):
        vbench.run_bench(_plan(tmp_path), model, "float64", "m")
    assert fake_engines == {"run": [], "steps": []}
    per_token = 2 * 30 * 3 * 64
    assert vbench.bench_kv_cache_bytes(model, "float16", 1, 10) == 2**30  # whole GiB, at least 1
    assert vbench._kv_bytes_per_token(model, "bfloat16") == 2 * per_token
    assert vbench._kv_bytes_per_token(model, "float32") == 4 * per_token


# ---------------------------------------------------------------------------------------------------------------
# --serve


class _FakeServer:
    """``VllmServer`` replaced: records its starts; every level has one completed request."""

    starts: list = []

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def __enter__(self):
        _FakeServer.starts.append(self.cfg)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def plugin_lines(self) -> list[str]:
        return []


@pytest.fixture
def fake_serve(monkeypatch):
    import slake.engines.vllm.serve.run as serve_run

    _FakeServer.starts = []

    async def sweep(server, plan, sp, prompts, label, emit) -> None:
        for c in sp.concurrency:
            emit(c, {"requests": 1, "completed": 1, "failed": 0, "output_tok_s": 1.0, "max_running": 1,
                     "max_kv_blocks": 1}, 0, None)  # fmt: skip

    monkeypatch.setattr(serve_run, "VllmServer", _FakeServer)
    monkeypatch.setattr(serve_run, "_sweep", sweep)
    return serve_run


def _serve_plan(tmp_path: Path) -> BenchPlan:
    sp = ServePlan(concurrency=(1, 2), requests=2, prompt_lens=(64, 64), max_tokens=4, kv_memory_gib=0.5)
    return _plan(tmp_path, methods=("full",), serve=sp, plots=False, progress=False)


def test_serve_rows_of_one_run_share_a_run_id(tmp_path, fake_serve):
    """Two runs appended to one ``bench_serve.jsonl``: each row names its run, as the offline rows do."""
    model = _model_dir(tmp_path)
    a = fake_serve.run_serve_bench(_serve_plan(tmp_path), model, "float32", "m", lambda m, b: None)
    b = fake_serve.run_serve_bench(_serve_plan(tmp_path), model, "float32", "m", lambda m, b: None)
    rows = [json.loads(x) for x in (tmp_path / "out" / "bench_serve.jsonl").read_text().splitlines()]
    assert rows == a.rows + b.rows and len(rows) == 4
    assert rows[0]["run_id"] == rows[1]["run_id"] != rows[2]["run_id"] == rows[3]["run_id"]
    assert f"run {rows[2]['run_id']}" in (tmp_path / "out" / "bench_serve.md").read_text()


def test_serve_refuses_an_unknown_dtype_before_any_server_starts(tmp_path, fake_serve):
    with pytest.raises(ValueError, match="unknown model dtype 'float64'"):
        fake_serve.run_serve_bench(_serve_plan(tmp_path), _model_dir(tmp_path), "float64", "m", lambda m, b: None)
    assert _FakeServer.starts == []
