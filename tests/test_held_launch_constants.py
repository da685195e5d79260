"""A launch constant changed between the decode steps of one cache (``launch_config.tuned``, documented to take
effect at the next step) must not leave a layer's held fused-step arguments behind it. With an eviction across a
layer's KV heads (``decode_scope=layer``), the arguments made while the rows were narrower than ``WIDE_SLOTS`` leave
out the rows' slot order; a lowered ``WIDE_SLOTS`` then switched the launch to the blockwise form, which writes that
order: into a 0-element placeholder (a segfault in Triton's interpreter, an illegal address on a GPU). The held
arguments now carry the constant they were made under and are made again when it changes."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.kernels import launch_config
from slake.methods import make_method

pytestmark = pytest.mark.transformers_free

B, H, G, D, S, BUDGET, LAYERS = 2, 2, 2, 16, 40, 20, 2


def _steps(kernels: str, tuned_from: int) -> list[torch.Tensor]:
    """Three decode steps of every layer, the launch constants tuned from step ``tuned_from`` on; the outputs, then
    each layer's kept-slot mask."""
    g = torch.Generator().manual_seed(5)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    method = make_method("ada-snapkv", window=4, decode_scope="layer")
    eng = CompressedKV(method, BUDGET, LAYERS, kernels=kernels)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, :7] = True
    for li in range(LAYERS):
        eng.prefill_layer(li, rnd(B, H * G, S, D), rnd(B, H, S, D), rnd(B, H, S, D), padding, D**-0.5)
    outs = []
    for step in range(3):
        tuned = launch_config.tuned(WIDE_SLOTS=16, WIDE_BLOCK=16) if step >= tuned_from else None
        if tuned is not None:
            tuned.__enter__()
        try:
            for li in range(LAYERS):
                eng.append(li, rnd(B, H, 1, D), rnd(B, H, 1, D))
                outs.append(eng.decode_attention(li, rnd(B, H * G, 1, D), D**-0.5).float())
        finally:
            if tuned is not None:
                tuned.__exit__(None, None, None)
    assert max(s.valid.shape[-1] for s in eng.layers) > 16  # the tuned steps' rows count as wide
    return outs + [s.valid for s in eng.layers]


@pytest.mark.parametrize("tuned_from", [0, 1], ids=["tuned-throughout", "tuned-after-the-first-step"])
def test_a_lowered_wide_slots_between_steps_remakes_the_held_arguments(tuned_from):
    reference = _steps("torch", tuned_from)
    fused = _steps("triton", tuned_from)
    for a, b in zip(reference, fused, strict=True):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
