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


def test_auto_chooses_again_at_the_first_gpu_layer_after_cpu_layers(monkeypatch):
    # "auto" was chosen at a generation's first layer only: a model whose first layers keep their cache on the CPU
    # and later ones on a GPU ran the torch step on every layer; the first layer on a GPU now chooses again
    import slake.cache.compressed as compressed

    chosen = []

    def recording_choice(kernels, device=None):
        if device is not None:  # None: the constructor checking the name
            chosen.append(torch.device(device).type)
        return "torch", None

    monkeypatch.setattr(compressed, "kernel_choice", recording_choice)
    cache = compressed.CompressedKV("streamingllm", 4, num_layers=2, kernels="auto")
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    assert not cache.kernel_choice_due(torch.device("cuda"))  # nothing chosen yet: the first layer chooses
    cache.prefill_layer(0, q, k, v, None, 0.5)
    assert chosen == ["cpu"]
    assert cache.kernel_choice_due(torch.device("cuda"))  # a GPU layer after a CPU one chooses again
    assert not cache.kernel_choice_due(torch.device("cpu"))
    cache.prefill_layer(1, q, k, v, None, 0.5)  # a second CPU layer does not
    assert chosen == ["cpu"]
    explicit = compressed.CompressedKV("streamingllm", 4, num_layers=2, kernels="torch")
    explicit.prefill_layer(0, q, k, v, None, 0.5)
    assert not explicit.kernel_choice_due(torch.device("cuda"))  # an explicit choice holds for every layer


def test_a_model_over_two_devices_keeps_one_copy_of_the_prefill_facts_per_device():
    # the per-sequence facts the decode step reads were kept on one device: a model split over two devices copied
    # them again at every change of device, twice per step, and the fused steps' arguments, keyed by the copies,
    # were made again at every step for every layer
    from slake.cache.state import PrefillInfo

    lengths = torch.tensor([5, 7])
    info = PrefillInfo(prompt_len=7, real_len=lengths, first_real=lengths, budget=lengths, compress=lengths > 0)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    first = info.device_copy("real_len", cpu)
    other = info.device_copy("real_len", meta)
    assert other.device == meta and first.device == cpu
    assert info.device_copy("real_len", cpu) is first
    assert info.device_copy("real_len", meta) is other
