"""The micro-benchmarks of ``benchmarks/`` (``python -m benchmarks ...``): they run without vLLM."""

from __future__ import annotations

import json
import types

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.pool import model_shape, pool_shape, pool_step_cpu_ms, random_pool
from packaged_shapes import SMOLLM2

#: a small attention shape for the pool's tests
SMALL = dict(layers=2, kv_heads=2, group=2, head_dim=16)


def test_a_method_spec_gets_its_methods_slots():
    """``slake[linear_cache=false]`` is SLAKE: a request holds the layer cap's 2 x budget + 1 slots, as ``slake``."""
    assert pool_shape("slake", 128, 32)[1:] == (257, 9)
    assert pool_shape("slake[linear_cache=false]", 128, 32)[1:] == (257, 9)
    assert pool_shape("snapkv", 128, 32)[1:] == (129, 5)


def test_model_shape_from_a_shape_name_and_from_a_model_folder(tmp_path):
    from transformers import LlamaConfig

    named = model_shape("smollm2-135m")
    assert (named.layers, named.kv_heads, named.group, named.head_dim) == (30, 3, 3, 64)
    assert model_shape("llama3-8b:num_hidden_layers=2").attention() == dict(layers=2, kv_heads=8, group=4, head_dim=128)
    LlamaConfig(**SMOLLM2).save_pretrained(tmp_path)
    assert model_shape(str(tmp_path)) == named
    with pytest.raises(ValueError, match="unknown model shape"):
        model_shape("no-such-shape")


@pytest.mark.parametrize("method", ["snapkv", "slake", "slake[linear_cache=false]"])
def test_pool_step_runs_at_a_layers_average_size_with_a_cold_cache(method):
    ms = pool_step_cpu_ms(method, requests=2, budget=48, block_size=16, steps=1, kept=48, cold=True, **SMALL)
    assert ms > 0


def test_pool_step_refuses_more_kept_slots_than_a_request_holds():
    with pytest.raises(ValueError, match="kept must be in"):
        pool_step_cpu_ms("snapkv", requests=2, budget=48, block_size=16, steps=1, kept=49, **SMALL)


def test_pool_cpu_command_prints_one_row_per_method_per_request_and_layer_of_the_shape(capsys):
    shape = "llama3-8b:num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,hidden_size=64"
    main(["pool-cpu", "--shape", shape, "--methods", "snapkv,h2o", "--budget", "48", "--requests", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["method"] for r in rows] == ["snapkv", "h2o"]
    for r in rows:  # per request and layer: the shape's 2 layers, not a fixed count
        assert r["us_per_request_layer"] * (2 * 2) / 1000 == pytest.approx(r["cpu_ms_per_step"], abs=0.006)


def test_gpu_pool_bench_refuses_a_machine_without_cuda(monkeypatch):
    """``python -m benchmarks pool-gpu`` measures a GPU: without CUDA it says so in one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is not available"):
        main(["pool-gpu", "--methods", "snapkv"])


def test_random_pool_is_the_same_on_every_call():
    """Two pools built from the same arguments hold the same cache and state (drawn on the CPU, then moved), which
    the GPU benchmark's eager-against-graph check relies on."""
    from slake.engines.vllm.plugin.paged import FlashAttnLayout

    kw: dict = dict(requests=2, budget=24, block_size=16, layout=FlashAttnLayout(), **SMALL)
    a, b = random_pool("slake", **kw), random_pool("slake", **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.kv, b.kv, strict=True))
    assert torch.equal(a.pool.scores, b.pool.scores) and torch.equal(a.query, b.query)
    torch.testing.assert_close(a.step(), b.step(), rtol=0, atol=0)


