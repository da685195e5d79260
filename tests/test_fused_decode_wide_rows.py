"""Rows wider than the fused kernels' vectors, read in blocks (:mod:`slake.kernels.triton_wide`, lowered to rows of
more than 16 slots in blocks of 16 by the fixture ``wide_rows``), against the torch step in the transformers engine
and the vLLM pool: every rule's slots, scores, outputs and linear state, the order by position each row keeps (held,
scrambled, mended after an eviction across heads), ties taken in slot order; and where the order buffer is kept."""

from __future__ import annotations

import pytest
import torch

import fused_cases
from fused_cases import BS, DEVICE, FUSED, D, H, _assert_order_held, _assert_same, _method, _pool_run, _run
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import FlashAttnLayout
from slake.kernels import launch_config
from slake.methods import make_method

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free

#: the fixtures, bound here by name (imported, each test's argument of that name would redefine it: ruff's F811)
split_rows = fused_cases.split_rows
wide_rows = fused_cases.wide_rows


@pytest.mark.parametrize("name", ["snapkv", "slake", "h2o", "keydiff", "expected-attention", "criticalkv"])
def test_the_pools_wide_rows_are_read_in_blocks(name, wide_rows):
    """The vLLM pool's rows of 25 slots in blocks of 16 (``wide_rows``): the torch pool step's outputs, slots and
    scores, and for the pooled rules each row's order left as the narrow form leaves it (the rows' order buffers
    hold another request's or nothing at first: each row's first step lists its slots in slot order)."""
    ref, ref_cache, ref_out = _pool_run(name, "torch", FlashAttnLayout(), True)
    fused, cache, out = _pool_run(name, "triton", FlashAttnLayout(), True)
    assert fused.report.summary() == "triton"
    for a, b in zip(ref_out, out, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.valid, fused.valid) and torch.equal(ref.positions, fused.positions)
    torch.testing.assert_close(fused.scores, ref.scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref_cache, cache)
    if fused.order is not None:
        _assert_order_held(fused.order[:, :3], fused.positions[:, :3], fused.valid[:, :3])


@pytest.mark.parametrize("name", FUSED)
def test_rows_wider_than_the_kernels_vectors_are_read_in_blocks(name, wide_rows, split_rows):
    """Rows wider than the second kernel's vectors take (a budget of 16K or more, e.g. half of a 64K prompt) ran the
    torch step; the blockwise form (``slake.kernels.triton_wide``) computes every rule's scores, victims and
    bookkeeping over the row in blocks, the pooled rules' order by position read from the row's order buffer (the
    prefill's slot order at the first step, the previous step's after it). The padded batch of
    ``test_fused_step_equals_the_torch_step_for_every_method``, random keys and values in empty slots, rows of 17 to
    24 slots in blocks of 16: the torch step's slots, scores, outputs and linear state."""
    method = _method(name)
    ref, ref_out = _run(method, "torch", garbage=True, steps=4)
    fused, fused_out = _run(method, "triton", garbage=True, steps=4)
    assert any(s.valid.shape[-1] > 16 for s in fused.layers)  # per-layer budgets: some rows narrower
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


def test_a_row_truly_wider_than_the_kernels_vectors_takes_the_blockwise_form():
    """The launch constants as a GPU runs them (``WIDE_SLOTS`` 16,384, blocks of 1,024): SLAKE at a budget of 16,584
    over a prompt of 16,684 tokens (one KV head, two steps), the torch step's slots, scores, outputs and linear
    state."""
    width = launch_config.WIDE_SLOTS
    kwargs = dict(B=1, H=1, G=2, S=width + 300, budget=width + 200, steps=2, layers=1, pad=False)
    method = _method("slake")
    ref, ref_out = _run(method, "torch", **kwargs)
    fused, fused_out = _run(method, "triton", **kwargs)
    assert fused.layers[0].valid.shape[-1] > width
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


