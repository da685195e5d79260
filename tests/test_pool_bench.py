"""The plugin's pool micro-benchmark (``python -m slake.engines.vllm.bench pool``): runs without vLLM."""

from __future__ import annotations

import pytest

from slake.engines.vllm.bench import _pool_shape, pool_step_cpu_ms


def test_a_method_spec_gets_its_methods_slots():
    """``slake[linear_cache=false]`` is SLAKE: a request holds the layer cap's 2 x budget + 1 slots, as ``slake``."""
    assert _pool_shape("slake", 128, 32)[1:] == (257, 9)
    assert _pool_shape("slake[linear_cache=false]", 128, 32)[1:] == (257, 9)
    assert _pool_shape("snapkv", 128, 32)[1:] == (129, 5)


@pytest.mark.parametrize("method", ["snapkv", "slake", "slake[linear_cache=false]"])
def test_pool_step_runs_at_a_layers_average_size_with_a_cold_cache(method):
    ms = pool_step_cpu_ms(method, requests=2, budget=48, layers=2, block_size=16, steps=1, kept=48, cold=True)
    assert ms > 0


def test_pool_step_refuses_more_kept_slots_than_a_request_holds():
    with pytest.raises(ValueError, match="kept must be in"):
        pool_step_cpu_ms("snapkv", requests=2, budget=48, layers=2, block_size=16, steps=1, kept=49)
