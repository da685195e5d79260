"""``slake bench`` end to end on a tiny random model, and the named random shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slake.cli import main
from slake.engines.transformers.shapes import SHAPES, parse_shape


def test_bench_end_to_end_writes_jsonl_md_png_and_json(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--methods",
            "full,snapkv,slake",
            "--budget",
            "40",
            "--lengths",
            "48,96",
            "--random-model",
            "tiny",
            "--device",
            "cpu",
            "--decode-steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
            "--json",
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert len(rows) == 6
    for r in rows:
        for key in (
            "method",
            "budget",
            "length",
            "batch",
            "prefill_s",
            "decode_ms_per_token",
            "peak_mem_bytes",
            "kv_bytes",
        ):
            assert key in r
        assert r["decode_steps"] == 3 and r["decode_ms_min"] <= r["decode_ms_per_token"] <= r["decode_ms_max"]
        assert r["peak_mem_bytes"] > 0 and r["kv_bytes"] > 0 and r["prefill_s"] > 0
    by = {(r["method"], r["length"]): r for r in rows}
    assert by[("slake", 96)]["compressed"] and by[("slake", 96)]["kv_bytes_detail"]["linear_state"] > 0
    assert by[("snapkv", 96)]["kv_bytes"] < by[("full", 96)]["kv_bytes"]
    # beside each decode time, the memory's floor: the same weights for every row, the cache's bytes per method
    for r in rows:
        assert r["bandwidth_gbs"] > 0 and r["roofline_bytes"] > r["kv_bytes_detail"]["kept"]
        assert r["roofline_ms"] == pytest.approx(r["roofline_bytes"] / (r["bandwidth_gbs"] * 1e9) * 1e3, rel=1e-2)
        assert r["vs_roofline"] == pytest.approx(r["decode_ms_per_token"] / r["roofline_ms"], rel=1e-2)
    weights = {r["roofline_bytes"] - r["kv_bytes_detail"]["kept"] - r["kv_bytes_detail"]["linear_state"] for r in rows}
    assert len(weights) == 1
    # which decode step ran (auto on the CPU: the torch step; the full cache's layers take one SDPA call each)
    assert by[("slake", 96)]["kernels"] == "torch" and by[("snapkv", 96)]["kernels"] == "torch"
    assert all(r["triton_launch"] is None for r in rows)  # no fused kernel launched
    lines = (out / "bench.jsonl").read_text().strip().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["method"] == "full"
    md = (out / "bench.md").read_text()
    assert "| slake | 40 | 96 |" in md
    assert "x roofline" in md and "copy bandwidth" in md
    # on CPU the three configurations of each length are timed again in turn (interleaved, the default)
    assert all(r["decode_timing"] == "interleaved" and r["decode_ms_sequential"] > 0 for r in rows)
    assert "timed in turn" in md and "decode vs first" in md
    # each length's first configuration is the reference of the paired ratios (1.0 against itself)
    # the full cache keeps every token: no budget in its label or its table row (before: "full@40", "| full | 40 |")
    assert by[("full", 48)]["decode_vs_first"] == 1.0 and by[("slake", 96)]["decode_first"] == "full"
    assert "| 1.000 × full |" in md and "| full | - | 48 |" in md
    # steps issued back to back are timed on CUDA only (a CPU step is synchronous)
    assert all(r["decode_ms_pipelined"] is None and "pipelined_vs_roofline" not in r for r in rows)
    assert "back to back" not in md
    for png in ("decode_latency.png", "peak_memory.png"):
        assert (out / png).stat().st_size > 1000


def test_bench_chunked_prefill_and_batch(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--methods",
            "cake",
            "--budget",
            "40",
            "--lengths",
            "96",
            "--batch",
            "2",
            "--prefill-chunk",
            "32",
            "--random-model",
            "tiny:num_hidden_layers=3",
            "--decode-steps",
            "2",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
            "--json",
            "--no-progress",
            "--no-plots",
        ]
    )
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert row["batch"] == 2 and row["prefill_chunk"] == 32 and row["compressed"]
    assert row["prefill_first_chunk"] == 40 + 32  # CAKE's first chunk reaches its budget plus a chunk
    assert not (tmp_path / "decode_latency.png").exists()


def test_bench_sequential_timing_and_single_configurations_keep_their_own_run(tmp_path, capsys):
    base = [
        "bench",
        "--budget",
        "40",
        "--lengths",
        "48,96",
        "--random-model",
        "tiny:num_hidden_layers=2",
        "--device",
        "cpu",
        "--decode-steps",
        "2",
        "--warmup",
        "0",
        "--json",
        "--no-progress",
        "--no-plots",
    ]
    assert main(base + ["--methods", "full,cake", "--decode-timing", "sequential", "--out", str(tmp_path / "a")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert len(rows) == 4 and all(
        r["decode_timing"] == "sequential" and "decode_ms_sequential" not in r and "decode_vs_first" not in r
        for r in rows
    )
    assert all(r["vs_roofline"] == pytest.approx(r["decode_ms_per_token"] / r["roofline_ms"], rel=1e-2) for r in rows)
    assert "decode vs first" not in (tmp_path / "a" / "bench.md").read_text()
    # one configuration per length: nothing to interleave with
    assert main(base + ["--methods", "cake", "--out", str(tmp_path / "b")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["decode_timing"] for r in rows] == ["sequential", "sequential"]
    assert (
        main(base + ["--methods", "cake", "--isolate", "--decode-timing", "interleaved", "--out", str(tmp_path / "c")])
        == 2
    )
    assert "drop --isolate" in capsys.readouterr().err


def test_auto_timing_interleaves_a_gpus_eager_configurations_whose_caches_fit_together(monkeypatch):
    """``--decode-timing auto`` on CUDA (a GPU host's speed moved 2x between runs on the H200, so sequential medians
    said nothing there): a length's eager configurations are timed interleaved when their caches and the largest
    one's working memory fit in the GPU's free memory (the allocator's cached blocks counted as free); not when one
    is compiled, not when they do not fit; the CPU always, and what was asked for explicitly."""
    import types

    from slake.engines.base import BenchPlan
    from slake.engines.transformers import bench
    from slake.engines.transformers.measure import BenchConfig

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 4 * gib)  # 2 GiB cached, free to reuse
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    cpu = types.SimpleNamespace(device=torch.device("cpu"))

    def row(kv_gib: float, working_gib: float = 1.0) -> dict:
        kv = int(kv_gib * gib)
        return {
            "kv_bytes": kv,
            "peak_mem_baseline_bytes": 4 * gib,
            "peak_mem_bytes": 4 * gib + kv + int(working_gib * gib),
        }

    plan = BenchPlan(methods=("full", "slake"), budgets=(), lengths=(8192,), out=Path("."))
    eager = [BenchConfig("full", 1024, 8192), BenchConfig("slake", 1024, 8192)]
    compiled = [BenchConfig("full", 1024, 8192, compile=True), BenchConfig("slake", 1024, 8192, compile=True)]
    assert bench.interleaved_timing(plan, gpu) and bench.interleaved_timing(plan, cpu)
    assert bench.group_interleaved(plan, gpu, eager, [row(8.0), row(0.2)])  # 8.2 + 1 <= 0.8 x 12
    assert not bench.group_interleaved(plan, gpu, eager, [row(9.0), row(0.2)])  # 9.2 + 1 > 9.6
    assert not bench.group_interleaved(plan, gpu, compiled, [row(0.1), row(0.1)])
    assert bench.group_interleaved(plan, cpu, compiled, [row(90.0), row(90.0)])
    asked = BenchPlan(
        methods=("full", "slake"), budgets=(), lengths=(8192,), out=Path("."), decode_timing="interleaved"
    )
    assert bench.group_interleaved(asked, gpu, compiled, [row(90.0), row(90.0)])
    seq = BenchPlan(methods=("full", "slake"), budgets=(), lengths=(8192,), out=Path("."), decode_timing="sequential")
    assert not bench.interleaved_timing(seq, gpu) and not bench.group_interleaved(seq, cpu, eager, [row(1), row(1)])


def test_interleaved_timing_runs_each_configuration_in_alternating_order(monkeypatch):
    from slake.engines.transformers import measure as runner
    from slake.engines.transformers.measure import BenchConfig, time_decode_interleaved
    from slake.engines.transformers.shapes import random_model

    model = random_model("tiny:num_hidden_layers=2", device="cpu", dtype=torch.float32, seed=0)
    calls = []
    real_step = runner._step

    def step(m, cache, tok):
        calls.append(id(cache))
        return real_step(m, cache, tok)

    monkeypatch.setattr(runner, "_step", step)
    cfgs = [BenchConfig(method=m, budget=40, length=64) for m in ("full", "snapkv", "slake")]
    times = time_decode_interleaved(model, cfgs, steps=4, warmup=1)
    assert [len(t) for t in times] == [4, 4, 4] and all(x > 0 for t in times for x in t)
    caches = calls[:3]  # warm-up: one step per configuration, in order
    assert len(set(caches)) == 3
    timed = calls[3:]
    assert timed == caches + caches[::-1] + caches + caches[::-1]


def test_bench_rejects_bad_arguments(tmp_path, capsys):
    assert main(["bench", "--methods", "nope", "--random-model", "tiny", "--out", str(tmp_path)]) == 2
    assert (
        main(
            [
                "bench",
                "--methods",
                "full",
                "--random-model",
                "gpt9",
                "--lengths",
                "8",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 2
    )


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_named_shapes_have_their_published_dimensions(name):
    arch, cfg = parse_shape(name)
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    if name == "llama3-8b":
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
            32,
            4096,
            8,
            128256,
        )
    _, small = parse_shape(f"{name}:num_hidden_layers=1")
    assert small["num_hidden_layers"] == 1


def test_random_named_shape_builds_without_download():
    import torch

    from slake.engines.transformers.shapes import random_model

    model = random_model("smollm2-135m:num_hidden_layers=1,vocab_size=512", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 3
    assert model.config._attn_implementation == "slake"


def test_a_random_gemma3_shape_is_hybrid_as_the_checkpoint_is():
    """Gemma 3's shapes build its hybrid layout: five sliding-window layers to one full-attention layer (layers 5,
    11, 17 of the 270M are global, as in the packaged model), only those compressed."""
    import torch

    from slake.engines.transformers.cache import SlakeCache
    from slake.engines.transformers.shapes import random_model

    model = random_model("gemma3-270m:vocab_size=512,hidden_size=64,intermediate_size=128", dtype=torch.float32)
    layout = SlakeCache("snapkv", 64, config=model.config).layout
    assert layout.compressed == [5, 11, 17] and len(layout.bounded) == 15
    assert model.config.sliding_window == 512 and model.config.head_dim == 256
    assert model.config._attn_implementation == "slake"


def test_paired_ratio_survives_drift_that_misleads_the_medians():
    """The machine slows down steadily; short slowdowns hit cake's early steps and slake's late ones. The ratio of
    the medians then says slake is faster; the median of per-round ratios still reads the true 1.05."""
    from slake.engines.transformers.bench import apply_interleaved

    base = [60.0 + 3.0 * r for r in range(12)]  # drift of the machine over the rounds
    cake = [b + (40.0 if r < 3 else 0.0) for r, b in enumerate(base)]
    slake = [1.05 * b + (40.0 if r >= 9 else 0.0) for r, b in enumerate(base)]
    rows = [
        {"method": "cake", "budget": 128, "decode_ms_per_token": 0.0},
        {"method": "slake", "budget": 128, "decode_ms_per_token": 0.0},
    ]
    apply_interleaved(rows, [cake, slake])
    assert rows[1]["decode_ms_per_token"] / rows[0]["decode_ms_per_token"] < 1.0
    assert abs(rows[1]["decode_vs_first"] - 1.05) < 1e-9 and rows[1]["decode_first"] == "cake@128"
    assert rows[0]["decode_vs_first"] == 1.0


def test_bench_runs_the_fused_kernels_when_asked_and_records_them(tmp_path, capsys):
    """``--kernels triton`` (on the CPU through Triton's interpreter) runs the fused decode step; the row says so,
    and how the kernels were launched."""
    argv = ["bench", "--methods", "snapkv", "--budget", "40", "--lengths", "48", "--random-model", "tiny"]
    argv += ["--device", "cpu", "--decode-steps", "2", "--warmup", "0", "--no-plots", "--no-progress", "--json"]
    rc = main([*argv, "--kernels", "triton", "--out", str(tmp_path / "b")])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["kernels"] for r in rows] == ["triton"]
    assert [r["triton_launch"] for r in rows] == ["interpreter"]


def test_steps_issued_back_to_back_feed_each_token_to_the_next_and_sync_once(monkeypatch):
    """``time_pipelined`` runs the steps in order on the device's tokens and synchronises once, at the end (where
    the synchronised timing waits for every step); the table shows the column when a row has it."""
    from slake.engines.transformers import measure
    from slake.engines.transformers.report import markdown_table

    syncs: list[str] = []
    monkeypatch.setattr(measure, "_sync", lambda device: syncs.append(device.type))
    fed: list[int] = []

    def stepper(tok: torch.Tensor) -> torch.Tensor:
        fed.append(int(tok))
        return tok + 1

    ms, host, tok = measure.time_pipelined(stepper, torch.tensor([[7]]), 5, torch.device("cuda"))
    assert fed == [7, 8, 9, 10, 11] and int(tok) == 12 and ms >= host >= 0
    assert syncs == ["cuda", "cuda"]  # before the first step and after the last: none between
    with pytest.raises(ValueError, match="steps"):
        measure.time_pipelined(stepper, tok, 0, torch.device("cpu"))
    row = {
        "method": "slake", "budget": 1024, "length": 131072, "batch": 1, "prefill_s": 1.0, "ttft_s": 1.0,
        "decode_ms_per_token": 9.1, "decode_ms_min": 9.0, "decode_ms_max": 9.3, "decode_ms_pipelined": 7.25,
        "peak_mem_bytes": 1 << 30, "kv_bytes": 1 << 20, "kv_bytes_detail": {},
    }  # fmt: skip
    table = markdown_table([row, {**row, "decode_ms_pipelined": None}, {**row, "decode_ms_pipelined_host": 6.5}])
    assert "back to back ms/token" in table and "| 7.2 |" in table and "| - |" in table
    assert "| 7.2 (host 6.5) |" in table  # the host's share, where the row has it


def test_bench_times_transformers_own_cache_beside_slakes_full_cache(tmp_path, capsys):
    """``--methods transformers``: transformers' own ``DynamicCache``, decoded eager without a slake cache (the decode
    a user has without slake), once per length beside slake's full cache: every token kept, its keys' and values'
    bytes, no kernels of slake's."""
    argv = ["bench", "--methods", "transformers,full,snapkv", "--budget", "40,36", "--lengths", "48", "--random-model"]
    argv += ["tiny", "--device", "cpu", "--decode-steps", "3", "--warmup", "1", "--no-plots", "--no-progress", "--json"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("transformers", 40), ("full", 40), ("snapkv", 40),
                                                          ("snapkv", 36)]  # fmt: skip
    plain, full = rows[0], rows[1]
    assert plain["kernels"] == "sdpa" and plain["triton_launch"] is None and plain["compressed"] is False
    config = parse_shape("tiny")[1]
    layers, kv_heads = config["num_hidden_layers"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    tokens = 48 + 1 + 3  # the prompt, then the token each decode step fed (one warm-up, three timed)
    assert plain["kept_tokens_mean"] == tokens
    assert plain["kv_bytes"] == plain["kv_bytes_detail"]["kept"] == layers * 2 * kv_heads * tokens * head_dim * 4
    assert full["kv_bytes_detail"]["kept"] == plain["kv_bytes"]  # slake's full cache keeps the same entries
    assert "transformers" in (tmp_path / "b" / "bench.md").read_text()


def test_bench_times_transformers_own_cache_alone(tmp_path, capsys):
    """``--methods transformers`` with no method of slake's beside it is one row of transformers' own cache (it was
    refused as an unknown method, which cost a GPU session its baseline row on 2026-11-28)."""
    argv = ["bench", "--methods", "transformers", "--lengths", "48", "--random-model", "tiny", "--device", "cpu"]
    argv += ["--decode-steps", "2", "--warmup", "1", "--no-plots", "--no-progress", "--json"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["method"], r["kernels"], r["compressed"]) for r in rows] == [("transformers", "sdpa", False)]