def test_the_weights_step_takes_any_shape(monkeypatch):
    """The weights' matrix products of ``pool-gpu`` follow the shape, also where query heads x head size is not the
    hidden size (they used to slice the projection at the hidden size); run on the CPU, the CUDA graph and events
    replaced by plain calls."""
    import benchmarks.pool as bp

    monkeypatch.setattr(bp, "_capture", lambda fn: (types.SimpleNamespace(replay=fn), fn()))
    monkeypatch.setattr(bp, "_events_ms", lambda fn, n: (fn(), 1.0)[1])
    spec = "llama3-8b:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,head_dim=32"
    shape = model_shape(spec + ",intermediate_size=96,vocab_size=50")
    assert shape.kv_heads * shape.group * shape.head_dim == 128 != shape.hidden
    row = bp.weights_cuda(shape, requests=3, device="cpu", dtype=torch.float32)  # raised a shape error before
    assert row["what"] == "weights" and row["requests"] == 3 and row["graph_ms"] == 1.0


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_the_pool_rows_roofline_counts_keys_values_metadata_and_the_linear_state(method):
    """A pool step's roofline: every slot's key and value in the cache's dtype, the slots' positions (8 bytes),
    validity (1) and scores (4), the targets (8 per KV head) and SLAKE's (d + 1)^2 float32 linear state, per layer,
    at the bandwidth given; ``vs_roofline`` is the step over it."""
    import benchmarks.pool as bp

    rp = random_pool(method, requests=3, budget=64, **SMALL)
    W, H, d, L = rp.pool.width, SMALL["kv_heads"], SMALL["head_dim"], SMALL["layers"]
    per_row_layer = H * W * 2 * d * 2 + H * W * (8 + 1 + 4) + H * 8 + (H * (d + 1) ** 2 * 4 if method == "slake" else 0)
    row = bp.pool_roofline(rp.pool, 3, torch.bfloat16, step_ms=0.5, bandwidth=1e12)
    assert row["step_mb_per_layer"] == round(3 * per_row_layer / 1e6, 3)
    floor_us = 3 * per_row_layer / 1e12 * 1e6
    assert row["roofline_us_per_layer"] == pytest.approx(floor_us, rel=1e-3)
    assert row["vs_roofline"] == round(0.5e3 / L / floor_us, 2) and row["bandwidth_gbs"] == 1000.0
    with pytest.raises(ValueError, match="bandwidth"):
        bp.pool_roofline(rp.pool, 3, torch.bfloat16, step_ms=0.5, bandwidth=0)


def test_the_gpu_pool_row_carries_its_roofline_when_given_a_bandwidth(monkeypatch):
    """``pool_step_cuda`` (run on the CPU, the CUDA graph and events replaced by plain calls) adds the roofline of
    its graphed step to its row when it is given a bandwidth, and leaves it out otherwise."""
    import benchmarks.pool as bp

    monkeypatch.setattr(bp, "_capture", lambda fn: (types.SimpleNamespace(replay=fn), fn()))
    monkeypatch.setattr(bp, "_events_ms", lambda fn, n: (fn(), 2.0)[1])
    kw = dict(requests=2, budget=64, steps=1, check=1, device="cpu", dtype=torch.float32, **SMALL)
    row = bp.pool_step_cuda("slake", bandwidth=1e11, **kw)
    assert row["graph_ms"] == 2.0 and row["bandwidth_gbs"] == 100.0
    expected = bp.pool_roofline(random_pool("slake", requests=2, budget=64, **SMALL).pool, 2, torch.float32, 2.0, 1e11)
    assert {k: row[k] for k in expected} == expected
    assert "vs_roofline" not in bp.pool_step_cuda("slake", **kw)


