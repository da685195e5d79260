"""What ``slake bench``, ``slake demo`` and ``slake.generate`` report is what was measured: compiled rows survive
``--isolate``, the demo's KV memory counts every byte a cache holds, compile time is not decode time, the table's KV
column says what its number adds up, profiling changes no row, and bad or repeated input is refused before
anything loads or is written."""

from __future__ import annotations

import json
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

from slake.cli import main
from slake.engines.transformers.shapes import random_model
from tiny_models import word_tokenizer

TINY = ["--random-model", "tiny", "--device", "cpu", "--no-plots", "--no-progress", "--json"]


def _rows(capsys) -> list[dict]:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]


# 1. --isolate --compile


def test_isolate_with_compile_keeps_every_configurations_eager_and_compiled_rows(tmp_path, capsys, monkeypatch):
    """``--isolate --compile``: each configuration's process measures it eager and compiled (as one process without
    ``--isolate`` does), and both rows come back, in that order; the compiled one was dropped for a second eager
    row."""
    from slake.engines.transformers import bench

    calls: list[list[str]] = []

    def child(argv, **kwargs):  # a child ``slake bench`` of one configuration: its rows as ``--json`` prints them
        calls.append(argv)
        compiled = [False, True] if "--compile" in argv else [False]
        method, length = argv[argv.index("--methods") + 1], int(argv[argv.index("--lengths") + 1])
        rows = [
            {
                "method": method, "budget": 48, "length": length, "batch": 1, "kv_dtype": None, "compile": c,
                "compile_s": 1.5 if c else None, "prefill_s": 0.1, "ttft_s": 0.1, "decode_ms_per_token": 2.0 - c,
                "decode_ms_min": 1.0, "decode_ms_max": 2.0, "decode_timing": "sequential", "peak_mem_bytes": 1 << 20,
                "peak_mem_kind": "process_rss_hwm", "kv_bytes": 100, "kv_bytes_detail": {"kept": 100},
                "kernels": "torch", "run_id": "child",
            }
            for c in compiled
        ]  # fmt: skip
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps({"rows": rows}) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", child)
    argv = ["bench", "--methods", "full,snapkv", "--budget", "48", "--lengths", "64,96", "--decode-steps", "2"]
    assert main([*argv, *TINY, "--compile", "--isolate", "--out", str(tmp_path / "b")]) == 0
    rows = _rows(capsys)
    got = [(r["method"], r["length"], r["compile"]) for r in rows]
    assert got == [(m, n, c) for n in (64, 96) for m in ("full", "snapkv") for c in (False, True)]
    assert len(calls) == 4 and all("--compile" in a for a in calls)  # one process per configuration, not two
    assert all(r["compile_s"] == 1.5 for r in rows if r["compile"])
    assert len({r["run_id"] for r in rows}) == 1 and rows[0]["run_id"] != "child"  # the parent's run
    written = [json.loads(line) for line in (tmp_path / "b" / "bench.jsonl").read_text().splitlines()]
    assert [r["compile"] for r in written] == [False, True] * 4
    assert "compiled" in (tmp_path / "b" / "bench.md").read_text()


# 2. slake demo's KV memory


GEMMA_FULL = {"full": 22007808, "kept": 6303744, "padding": 0, "slack": 1554432, "metadata": 49881,
              "linear_state": 0, "sliding": 15697920}  # fmt: skip
GEMMA_SLAKE = {"full": 22007808, "kept": 393216, "padding": 0, "slack": 6144, "metadata": 2535,
               "linear_state": 792588, "sliding": 15697920}  # fmt: skip


