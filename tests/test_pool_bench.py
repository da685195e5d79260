"""The plugin's pool micro-benchmark (``python -m slake.engines.vllm.bench pool``): runs without vLLM."""

from __future__ import annotations

import pytest

from slake.engines.vllm.bench import pool_step_cpu_ms
from slake.engines.vllm.pool_bench import pool_shape


def test_a_method_spec_gets_its_methods_slots():
    """``slake[linear_cache=false]`` is SLAKE: a request holds the layer cap's 2 x budget + 1 slots, as ``slake``."""
    assert pool_shape("slake", 128, 32)[1:] == (257, 9)
    assert pool_shape("slake[linear_cache=false]", 128, 32)[1:] == (257, 9)
    assert pool_shape("snapkv", 128, 32)[1:] == (129, 5)


@pytest.mark.parametrize("method", ["snapkv", "slake", "slake[linear_cache=false]"])
def test_pool_step_runs_at_a_layers_average_size_with_a_cold_cache(method):
    ms = pool_step_cpu_ms(method, requests=2, budget=48, layers=2, block_size=16, steps=1, kept=48, cold=True)
    assert ms > 0


def test_pool_step_refuses_more_kept_slots_than_a_request_holds():
    with pytest.raises(ValueError, match="kept must be in"):
        pool_step_cpu_ms("snapkv", requests=2, budget=48, layers=2, block_size=16, steps=1, kept=49)


def test_gpu_pool_bench_refuses_a_machine_without_cuda(monkeypatch):
    """``python -m slake.engines.vllm.pool_bench`` measures a GPU: without CUDA it says so in one line."""
    import torch

    from slake.engines.vllm import pool_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is not available"):
        pool_bench.main(["--methods", "snapkv"])


def test_random_pool_is_the_same_on_every_call():
    """Two pools built from the same arguments hold the same cache and state (drawn on the CPU, then moved), which
    the GPU benchmark's eager-against-graph check relies on."""
    import torch

    from slake.engines.vllm.plugin.paged import FlashAttnLayout
    from slake.engines.vllm.pool_bench import random_pool

    kw: dict = dict(requests=2, budget=24, layers=2, kv_heads=2, group=2, head_dim=16, block_size=16)
    kw["layout"] = FlashAttnLayout()
    a, b = random_pool("slake", **kw), random_pool("slake", **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.kv, b.kv, strict=True))
    assert torch.equal(a.pool.scores, b.pool.scores) and torch.equal(a.query, b.query)
    torch.testing.assert_close(a.step(), b.step(), rtol=0, atol=0)