def test_bench_methods_takes_the_engines_baselines_alone_or_beside_slakes_methods():
    """The engine's baselines pass as they are, alone or beside slake's methods, which are still validated."""
    from slake.cli.bench import bench_methods

    assert bench_methods("transformers", ("transformers",)) == ["transformers"]
    assert bench_methods("transformers,snapkv", ("transformers",)) == ["transformers", "snapkv"]
    assert bench_methods("snapkv,full", ("transformers",)) == ["snapkv", "full"]
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        bench_methods("transformers,nope", ("transformers",))
    with pytest.raises(ValueError, match="unknown method 'transformers'"):
        bench_methods("transformers")  # not a baseline of this engine


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--compile"], "cannot run with --compile"),
        (["--kv-dtype", "int8"], "cannot run with --kv-dtype"),
        (["--prefill-chunk", "16"], "cannot run with --prefill-chunk"),
        (["--engine", "vllm"], "unknown method 'transformers'"),  # a baseline of the transformers engine only
    ],
)
def test_bench_refuses_transformers_own_cache_where_it_would_time_something_else(tmp_path, capsys, flags, says):
    """transformers' own cache is the transformers engine's baseline, timed eager, unchunked, in the model's dtype:
    anything else under its name is refused before a model is loaded."""
    argv = ["bench", "--methods", "transformers,full", "--random-model", "tiny", "--lengths", "48"]
    assert main([*argv, *flags, "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    assert says in capsys.readouterr().err