class FakeDemoEngine:
    """An engine for ``slake demo`` that answers with fixed results: ``full_kv`` and ``kv`` (the method's) as
    ``kv_bytes``, ``decode_ms`` per token; it records the options ``generate`` was given in ``options``, and the depth
    the sample was asked at in ``options["depth"]`` (:func:`fake_demo`)."""

    name = "transformers"
    tokenizer = None
    context_limit = None  # no model: every length fits

    def __init__(self, full_kv: dict, kv: dict, decode_ms: float) -> None:
        self.full_kv, self.kv, self.decode_ms, self.options = full_kv, kv, decode_ms, {}

    def check(self, **options):
        pass

    def check_pair(self, method, budget):
        pass

    def generate(self, prompt, *, method, budget, max_new_tokens, **options):
        from slake.engines.result import GenerationResult

        self.options.update(options)
        return GenerationResult(
            texts=[": 4680899"], prompt_tokens=[1023], new_tokens=[4], method=method, budget=64,
            kv_bytes=dict(self.full_kv if method == "full" else self.kv), kept_tokens_per_layer=[],
            compressed=method != "full", prefill_s=0.5, decode_ms_per_token=self.decode_ms,
        )  # fmt: skip


def fake_demo(monkeypatch, full_kv: dict, kv: dict, decode_ms: float = 7.0) -> FakeDemoEngine:
    """``slake demo`` run by a :class:`FakeDemoEngine` over a fixed sample and prompt (no model, no essays)."""
    from slake.cli import demo

    engine = FakeDemoEngine(full_kv, kv, decode_ms)
    sample = types.SimpleNamespace(question="What is the number?", answers=["4680899"], metric="all", metadata={})
    monkeypatch.setattr(demo, "engine_from_args", lambda args: engine)
    ruler = lambda *a, **k: engine.options.update(depth=k.get("depth")) or sample  # noqa: E731
    monkeypatch.setattr("slake.eval.ruler.ruler_sample", ruler)
    monkeypatch.setattr("slake.eval.prompts.build_prompt", lambda s, tok: "the document")
    return engine


def test_demo_counts_every_byte_each_cache_holds_on_a_hybrid_model(monkeypatch, capsys):
    """On Gemma 3 (``slake demo --model gemma3-270m --length 1024 --budget 64``, its ``kv_bytes`` above) the demo
    printed 18.7% of the full cache, leaving out the sliding-window layers and the slack both caches hold; counting
    every byte it is 71.6%. ``--json`` says what the sum counts."""
    fake_demo(monkeypatch, GEMMA_FULL, GEMMA_SLAKE)
    argv = ["demo", "--model", "gemma3-270m", "--length", "1024", "--budget", "64", "--max-new-tokens", "4"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    held = {k: v for k, v in GEMMA_FULL.items() if k != "full"}
    assert out["full"]["stored_bytes"] == sum(held.values())
    assert out["compressed"]["stored_bytes"] == sum(v for k, v in GEMMA_SLAKE.items() if k != "full")
    assert out["kept_percent"] == pytest.approx(71.56, abs=0.01)
    assert set(out["stored_parts"]) == set(held) and all(out["stored_parts"].values())  # each part described
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"{sum(held.values()) / 2**20:.1f} MiB" in text and "(71.6% of the full cache)" in text
    assert "sliding-window layers hold 15.0 MiB" in text


def test_demo_memory_is_the_sum_of_the_parts_a_cache_holds():
    from slake.engines.result import held_bytes

    assert held_bytes(GEMMA_SLAKE) == sum(v for k, v in GEMMA_SLAKE.items() if k != "full")
    # the vLLM engine's block total repeats kept and padding: not counted twice
    assert held_bytes({"full": 9, "kept": 5, "padding": 3, "metadata": 1, "linear_state": 0, "blocks_held": 8}) == 9


# 3. slake.generate(compile=True)


@pytest.mark.usefixtures("fresh_dynamo")
def test_generate_reports_compile_time_apart_from_decode_time_and_the_kernels_that_ran(monkeypatch):
    """``slake.generate(compile=True)``: the first decode step compiles; its time is ``extra["compile_s"]``, not
    decode time (a backend that takes 1.5 s to compile made decoding read 1.5 s / 3 steps per token), and
    ``extra["kernels"]`` is the implementation the compiled step was built with, not ``none``."""
    import slake
    from slake.engines.transformers import generate as gen

    real = gen.compile_config

    def slow_backend(gm, example_inputs):
        time.sleep(1.5)  # compiling
        return gm.forward

    def config(device, **kw):
        cfg = real(device, **kw)
        cfg.backend = slow_backend  # dynamo traces the step as in a real compile; its graph runs as it is
        return cfg

    monkeypatch.setattr(gen, "compile_config", config)
    model = random_model("tiny", seed=0)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(60))
    res = slake.generate(model, word_tokenizer(), prompt, method="snapkv", budget=40, max_new_tokens=4,
                         chat_template=False, compile=True)  # fmt: skip
    assert res.new_tokens == [4]
    assert res.extra["compile_s"] >= 1.5
    assert res.decode_ms_per_token < 500  # three steps after the compiled one, without its 1.5 s
    assert res.extra["kernels"] == "torch"
    eager = slake.generate(model, word_tokenizer(), prompt, method="snapkv", budget=40, max_new_tokens=4,
                           chat_template=False)  # fmt: skip
    assert "compile_s" not in eager.extra and eager.extra["kernels"] == "torch"