def test_kernel_parts_times_the_step_without_each_part_of_the_second_kernel(monkeypatch):
    """``kernel-parts`` times the fused step as it is, then with each part left out (the switch on during that
    step only), and reports each part's cost as the difference per layer; the kernels' variants themselves run in
    ``test_fused_decode_launches.py`` (interpreter) and compile in ``test_kernels_compile.py``. Here the timed step is
    replaced by one that records the switch and returns 64 µs per layer as it is, 48 without any part."""
    import benchmarks.pool as bp
    from slake.kernels import launch_config

    seen = []

    def step(method, **kw):
        seen.append((method, kw["kernels"], launch_config._left_out))
        us = 64.0 if launch_config._left_out == 0 else 48.0
        return {"budget": kw["budget"], "requests": 1, "slots": 129, "graph_ms": us * 32 / 1e3,
                "graph_us_per_layer": us, "kernels": "triton"}  # fmt: skip

    monkeypatch.setattr(bp, "pool_step_cuda", step)
    rows = bp.kernel_parts_cuda("slake", ["sort", "fold"], budget=64, kernels="torch")
    masks = launch_config.SKIP_PARTS
    assert seen == [("slake", "triton", 0), ("slake", "triton", masks["sort"]), ("slake", "triton", masks["fold"])]
    assert [r["left_out"] for r in rows] == [None, "sort", "fold"]
    assert [r.get("part_us_per_layer") for r in rows] == [None, 16.0, 16.0]
    assert launch_config._left_out == 0
    assert [r["left_out"] for r in bp.kernel_parts_cuda("cake", budget=64)] == [None, *masks]


def test_kernel_parts_refuses_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="kernel-parts: CUDA is not available"):
        main(["kernel-parts"])


def test_kernel_tune_times_the_step_with_each_variant_of_the_launch_constants(monkeypatch):
    """``kernel-tune`` times the fused step as it is, then under each variant (the constants set during that step
    only), and reports each against the step as it is; the variants' arithmetic is held to the torch step in
    ``test_fused_decode_launches.py``. Here the timed step is replaced by one that records the constants in force and
    takes 40 µs per layer with COMBINE=8, 50 otherwise."""
    import benchmarks.pool as bp
    from benchmarks.__main__ import parse_variants
    from slake.kernels import launch_config

    seen = []

    def step(method, **kw):
        seen.append((method, kw["kernels"], launch_config.COMBINE, launch_config.WIDE_WARPS))
        us = 40.0 if launch_config.COMBINE == 8 else 50.0
        return {"budget": kw["budget"], "requests": 1, "slots": 1025, "graph_ms": us * 32 / 1e3,
                "graph_us_per_layer": us, "kernels": "triton", "graph_same_kept": True}  # fmt: skip

    monkeypatch.setattr(bp, "pool_step_cuda", step)
    rows = bp.kernel_tune_cuda("slake", parse_variants("COMBINE=8;WIDE_WARPS=16,COMBINE=2"), budget=1024)
    assert seen == [("slake", "triton", 4, 8), ("slake", "triton", 8, 8), ("slake", "triton", 2, 16)]
    assert [r["variant"] for r in rows] == [{}, {"COMBINE": 8}, {"WIDE_WARPS": 16, "COMBINE": 2}]
    assert [r.get("vs_as_is") for r in rows] == [None, 0.8, 1.0]
    assert launch_config.COMBINE == 4 and launch_config.WIDE_WARPS == 8
    assert len(bp.kernel_tune_cuda("cake", budget=64)) == 1 + len(bp.TUNE_VARIANTS)
    for bad in ("COMBINE", "COMBINE=x", ";"):
        with pytest.raises(SystemExit, match="kernel-tune"):
            parse_variants(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="kernel-tune: CUDA is not available"):
        main(["kernel-tune"])


