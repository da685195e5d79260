"""The tests' filling of slake's uninitialised tensors (``tests/scratch_poison.py``, installed by
``tests/conftest.py``): what slake's modules allocate holds NaN, -1 or ``True`` in every dtype, what the tests
allocate is left alone, and the fill is no operation of torch's (the tests that count a step's operations count the
same)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import scratch_poison

#: runs the same under any transformers (none is loaded here)
pytestmark = pytest.mark.transformers_free


def _as_slake(source: str, **names):
    """Run ``source`` as code of a slake module (its frame's ``__name__``) and return its ``out``."""
    scope = {"__name__": "slake.cache.fake", "torch": torch, **names}
    exec(compile(source, "<slake.cache.fake>", "exec"), scope)
    return scope["out"]


def test_the_fill_is_installed_for_the_tests():
    assert scratch_poison.install()
    assert getattr(torch.empty, "_slake_poison", False) and getattr(torch.Tensor.new_empty, "_slake_poison", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_floating_scratch_is_nan(dtype):
    out = _as_slake("out = torch.empty(5, 3, dtype=dtype)", dtype=dtype)
    assert out.float().isnan().all()
    assert math.isnan(float(_as_slake("out = torch.empty(4, dtype=dtype).float().sum()", dtype=dtype)))


def test_integer_and_boolean_scratch():
    base = torch.zeros(2, 3)
    assert _as_slake("out = torch.empty(6, dtype=torch.int64)").eq(-1).all()
    assert _as_slake("out = torch.empty(6, dtype=torch.int32)").eq(-1).all()
    assert _as_slake("out = torch.empty(6, dtype=torch.uint8)").eq(255).all()
    assert _as_slake("out = torch.empty(6, dtype=torch.bool)").all()
    assert _as_slake("out = base.new_empty(4)", base=base).isnan().all()
    assert _as_slake("out = torch.empty_like(base)", base=base).isnan().all()
    strided = _as_slake("out = torch.empty_strided((2, 3), (1, 2))")
    assert strided.isnan().all()


def test_what_the_tests_allocate_and_other_devices_are_left_alone(monkeypatch):
    filled = []
    fill = scratch_poison.poison
    monkeypatch.setattr(scratch_poison, "poison", lambda t: filled.append(t.shape) or fill(t))
    torch.empty(3)  # a test's own tensor
    assert filled == []
    _as_slake("out = torch.empty(2)")
    assert filled == [(2,)]
    meta = _as_slake("out = torch.empty(4, device='meta')")  # no memory to fill: passed through untouched
    assert meta.device.type == "meta"
    ones = torch.ones(4)
    _as_slake("out = torch.empty(4, out=ones)", ones=ones)  # an out= argument is the caller's: not filled
    assert ones.eq(1).all()


def test_the_fill_is_no_operation_of_torchs():
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count() as count:
        _as_slake("out = torch.empty(8)")
    assert count.ops == ["aten.empty.memory_format"], count.ops