# 4. and 9. the table: what the KV number adds up, which kernels ran


def _row(**kw) -> dict:
    row = {
        "method": "full", "budget": 48, "length": 8192, "batch": 1, "prefill_s": 1.0, "ttft_s": 1.0,
        "decode_ms_per_token": 9.1, "decode_ms_min": 9.0, "decode_ms_max": 9.3, "peak_mem_bytes": 1 << 30,
        "kernels": "torch", "triton_launch": None,
    }  # fmt: skip
    mib = 1 << 20
    detail = {"kept": 361 * mib, "padding": 0, "slack": 10 * mib, "metadata": 9 * mib, "linear_state": 0}
    row.update(kw)
    row.setdefault("kv_bytes_detail", detail)
    row["kv_bytes"] = sum(row["kv_bytes_detail"].values())
    return row


def test_the_kv_column_shows_every_part_its_total_adds_up():
    """``bench.md``'s KV total holds slack and metadata: the heading and the cell name every part, and the parts
    add up to the total (a hybrid model's sliding-window layers too)."""
    from slake.engines.transformers.report import markdown_table

    table = markdown_table([_row()])
    head = table.splitlines()[0]
    assert "KV MiB held = kept + padding + slack + metadata + linear |" in head and "sliding" not in head
    assert "| 380.00 = 361.00 + 0.00 + 10.00 + 9.00 + 0.00 |" in table
    mib = 1 << 20
    hybrid = _row(kv_bytes_detail={"kept": mib, "padding": 0, "slack": 0, "metadata": 0, "linear_state": 0,
                                   "sliding": 3 * mib})  # fmt: skip
    table = markdown_table([_row(), hybrid])
    assert "+ linear + sliding |" in table and "| 4.00 = 1.00 + 0.00 + 0.00 + 0.00 + 0.00 + 3.00 |" in table
    assert "| 380.00 = 361.00 + 0.00 + 10.00 + 9.00 + 0.00 + 0.00 |" in table


def test_the_speed_doc_labels_its_kv_column_with_every_part_it_adds():
    """``docs/results-speed-memory.md``'s KV column adds slack and metadata too (full at 8K: 380.7 MiB): its heading
    says so, and each number is the total of the run's row."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "results-speed-memory.md").read_text(encoding="utf-8")
    rows = [json.loads(x) for x in (root / "docs/results/bench_cpu/bench.jsonl").read_text().splitlines() if x]
    head = next(line for line in doc.splitlines() if line.startswith("| method | decode ms/token"))
    assert "slack" in head and "metadata" in head
    for r in rows:
        if r["length"] == 8192:
            label = r["method"] + ("" if r["method"] == "full" else f" @{r['budget']}")
            line = next(x for x in doc.splitlines() if x.startswith(f"| {label} |"))
            total, _, parts = line.rstrip(" |").split("| ")[-1].partition(" = ")
            assert float(total) == pytest.approx(r["kv_bytes"] / 2**20, abs=0.01)
            assert sum(float(x) for x in parts.split(" + ")) == pytest.approx(float(total), abs=0.02)


def test_the_table_shows_which_kernels_ran_and_how_they_were_launched():
    """``--kernels triton`` on a CPU runs Triton's interpreter, hundreds of times slower: the table says so."""
    from slake.engines.transformers.report import markdown_table

    table = markdown_table([_row(), _row(method="snapkv", kernels="triton", triton_launch="interpreter")])
    assert "| kernels |" in table.splitlines()[0]
    assert "| torch |" in table and "| triton (interpreter) |" in table


