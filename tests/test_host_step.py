"""``python -m benchmarks host-step`` (:mod:`benchmarks.host_step`): the host's share of an eager decode step with
the fused kernels replaced by stand-ins, per launch variant. Runs transformers' Llama, so not in the
transformers-free tier."""

from __future__ import annotations

import pytest

from slake.kernels import launch_config, load


def test_host_step_times_each_launch_variant(monkeypatch):
    """``python -m benchmarks host-step`` on a two-layer model: a row per launch variant, the stand-in for Triton's
    binding binds every launch (the CUDA backend's binder, built without a GPU), and the kernels and the held steps'
    switch are back after."""
    from benchmarks import host_step

    decode = load()
    before = decode._evict_attend_kernel
    bindings: list = []
    made = host_step.TritonBinding

    def recording(kernel):
        bindings.append(made(kernel))
        return bindings[-1]

    monkeypatch.setattr(host_step, "TritonBinding", recording)
    rows = host_step.host_step_ms(
        ["snapkv", "full", "transformers"], layers=2, prompt=80, budget=32, steps=2, repeats=1
    )
    assert [(r["method"], r["launch"]) for r in rows] == [
        ("transformers", "sdpa"), ("full", "sdpa"), ("snapkv", "none"), ("snapkv", "triton"), ("snapkv", "cached"),
        ("snapkv", "afresh"),
    ]  # fmt: skip
    assert all(r["ms_per_layer_step"] > 0 for r in rows)
    assert sum(b.binds for b in bindings) >= 2 * 2 * 5  # two kernels, two layers, five steps at least
    assert decode._evict_attend_kernel is before
    assert launch_config.HELD_STEP  # "afresh" turned it off for its rows only
    with pytest.raises(ValueError, match="unknown launch"):
        host_step.host_step_ms(["snapkv"], launches=("fast",))


def test_launch_cost_times_each_kernel_of_a_step():
    """``python -m benchmarks launch-cost``: a row per fused kernel of one step (CriticalKV's three), with the
    numbers of arguments the launch passes and positive times for Triton's binding, the cached launch and its key."""
    from benchmarks import host_step

    load()
    rows = host_step.launch_cost_us(["snapkv", "criticalkv"], number=5, repeats=1)
    kernels = [(r["method"], r["kernel"]) for r in rows]
    assert kernels == [
        ("snapkv", "_append_logits_kernel"), ("snapkv", "_evict_attend_kernel"),
        ("criticalkv", "_append_logits_kernel"), ("criticalkv", "_value_projection_kernel"),
        ("criticalkv", "_evict_attend_kernel"),
    ]  # fmt: skip
    for r in rows:
        assert r["runtime_args"] > r["tensors"] > 0 and r["named_args"] > 0
        assert r["triton_us"] > 0 and r["cached_us"] > 0 and r["key_us"] > 0