def test_kernel_parts_and_tune_emit_the_rows_of_each_method_at_the_shape_asked(monkeypatch, capsys):
    """The command lines of ``kernel-parts`` and ``kernel-tune`` pass the shape, batch and variants to the benches
    and print one JSON row each after the device's (a machine with CUDA stood in for: the benches are replaced)."""
    import json

    import benchmarks.pool as bp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    calls = []

    def bench(name):
        def rows(method, extra, **pool):
            calls.append((name, method, extra, pool["requests"], pool["budget"], pool["kv_heads"], pool["block_size"]))
            return [{"what": name, "method": method}]

        return rows

    monkeypatch.setattr(bp, "kernel_parts_cuda", bench("parts"))
    monkeypatch.setattr(bp, "kernel_tune_cuda", bench("tune"))
    main(["kernel-parts", "--methods", "slake,cake", "--parts", "sort", "--budget", "1024", "--requests", "2"])
    main(["kernel-tune", "--methods", "slake", "--variants", "COMBINE=8", "--block-size", "32"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["what"] for r in rows] == ["device", "parts", "parts", "device", "tune"]
    assert calls == [
        ("parts", "slake", ["sort"], 2, 1024, 8, 16),
        ("parts", "cake", ["sort"], 2, 1024, 8, 16),
        ("tune", "slake", [{"COMBINE": 8}], 1, 128, 8, 32),
    ]


def test_host_profile_reports_each_methods_host_time_and_its_busiest_functions(capsys):
    """``python -m benchmarks host-profile`` on the CPU: one row per method, the host's time at most the wall's,
    the functions ranked by their own time, and the cache's step (torch) named."""
    main(
        ["host-profile", "--methods", "full,slake,transformers", "--shape", "tiny", "--device", "cpu"]
        + ["--dtype", "float32", "--length", "96", "--budget", "32", "--steps", "2", "--top", "4", "--kernels", "torch"]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["method"] for r in rows] == ["transformers", "full", "slake"]  # transformers' own cache first
    assert rows[0]["kernels"] == "transformers' DynamicCache" and rows[2]["kernels"] == "torch"
    for r in rows:
        assert 0 < r["host_ms"] <= r["wall_ms"]
        own = [f["own_ms"] for f in r["functions"]]
        assert len(own) == 4 and own == sorted(own, reverse=True)
        assert all(f["calls"] > 0 and f["cumulative_ms"] >= f["own_ms"] for f in r["functions"])
        assert {"transformers", "torch", "builtins"} <= set(r["by_package"])
        assert sum(r["by_package"].values()) >= sum(own)  # every function's own time, not only the top ones
    assert "slake" in rows[2]["by_package"]  # the cache's own step


@pytest.mark.usefixtures("fresh_dynamo")
def test_host_profile_profiles_the_compiled_step_with_compile(capsys):
    """``host-profile --compile`` profiles the compiled step (dynamo's eager backend on the CPU): its rows say so,
    and the profile holds the compiled call, not the eager model's modules (no ``modeling_llama`` function runs)."""
    main(
        ["host-profile", "--methods", "slake", "--shape", "tiny", "--device", "cpu", "--dtype", "float32"]
        + ["--length", "96", "--budget", "32", "--steps", "2", "--top", "40", "--kernels", "torch"]
        + ["--compile", "--backend", "eager"]
    )
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["method"] == "slake" and row["compile"] is True
    assert 0 < row["host_ms"] <= row["wall_ms"]
    names = [f["function"] for f in row["functions"]]
    assert not [n for n in names if "modeling_llama" in n and "forward" in n], names


def test_host_profile_refuses_a_run_without_steps():
    from benchmarks.host_profile import host_profile

    with pytest.raises(ValueError, match="steps"):
        host_profile(["full"], shape="tiny", device="cpu", steps=0)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_guards_reports_each_variants_guards_and_their_cost(capsys):
    """``python -m benchmarks compile-guards`` on the CPU: per method, every guard and slake's filter, the filter
    checking fewer guards (their times are reported, not asserted)."""
    from slake.engines.transformers.compile_options import guard_filter_supported

    if not guard_filter_supported():
        pytest.skip("this torch has no guard_filter_fn")
    main(
        ["compile-guards", "--methods", "slake", "--shape", "tiny:num_hidden_layers=2", "--length", "64"]
        + ["--budget", "40", "--steps", "1", "--checks", "300", "--backend", "eager"]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["method"], r["variant"]) for r in rows] == [("slake", "all"), ("slake", "lean")]
    every, lean = rows
    assert 0 < lean["guards"] < every["guards"]
    assert all(r["guard_check_us"] > 0 and 0 < r["host_ms"] <= r["wall_ms"] for r in rows)


def test_compile_guards_refuses_an_unknown_variant():
    from benchmarks.compile_guards import guard_costs

    with pytest.raises(ValueError, match="variants"):
        guard_costs(["full"], shape="tiny", variants=("some",))
    with pytest.raises(ValueError, match="inductor"):
        guard_costs(["full"], shape="tiny", device="cuda", backend="eager")