@pytest.mark.parametrize("name", ["snapkv", "slake", "cake"])
def test_a_wide_rows_order_is_made_anew_when_it_does_not_hold(name, wide_rows):
    """The blockwise form trusts the row's order buffer only when it proves to be the order by position; a buffer
    scrambled before a step (neither the previous step's order nor the prefill's slot order) has each slot's rank
    counted anew: the torch step's slots and scores. Meddled before the second step: the valid slots' positions
    permuted within each row, the order buffer zeroed."""

    def scramble(eng):
        for st in eng.layers:
            perm = torch.randperm(st.positions.shape[-1], generator=torch.Generator().manual_seed(3))
            for t in (st.positions, st.valid, st.keys, st.values, st.scores):
                t.copy_(t[:, :, perm].clone())
            if st._order is not None:
                st._order.zero_()

    method = _method(name)
    ref, ref_out = _run(method, "torch", steps=4, meddle=(1, scramble))
    fused, fused_out = _run(method, "triton", steps=4, meddle=(1, scramble))
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


@pytest.mark.parametrize(
    "name", ["criticalkv", "criticalkv[scorer=expected-attention,window=0]", "criticalkv[sinks=3]"]
)
def test_the_two_stages_over_wide_rows_choose_tied_slots_in_slot_order(name, wide_rows):
    """CriticalKV's first stage over a row read in blocks (a radix select of its threshold, ``wide_two_stage``) when
    most base scores are equal: every kept key zeroed before the first step makes the row's attention uniform, so
    the threshold falls among tied slots, which the first stage takes in slot order as a stable sort does (the
    tokens appended after differ). The torch step's slots, scores and weights."""

    def zero_keys(eng):
        for st in eng.layers:
            st.keys.zero_()

    kwargs = dict(steps=4, meddle=(0, zero_keys), S=60, budget=40)
    ref, ref_out = _run(_method(name), "torch", **kwargs)
    fused, fused_out = _run(_method(name), "triton", **kwargs)
    assert fused.layers[0].valid.shape[-1] > 32  # three blocks or more
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


@pytest.mark.parametrize(
    "spec, steps",
    [("kvzip[decode_scope=layer]", 5), ("ada-criticalkv[decode_scope=layer]", 3)],  # AdaKV's SnapKV: the order test
)  # fmt: skip
def test_an_eviction_across_a_layers_heads_reads_wide_rows_in_blocks(spec, steps, wide_rows, split_rows):
    """Across a layer's KV heads (``decode_scope=layer``, ``slake.kernels.triton_layer``), rows wider than the
    kernels' vectors: the second kernel's blockwise form scores them (the positional pooling from the order buffer,
    the slots the third kernel evicted dropped from it first), its tail reads each head's row back in blocks of 16
    and keeps a running set of the head's lowest slots, the third kernel evicts. The torch step's slots, scores and
    outputs, over enough steps for the heads to grow and shrink."""
    kwargs = dict(G=1, H=3, steps=steps, garbage=True, S=60, budget=40)
    ref, ref_out = _run(_method(spec), "torch", **kwargs)
    fused, fused_out = _run(_method(spec), "triton", **kwargs)
    assert all(s.valid.shape[-1] > 32 for s in fused.layers)  # three blocks or more
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


def test_the_order_of_wide_rows_is_mended_after_an_eviction_across_heads(wide_rows, monkeypatch):
    """The layer kernel evicts after the second kernel wrote each row's order; the next step's second kernel drops
    those slots from the order (``triton_wide._drop_evicted``), which then holds: no row's order is listed again in
    slot order after its first step (the prefill's), nor counted anew. Counted through the interpreter, which calls
    the kernels' helpers as Python functions."""
    from slake.kernels import triton_wide

    calls = {"_list_slot_order": 0, "_count_ranks": 0}
    for name in calls:
        helper = getattr(triton_wide, name)

        def counting(*args, _helper=helper, _name=name, **kwargs):
            calls[_name] += 1
            return _helper(*args, **kwargs)

        monkeypatch.setattr(triton_wide, name, counting)
    B, H, layers = 2, 3, 2
    ref, ref_out = _run(_method("ada-snapkv[decode_scope=layer]"), "torch", B=B, H=H, G=1, S=60, budget=40, steps=5)
    fused, fused_out = _run(_method("ada-snapkv[decode_scope=layer]"), "triton", B=B, H=H, G=1, S=60, budget=40,
                            steps=5)  # fmt: skip
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    assert calls == {"_list_slot_order": B * H * layers, "_count_ranks": 0}, calls


