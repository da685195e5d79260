"""Audit of the fused decode step's coverage, fifth round: each test failed before its fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slake.cache.dense_step import dense_kernel_reason
from slake.cache.fused_step import _why_not
from slake.methods import make_method
from slake.methods.slake import Slake

pytestmark = pytest.mark.transformers_free


class _AcrossHeadsSlake(Slake):
    """A custom method that evicts across a layer's KV heads and, as SLAKE does, before its output."""

    @property
    def evicts_across_heads(self) -> bool:
        return True


def _step(method):
    slots = SimpleNamespace(target=torch.zeros(1, 2), order=None, linear=None, weights=None, layer=None)
    mem = SimpleNamespace(width=8, quant=None, keys=torch.zeros(1))
    return _why_not(method, method.fused_rule(), slots, mem)


def test_an_eviction_across_kv_heads_before_the_output_is_not_claimed_by_the_kernels():
    # the kernels attend before the layer kernel's eviction across heads; the torch step evicts first and attends
    # without the victim: such a method was reported as covered, and its fused step attended a token it had evicted
    assert _step(make_method("slake")) is None  # SLAKE evicts per KV head: covered
    method = _AcrossHeadsSlake()
    assert method.evict_before_output and method.evicts_across_heads
    assert _step(method) == "an eviction across a layer's KV heads before the output"


def test_a_layer_on_the_cpu_beside_gpu_layers_takes_the_torch_step(monkeypatch):
    # kernels="auto" is chosen from a generation's first layer: a model whose first layers are on a GPU and its last
    # on the CPU had the kernels launched on the CPU layers' tensors (Triton refuses host pointers); such a layer now
    # takes the torch step and says why, and a CUDA layer (or the interpreter, for tests) is still covered
    method = make_method("slake")
    slots = SimpleNamespace(target=torch.zeros(1, 2), order=None, linear=None, weights=None, layer=None)
    mem = SimpleNamespace(width=8, quant=None, keys=torch.zeros(1))
    assert _why_not(method, method.fused_rule(), slots, mem) is None  # the interpreter runs CPU tensors
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine
    assert _why_not(method, method.fused_rule(), slots, mem) == "a layer on the cpu (the kernels launch on GPUs)"
    mem.keys = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    assert _why_not(method, method.fused_rule(), slots, mem) is None


def test_a_full_cache_layer_on_the_cpu_beside_gpu_layers_takes_sdpa(monkeypatch):
    # the same for the full cache's dense kernels: a CPU layer's store is attended by SDPA, said in the report
    store = SimpleNamespace(kv_dtype=None, keys=torch.zeros(1))
    assert dense_kernel_reason(store) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dense_kernel_reason(store) == "a layer on the cpu (the kernels launch on GPUs)"
