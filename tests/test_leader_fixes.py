"""CriticalKV and Ada-PyramidKV against their references (audit of 2026-11-29; each test failed before its fix).

* CriticalKV sized its first stage by the slots a layer held before an eviction. A block of new tokens longer than
  the budget (a later chat turn; every later chunk of a chunked prefill) then exempted more slots than the head keeps,
  all with the same score, and slot order chose which survived. kvpress sizes it by the count kept; the engine now
  passes each head's target (``DecodeInputs.target``) and the rule sizes the stage as the single-token step does.
* ``ada-criticalkv`` under a chunked prefill cut every head to its protected tokens: its per-head budgets are the
  counts its prefill marks, which a later chunk's scores do not carry. It is refused, as SAGE-KV and KVzip are.
* ``ada-pyramidkv`` took KVCache-Factory's uniform fallback for prompts shorter than twice the selectable budget;
  AdaKV's own Ada-PyramidKV (``pyram_mode``) has none and keeps a pyramid capped at ``S - w``.
"""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method
from slake.methods.base import LayerContext
from slake.methods.criticalkv import FIRST

HQ, HKV, D, S, C, W = 4, 2, 16, 64, 24, 8


def _case(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, HQ, n, D, generator=g) * 2,
        torch.randn(1, HKV, n, D, generator=g) * 2,
        torch.randn(1, HKV, n, D, generator=g),
    )


@pytest.mark.parametrize("block", [8, 30, 80])
def test_criticalkv_keeps_the_best_first_stage_slots_after_a_block_longer_than_the_budget(block):
    """A block of ``block`` tokens after the prefill: the first stage exempts no more slots than the head keeps,
    so every exempt slot is kept and the eviction is decided by the scores (before, for blocks over the budget, 3 to
    28 exempt slots were evicted, the oldest first)."""
    out_proj = torch.randn(24, HQ * D, generator=torch.Generator().manual_seed(5))
    eng = CompressedKV(make_method(f"criticalkv[window={W}]"), C, num_layers=1, kernels="torch")
    eng.layer_context = [LayerContext(out_proj=out_proj)]
    q, k, v = _case(S, 1)
    eng.prefill_layer(0, q, k, v, None, D**-0.5)
    seen = {}
    method = eng.method
    rule = type(method).decode_scores

    def spy(inputs):
        out = rule(method, inputs)
        seen.update(scores=out.clone(), positions=inputs.positions.clone(), valid=inputs.valid.clone())
        return out

    method.decode_scores = spy
    q2, k2, v2 = _case(block, 2)
    eng.append(0, k2, v2)
    eng.decode_attention(0, q2, D**-0.5)
    store = eng.layers[0]
    for h in range(HKV):
        kept = set(store.positions[0, h][store.valid[0, h]].tolist())
        assert len(kept) == C
        exempt = (seen["scores"][0, h] >= FIRST) & seen["valid"][0, h]
        exempt_positions = set(seen["positions"][0, h][exempt].tolist())
        assert exempt_positions <= kept, (h, sorted(exempt_positions - kept))
        assert len(exempt_positions) == int((C + 1) * 0.5) - W  # the single step's count, the window outside


def test_a_single_token_step_of_criticalkv_is_unchanged():
    """No target at a single-token step (the fused kernels' form): the held slots size the stage, as before."""
    from slake.methods.base import DecodeInputs

    m = make_method(f"criticalkv[window={W}]")
    n = C + 1
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, HQ, 1, n, generator=g), -1)
    positions = torch.arange(n).view(1, 1, n).expand(1, HKV, n).contiguous()
    valid = torch.ones(1, HKV, n, dtype=torch.bool)
    common = dict(
        probs=probs, positions=positions, valid=valid, stored=torch.zeros(1, HKV, n),
        values=torch.randn(1, HKV, n, D, generator=g),
        layer=LayerContext(out_proj=torch.randn(24, HQ * D, generator=g)),
    )  # fmt: skip
    plain = m.decode_scores(DecodeInputs(**common))
    targeted = m.decode_scores(DecodeInputs(**common, target=torch.full((1, HKV), C)))
    assert torch.equal(plain, targeted)
    assert int((plain[0, 0] >= FIRST).sum()) == int(n * 0.5) - W


def test_ada_criticalkv_refuses_a_chunked_prefill():
    eng = CompressedKV(make_method("ada-criticalkv", window=W), C, 1, kernels="torch")
    with pytest.raises(ValueError, match="ada-criticalkv cannot prefill in chunks"):
        eng.begin_chunked_prefill(torch.zeros(1, 100, dtype=torch.bool))


def _adakv_pyramid(layers: int, selectable: int, prompt: int, window: int, beta: int = 20) -> list[int]:
    """FFY0/AdaKV ``AdaptiveSnapKVCluster.update_kv`` with ``pyram_mode``, transcribed (selectable budgets)."""
    out = []
    for layer in range(layers):
        min_num = selectable // beta
        max_num = selectable * 2 - min_num
        if max_num >= prompt - window:
            max_num = prompt - window
            min_num = selectable * 2 - max_num
        steps = (max_num - min_num) // (layers - 1)
        out.append(max_num - layer * steps)
    return out


@pytest.mark.parametrize(("budget", "prompt"), [(128, 150), (128, 180), (128, 400), (1024, 1500), (2048, 3000)])
def test_ada_pyramidkv_follows_adakvs_pyramid_at_every_compressed_prompt(budget, prompt):
    layers, w = 30, 32
    sel = budget - w
    ours = make_method("ada-pyramidkv[exact=false]").pyramid_schedule(layers, sel, prompt).tolist()
    assert ours == _adakv_pyramid(layers, sel, prompt, w)  # before: uniform below 2 C'
    exact = make_method("ada-pyramidkv").pyramid_schedule(layers, sel, prompt)
    assert int(exact.sum()) == layers * sel and int(exact.max()) <= prompt - w
    assert int(exact[0]) > int(exact[-1])  # a pyramid, not the uniform split
    # PyramidKV itself keeps KVCache-Factory's fallback to uniform budgets below 2 C'
    pyramid = make_method("pyramidkv").pyramid_schedule(layers, sel, prompt)
    if prompt < 2 * sel:
        assert pyramid.tolist() == [sel] * layers