def test_a_pooled_rule_without_its_order_keeps_the_torch_step_for_wide_rows(wide_rows, monkeypatch):
    """The blockwise form ranks a pooled rule's slots in the row's order buffer, which it writes: a store that keeps
    none (an engine that does not keep the order) is not handed a placeholder to write into, it keeps the torch step
    and says so."""
    from slake.cache import decoding

    monkeypatch.setattr(decoding, "keeps_order", lambda method, kernels: False)
    eng, _ = _run(_method("snapkv"), "triton", steps=2, layers=1)
    assert eng.decoder.report.steps == {"torch": 2}
    assert "rows wider than 16 slots without their order by position" in eng.decoder.report.summary()


def test_a_layer_that_does_not_evict_takes_the_kernels_at_any_width(monkeypatch):
    """A layer that does not evict holds no row in the second kernel's vectors (``KEEP_ALL``), so rows of any width
    run its plain form: SLAKE compressed at prefill to a budget of 32K and decoded append-only (kvpress's protocol at
    64K) ran the torch step on a GPU. Rows truly wider than ``WIDE_SLOTS`` (grown by that much at the first token,
    mostly empty)."""
    from slake.cache import state

    method = _method("slake[decode_eviction=false]")
    monkeypatch.setattr(state, "_GROWTH", launch_config.WIDE_SLOTS + 100)  # the first append widens the rows
    kwargs = dict(B=1, H=1, G=2, steps=2, layers=1)
    ref, ref_out = _run(method, "torch", **kwargs)
    fused, fused_out = _run(method, "triton", **kwargs)
    assert fused.layers[0].valid.shape[-1] > launch_config.WIDE_SLOTS
    assert fused.layers[0].linear is not None
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


def test_the_slots_order_is_kept_where_the_kernels_read_it_and_counted_as_memory():
    """Only a fused step whose rule pools by position keeps the order (SnapKV's, CAKE's, SLAKE's, CriticalKV's two
    stages over SnapKV's scores, across a layer's KV heads too; not the torch step); its 4 bytes per slot count in
    the store's metadata and the pool's row bytes; an order of another dtype or layout than the positions' is
    refused, not misread."""
    from slake.cache.fused_step import keeps_order

    for name in ("snapkv", "cake", "slake", "ada-snapkv", "criticalkv", "ada-snapkv[decode_scope=layer]"):
        assert keeps_order(make_method(name), "triton") and not keeps_order(make_method(name), "torch")
    for name in ("h2o", "tova", "keydiff", "streamingllm", "kvzip[decode_scope=layer]",
                 "criticalkv[scorer=expected-attention,window=0]"):  # fmt: skip
        assert not keeps_order(make_method(name), "triton")
    torch_eng, _ = _run(_method("snapkv"), "torch", steps=1)
    fused, _ = _run(_method("snapkv"), "triton", steps=1)
    for a, b in zip(torch_eng.layers, fused.layers, strict=True):
        assert a._order is None and b._order is not None
        slots = b.positions.numel()
        assert b.byte_counts()["metadata"] - a.byte_counts()["metadata"] == 4 * slots
    pools = {k: DecodePool(_method("snapkv"), 2, H, D, 10, BS, rows=2, kernels=k, device=DEVICE)
             for k in ("torch", "triton")}  # fmt: skip
    assert pools["torch"].order is None and pools["triton"].order.shape == pools["triton"].positions.shape
    assert pools["triton"].row_bytes()[0] - pools["torch"].row_bytes()[0] == 2 * H * 10 * 4
    st = fused.layers[0]
    other_layout = st.kernel_order().transpose(0, 1).contiguous().transpose(0, 1)
    st._order = other_layout
    assert st.kernel_order() is not other_layout  # made again in the positions' layout, not misread
    assert st.kernel_order().stride() == st.positions.stride()
    st._order = st.kernel_order().long()
    fused.append(0, torch.randn(2, 2, 1, 16, device=DEVICE), torch.randn(2, 2, 1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="order must be int32 with the strides"):
        fused.decode_attention(0, torch.randn(2, 4, 1, 16, device=DEVICE), 0.25)
