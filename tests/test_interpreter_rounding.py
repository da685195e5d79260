"""Triton's interpreter rounds float32 to bfloat16 as a GPU and torch do (``tests/conftest.py``,
``_bf16_casts_round_to_nearest_even``): to nearest, ties to even, both through an explicit ``.to(tl.bfloat16)`` and
through a store into a bfloat16 tensor. Before, it cut the low bits off, and half of the values differed by one bf16
step from what the fused kernels compute on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or triton.__version__ != "3.6.0",
    reason="the rounding patch is for Triton 3.6.0's interpreter",
)


@triton.jit
def _to_bf16(x_ptr, y_ptr, z_ptr, B: tl.constexpr):
    o = tl.arange(0, B)
    v = tl.load(x_ptr + o)
    tl.store(y_ptr + o, v)  # the store casts
    tl.store(z_ptr + o, v.to(tl.bfloat16).to(tl.float32))  # an explicit cast and back


def test_float32_to_bfloat16_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1016, generator=g) * torch.logspace(-3, 3, 1016)  # with the 8 below: 1024, a power of 2
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF], dtype=torch.int32)  # ties, carries
    x = torch.cat([x, bits.view(torch.float32), -bits.view(torch.float32)])
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    z = torch.empty_like(x)
    _to_bf16[(1,)](x, y, z, B=x.numel())
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(z, expected.float())
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(y.view(torch.int16), truncated.view(torch.int16))  # it would catch the cut-off
