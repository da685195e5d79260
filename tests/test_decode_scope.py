"""A decode eviction across a layer's KV heads (``decode_scope="layer"``, :mod:`slake.methods.decode_scope`): the
layer keeps its size, its heads grow and shrink within the widest prefill head, victims are the layer's lowest
unprotected slots; with equal head budgets it is the per-head rule; the fused kernels evict as the torch step does."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.cache.decode_step import layer_victims
from slake.methods import make_method

INF = float("inf")
B, H, G, D, S = 2, 3, 2, 8, 48


def _engine(spec: str, budget: int = 16, layers: int = 2, seed: int = 0, static: int | None = None, **kw):
    """Prefill ``layers`` random layers of a padded GQA batch (three KV heads)."""
    g = torch.Generator().manual_seed(seed)
    method = make_method(spec)
    eng = CompressedKV(method, budget, layers, **kw)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, :5] = True
    if method.second_pass is not None:  # KVzip: its reconstruction scores, skewed so that the heads differ widely
        eng.pass_scores = torch.rand(layers, B, H, S, generator=g) ** torch.tensor([1.0, 4.0, 12.0]).view(1, 1, H, 1)
    for li in range(layers):
        q, k, v = (
            torch.randn(B, H * G, S, D, generator=g),
            torch.randn(B, H, S, D, generator=g),
            torch.randn(B, H, S, D, generator=g),
        )
        eng.prefill_layer(li, q, k * (1 + torch.arange(H).view(1, H, 1, 1)), v, padding, D**-0.5)
    if static is not None:
        eng.prepare_static(static)
    return eng, g


def _decode(eng, g, steps: int, tokens: int = 1):
    outs = []
    for _ in range(steps):
        for li in range(eng.num_layers):
            eng.append(li, torch.randn(B, H, tokens, D, generator=g), torch.randn(B, H, tokens, D, generator=g))
            outs.append(eng.decode_attention(li, torch.randn(B, H * G, tokens, D, generator=g), D**-0.5))
    return outs


def test_layer_victims_take_the_forced_slots_then_the_lowest_of_the_layer():
    # row 0: head 0 holds 4 slots over the widest target (3): its lowest (slot 0) goes whatever the others score;
    # the layer holds 7 against 4: two more go, the lowest of the layer (head 1's 0.5 and 2.0), not head 0's 4.0.
    # row 1: no eviction (target -1). Protected slots (+inf) stay while evictable ones remain.
    ranked = torch.tensor([[[1.0, 5.0, INF, 4.0], [2.0, 0.5, 3.0, INF]], [[0.1, 0.2, 0.3, INF], [0.1, INF, INF, INF]]])
    valid = torch.tensor([[[1, 1, 1, 1], [1, 1, 1, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]]], dtype=torch.bool)
    target = torch.tensor([[3, 1], [-1, -1]])
    forced = torch.zeros_like(valid)
    forced[0, 0, 0] = True
    mask = layer_victims(ranked, valid, valid.sum(-1), target, forced, 3)
    expected = torch.zeros_like(valid)
    expected[0, 0, 0] = expected[0, 1, 1] = expected[0, 1, 0] = True
    assert torch.equal(mask, expected)


def test_layer_victims_never_take_an_empty_slot_and_take_protected_ones_last():
    ranked = torch.tensor([[[INF, INF, INF], [INF, 7.0, INF]]])
    valid = torch.tensor([[[1, 1, 0], [1, 1, 0]]], dtype=torch.bool)
    mask = layer_victims(ranked, valid, valid.sum(-1), torch.tensor([[1, 1]]), torch.zeros_like(valid), 2)
    assert mask.sum() == 2 and mask[0, 1, 1] and not mask[0, :, 2].any()


def test_layer_victims_take_tied_slots_in_the_layers_slot_order():
    """Equal scores go head by head, slot by slot (as the fused kernels take them): against a stable sort of the
    layer's slots, over scores drawn from four values (ties everywhere), protected and empty slots, forced ones."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        R, Hk, W = 3, 4, 6
        ranked = torch.randint(0, 4, (R, Hk, W), generator=g).float()
        ranked[torch.rand(R, Hk, W, generator=g) < 0.2] = INF
        valid = torch.rand(R, Hk, W, generator=g) < 0.8
        ranked[~valid] = INF
        forced = torch.zeros_like(valid)
        forced[:, 0, 0] = valid[:, 0, 0] & (torch.rand(R, generator=g) < 0.5)
        target = torch.randint(1, W, (R, Hk), generator=g)
        target[0] = -1
        counts = valid.sum(-1)
        mask = layer_victims(ranked, valid, counts, target, forced, Hk)
        need = torch.maximum((counts.sum(-1) - target.sum(-1)).clamp_min(0), forced.sum((-1, -2)))
        need = need.masked_fill(target[:, 0] < 0, 0).clamp(max=Hk)
        flat = ranked.masked_fill(forced, -INF).view(R, -1)
        idx = torch.sort(flat, dim=-1, stable=True).indices[:, :Hk]
        chosen = (torch.arange(Hk) < need[:, None]) & valid.view(R, -1).gather(-1, idx)
        expected = torch.zeros_like(valid).view(R, -1).scatter_(-1, idx, chosen).view(R, Hk, W)
        assert torch.equal(mask, expected)
        assert not mask[0].any() and bool((mask <= valid).all())