# 5. --profile-steps


def test_profiled_steps_change_neither_the_peak_nor_the_cache_statistics(monkeypatch):
    """The profiled steps ran before the peak and the cache's statistics were read: a growing cache held their
    tokens, and the profiler's memory raised the peak. Both are now read before them."""
    from slake.engines.transformers import measure as runner
    from slake.engines.transformers.memory import MemoryMeter

    def profile(stepper, tok, steps, device):  # as the profiler does: more steps, and memory of its own
        buf = torch.ones(96 << 20, dtype=torch.uint8)  # 96 MiB, touched
        for _ in range(steps):
            tok = stepper(tok)
        del buf
        return {"steps": steps}, tok

    monkeypatch.setattr(runner, "profile_decode", profile)
    model = random_model("tiny", seed=0)
    plain = runner.measure(model, runner.BenchConfig("full", 48, 64, decode_steps=2, warmup=0))
    profiled = runner.measure(model, runner.BenchConfig("full", 48, 64, decode_steps=2, warmup=0, profile_steps=5))
    assert profiled["step_profile"] == {"steps": 5}
    assert profiled["kept_tokens_mean"] == plain["kept_tokens_mean"] == 64 + 2
    assert profiled["kv_bytes_detail"] == plain["kv_bytes_detail"]
    if MemoryMeter.available():  # the high-water mark is reset per configuration
        assert profiled["peak_mem_bytes"] - profiled["peak_mem_baseline_bytes"] < 64 << 20


# 6., 7. and 8. bad or repeated input


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ("tiny:hidden_size=abc", "hidden_size must be an integer >= 1"),
        ("tiny:rope_theta=abc", "rope_theta must be a finite number > 0"),
        ("tiny:hidden_size=0", "hidden_size must be an integer >= 1"),
        ("tiny:head_dim=7", "head dimension must be even"),
        ("tiny:num_key_value_heads=3", "must be a multiple of num_key_value_heads (3)"),
        ("tiny:num_hidden_layers=0", "num_hidden_layers must be an integer >= 1"),
        ("tiny:hidden_size=66", "must be a multiple of num_attention_heads"),
        ("tiny:tie_word_embeddings=3", "true or false"),
        ("tiny-hybrid:sliding_window=0", "sliding_window must be an integer >= 1"),
        ("tiny:vocab_size", "key=value"),
    ],
)
def test_bad_random_model_shapes_exit_2_with_one_line_before_anything_is_written(tmp_path, capsys, shape, says):
    out = tmp_path / "b"
    argv = ["bench", "--methods", "full", "--lengths", "64", "--decode-steps", "2", "--random-model", shape]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and err.startswith("slake bench: error: --random-model")
    assert not out.exists()


