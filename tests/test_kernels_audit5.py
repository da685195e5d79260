"""Audit of the fused decode step's coverage, fifth round: each test failed before its fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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
    mem = SimpleNamespace(width=8, quant=None)
    return _why_not(method, method.fused_rule(), slots, mem)


def test_an_eviction_across_kv_heads_before_the_output_is_not_claimed_by_the_kernels():
    # the kernels attend before the layer kernel's eviction across heads; the torch step evicts first and attends
    # without the victim: such a method was reported as covered, and its fused step attended a token it had evicted
    assert _step(make_method("slake")) is None  # SLAKE evicts per KV head: covered
    method = _AcrossHeadsSlake()
    assert method.evict_before_output and method.evicts_across_heads
    assert _step(method) == "an eviction across a layer's KV heads before the output"