@pytest.mark.parametrize("spec", ["kvzip[decode_scope=layer]", "ada-snapkv[decode_scope=layer,window=4]"])
def test_the_layer_keeps_its_size_and_heads_move_within_the_widest(spec):
    eng, g = _engine(spec)
    targets = [t.clone() for t in eng.targets]
    before = [st.counts().clone() for st in eng.layers]
    assert all(torch.equal(c, t) for c, t in zip(before, targets, strict=True))  # the prefill's head sizes
    assert any(len(set(t[b].tolist())) > 1 for t in targets for b in range(B)), "the heads must differ"
    _decode(eng, g, 12)
    moved = False
    for st, t, c0 in zip(eng.layers, targets, before, strict=True):
        c = st.counts()
        assert torch.equal(c.sum(-1), t.sum(-1)), "the layer's size changed"
        assert bool((c <= t.amax(-1, keepdim=True)).all()), "a head grew past the widest prefill head"
        moved |= not torch.equal(c, c0)
    assert moved, "no head grew or shrank: the eviction stayed per head"
    assert eng.decoder.report.summary() == "torch"


def test_equal_head_budgets_make_the_layer_rule_the_head_rule():
    """AdaKV with ``alpha_safeguard=1`` splits every layer evenly: each head is at the widest, so each step's
    victims are each head's lowest, as with one eviction per head."""
    base = "ada-snapkv[window=4,alpha_safeguard=1.0"
    ref, g1 = _engine(base + "]")
    lay, g2 = _engine(base + ",decode_scope=layer]")
    out_ref, out_lay = _decode(ref, g1, 6), _decode(lay, g2, 6)
    for a, b in zip(out_ref, out_lay, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for sa, sb in zip(ref.layers, lay.layers, strict=True):
        assert torch.equal(sa.valid, sb.valid) and torch.equal(sa.positions, sb.positions)


def test_static_mode_and_several_tokens_keep_the_layer_rule():
    """Fixed shapes (one free slot per row, as compiled decoding has) give the eager step's results; a multi-token
    append is evicted back by the same rule (the general path)."""
    eager, g1 = _engine("kvzip[decode_scope=layer]")
    static, g2 = _engine("kvzip[decode_scope=layer]", static=10)
    for a, b in zip(_decode(eager, g1, 8), _decode(static, g2, 8), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for sa, sb in zip(eager.layers, static.layers, strict=True):
        assert torch.equal(sa.counts(), sb.counts())
    many, g3 = _engine("kvzip[decode_scope=layer]")
    _decode(many, g3, 2, tokens=5)
    for st, t in zip(many.layers, many.targets, strict=True):
        c = st.counts()
        assert torch.equal(c.sum(-1), t.sum(-1)) and bool((c <= t.amax(-1, keepdim=True)).all())


def test_fused_kernels_evict_across_the_layers_heads_as_the_torch_step_does():
    """The fused kernels' third kernel (``slake.kernels.triton_layer``) over this file's layers, whose heads differ
    widely: the torch step's slots and outputs (``tests/test_fused_decode.py`` checks more layouts)."""
    pytest.importorskip("triton")
    fused, g1 = _engine("kvzip[decode_scope=layer]", kernels="triton")
    ref, g2 = _engine("kvzip[decode_scope=layer]")
    out_fused, out_ref = _decode(fused, g1, 3), _decode(ref, g2, 3)
    assert fused.decoder.report.summary() == "triton"
    for a, b in zip(out_ref, out_fused, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5)
    for sa, sb in zip(ref.layers, fused.layers, strict=True):
        assert torch.equal(sa.valid, sb.valid) and torch.equal(sa.positions, sb.positions)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_keep_generated_evicts_the_context_before_any_generated_token(scope):
    """KVzip's ``keep_generated``: while a head (or, across heads, the layer) holds evictable context, every
    generated token stays; without it, a new token scores on the step's spread attention against the
    reconstruction's peaked maxima and some go at once."""
    steps = 6

    def generated_held(spec):
        eng, g = _engine(spec)
        prompt_end = eng.seen[0]
        _decode(eng, g, steps)
        held = []
        for st in eng.layers:
            gen = (st.positions >= prompt_end) & st.valid  # (B, H, W)
            first = 4 + 5 * (torch.arange(B) == 0).view(B, 1, 1)  # past the sinks (row 0 is padded by 5)
            context = st.valid & (st.positions < prompt_end) & (st.positions >= first)
            held.append((gen.sum(-1), context.sum(-1)))
        return held

    for kept, context in generated_held(f"kvzip[keep_generated=true,decode_scope={scope}]"):
        room = context > 0 if scope == "head" else (context.sum(-1, keepdim=True) > 0).expand_as(context)
        assert bool((kept[room] == steps).all()), (kept, context)
    assert any(bool((k < steps).any()) for k, _ in generated_held(f"kvzip[decode_scope={scope}]"))


def test_decode_scope_is_checked():
    with pytest.raises(ValueError, match="decode_scope must be one of"):
        make_method("kvzip[decode_scope=row]")
    with pytest.raises(ValueError, match="linear state"):
        make_method("ada-snapkv[decode_scope=layer,linear_cache=true]")
    assert not make_method("kvzip[decode_scope=layer,decode_eviction=false]").evicts_across_heads
    assert not make_method("snapkv").evicts_across_heads


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_keep_generated_tells_a_context_pair_at_attention_one_from_a_generated_token(kernels):
    """A context pair whose stored score is exactly 1 (a query attended to it alone) is still context: with
    ``keep_generated`` it goes before any generated token. Before generated tokens carried ``2 +`` their maximum,
    a stored score of 1 marked a slot as generated, and such pairs outranked the tokens being written."""
    if kernels == "triton":
        pytest.importorskip("triton")
    steps = 6
    eng, g = _engine("kvzip[keep_generated=true]", kernels=kernels)
    prompt_end = eng.seen[0]
    eng.pass_scores = None
    for st in eng.layers:  # every context pair of KV head 0 scored exactly 1, as a fully attended pair would be
        st.scores[:, 0] = torch.where(st.valid[:, 0] & (st.scores[:, 0] < INF), 1.0, st.scores[:, 0])
    _decode(eng, g, steps)
    for st in eng.layers:
        first = 4 + 5 * (torch.arange(B) == 0).view(B, 1)  # past the sinks (row 0 is padded by 5)
        context = st.valid[:, 0] & (st.positions[:, 0] < prompt_end) & (st.positions[:, 0] >= first)
        kept = ((st.positions[:, 0] >= prompt_end) & st.valid[:, 0]).sum(-1)
        assert bool((kept[context.sum(-1) > 0] == steps).all()), (kept, context.sum(-1))