def test_good_overrides_still_build():
    from slake.engines.transformers.shapes import parse_shape

    assert parse_shape("tiny:rope_theta=1e4,hidden_size=96,head_dim=16")[1]["hidden_size"] == 96
    assert parse_shape("mistral-7b:sliding_window=none,num_hidden_layers=1")[1]["sliding_window"] is None


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--methods", "full,full"], "--methods: 'full' given twice"),
        (["--methods", "slake[alpha=1],slake[alpha=1.0]"], "--methods: 'slake[alpha=1]' and 'slake[alpha=1.0]'"),
        (["--budget", "48,48"], "--budget: '48' given twice"),
        (["--budget", "48,48.0"], "--budget: '48' and '48.0' given twice"),
        (["--lengths", "64,64"], "--lengths: 64 given twice"),
        (["--kv-dtype", "auto,none"], "--kv-dtype: 'auto' and 'none' given twice"),
        (["--gguf-file", "model.gguf"], "--gguf-file"),
    ],
)
def test_repeated_configurations_and_a_gguf_file_without_a_model_are_refused(tmp_path, capsys, flags, says):
    out = tmp_path / "b"
    argv = ["bench", "--methods", "full", "--budget", "48", "--lengths", "64", "--decode-steps", "2", "--no-progress"]
    assert main([*argv, "--random-model", "tiny", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not out.exists()


def test_rows_say_which_run_seed_and_warmup_they_come_from(tmp_path, capsys):
    """Rows appended to one ``bench.jsonl`` by two runs can be told apart: each row has its run's ``run_id``, and
    its ``seed``, ``warmup`` and the kernels asked for."""
    argv = ["bench", "--methods", "full,snapkv", "--budget", "48", "--lengths", "64", "--decode-steps", "2", *TINY]
    out = tmp_path / "b"
    assert main([*argv, "--seed", "3", "--warmup", "1", "--out", str(out)]) == 0
    first = _rows(capsys)
    assert main([*argv, "--seed", "4", "--warmup", "0", "--out", str(out)]) == 0
    second = _rows(capsys)
    assert {(r["seed"], r["warmup"], r["kernels_asked"]) for r in first} == {(3, 1, "auto")}
    assert {(r["seed"], r["warmup"]) for r in second} == {(4, 0)}
    assert len({r["run_id"] for r in first}) == len({r["run_id"] for r in second}) == 1
    assert first[0]["run_id"] != second[0]["run_id"]
    lines = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["run_id"] for r in lines] == [first[0]["run_id"]] * 2 + [second[0]["run_id"]] * 2


# 10. the progress bar


def test_the_progress_bar_counts_the_interleaved_timing_of_the_last_length(tmp_path, monkeypatch):
    """The bar reached 100% when the last length's configurations had run alone, while their interleaved timing
    (one more prefill and the decode steps of each) was still to come."""
    import tqdm.auto

    from slake.engines.transformers import measure as runner

    bars: list[FakeBar] = []

    class FakeBar:
        def __init__(self, total, **kw):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_postfix_str(self, text):
            pass

        def close(self):
            pass

    seen: list[tuple[int, int]] = []
    real = runner.time_decode_interleaved

    def timed(model, cfgs, steps, warmup):
        seen.append((bars[0].n, bars[0].total))
        return real(model, cfgs, steps, warmup)

    monkeypatch.setattr(tqdm.auto, "tqdm", FakeBar)
    monkeypatch.setattr(runner, "time_decode_interleaved", timed)
    argv = ["bench", "--methods", "full,snapkv", "--budget", "48", "--lengths", "64,96", "--decode-steps", "2"]
    argv += ["--random-model", "tiny", "--device", "cpu", "--no-plots", "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    (bar,) = bars
    assert len(seen) == 2 and all(done < total for done, total in seen)
    assert seen[-1][0] <= bar.total - 2  # the last length's timing is still counted as work to do
    assert bar.n == bar.total == 8  # four runs alone, four shares of interleaved timing


def test_transformers_own_cache_is_counted_as_a_slake_cache_on_a_hybrid_model():
    """The ``transformers`` row of a hybrid model counted its sliding-window layers in ``kept`` and in the tokens per
    layer, where the full cache's row counts them apart (``sliding``): the two rows did not compare."""
    from transformers import DynamicCache

    from hybrid_models import hybrid_model
    from slake.engines.transformers.cache import SlakeCache
    from slake.engines.transformers.cache_kwarg import with_cache
    from slake.engines.transformers.measure import _statistics
    from tiny_models import random_ids

    model = hybrid_model("gemma3")
    ids = random_ids(60, seed=3)
    own = DynamicCache(config=model.config)
    full = SlakeCache("full", 32, config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, **with_cache(model, own), use_cache=True)
        model(input_ids=ids, **with_cache(model, full), use_cache=True)
    mine, theirs = _statistics(own), _statistics(full)
    assert mine["kv_bytes"]["kept"] == theirs["kv_bytes"]["kept"]
    # transformers' sliding layer keeps a view of the prompt's whole keys and values after the prefill, and that
    # storage is held (counted since 2026-11-30); slake's keeps a compact copy of its window
    held = sum(
        t.untyped_storage().nbytes()
        for layer in own.layers
        if getattr(layer, "is_sliding", False)
        for t in (layer.keys, layer.values)
    )
    assert mine["kv_bytes"]["sliding"] == held > theirs["kv_bytes"]["sliding"] > 0
    assert mine["kept_tokens_per_layer"] == theirs["kept_tokens_per_layer"] == [60.0] * len(full.layout.compressed)
