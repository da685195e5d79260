"""The fused decode kernels (:mod:`slake.kernels.triton_decode`, through Triton's interpreter on the CPU) against
the torch step (:func:`slake.cache.decode_step.decode_step`) over rows the kernels hold whole: the same victims, kept
slots, keys and values, and the same outputs, scores and linear state within float32 rounding, for every method with
decode eviction, in the transformers engine's dense store (padded batches, GQA and MHA, per-head budgets, 8-bit and
half-precision storage), in the vLLM pool's paged layouts and under torch.compile; the pooling's order of slots (the
kernels' helpers probed alone, and the order a store keeps). Rows read in blocks:
``tests/test_fused_decode_wide_rows.py``; launches, launch arguments and the choice of kernels:
``tests/test_fused_decode_launches.py``; through a model: ``tests/test_fused_decode_models.py``."""

from __future__ import annotations

import pytest
import torch

import fused_cases
from fused_cases import DEVICE, FUSED, _assert_order_held, _assert_same, _layer_context, _method, _pool_run, _run
from slake.cache.compressed import CompressedKV
from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout
from slake.kernels import launch_config

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free

#: the fixture, bound here by name (imported, each test's argument of that name would redefine it: ruff's F811)
split_rows = fused_cases.split_rows


@pytest.mark.parametrize("name", FUSED)
def test_fused_step_equals_the_torch_step_for_every_method(name, split_rows):
    """A padded GQA batch of two sequences, two layers (CAKE/SLAKE give them different budgets), three steps, each
    row split over several programs of the first kernel. Empty slots hold random keys and values, as a freed slot
    keeps its last token's until the next write: no rule may read them (one run checks both, the interpreter's
    time being most of the unit tier's)."""
    method = _method(name)
    ref, ref_out = _run(method, "torch", garbage=True)
    fused, fused_out = _run(method, "triton", garbage=True)
    assert any(int((~s.valid).sum()) > s.valid.shape[0] * s.valid.shape[1] for s in fused.layers)  # still some
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


@pytest.mark.parametrize(
    "name, options",
    [
        ("slake", {"G": 1, "H": 3}),  # MHA
        ("slake", {"G": 3, "H": 2}),  # a group that is not a power of two (padded rows in both row layouts)
        ("tova", {"G": 1, "H": 3}),
        ("h2o", {"G": 4, "H": 1, "pad": False, "B": 1}),
        ("slake", {"kv_dtype": "int8"}),
        ("snapkv", {"kv_dtype": "fp8_e4m3"}),
        ("slake[linear_cache=false]", {}),  # evicts before the output, without the linear term
        ("cake[linear_cache=true]", {}),  # the linear term, evicting after the output
        ("ada-snapkv", {"budget": 20}),  # per-head budgets
        ("keydiff", {"kv_dtype": "int8", "G": 1, "H": 3}),  # a rule reading the kept keys: dequantised, MHA
        ("kvzip", {"G": 4, "H": 1, "pad": False, "B": 1}),
        ("kvzip[keep_generated=true]", {"steps": 5}),  # generated tokens rank above the context
        ("expected-attention", {"G": 1, "H": 3, "kv_dtype": "int8"}),  # mapped queries and value norms, dequantised
        ("criticalkv", {"kv_dtype": "fp8_e4m3"}),  # the new slot's projection reads its dequantised value
        ("ada-criticalkv", {"budget": 20, "G": 4, "H": 1}),  # per-head budgets, a group of four
        ("criticalkv[scorer=expected-attention,window=0]", {}),  # two stages over the mapped queries' softmax
        ("criticalkv[sinks=2]", {}),  # the protected slots (sinks of a padded row too) take first-stage places first
        ("ada-criticalkv[sinks=3]", {"budget": 20}),  # per-head budgets, with sinks counted in each first stage
        # head sizes that are not a power of two (Phi-3's 96, StableLM's 80): the kernels' head lanes are masked
        ("slake", {"D": 24, "G": 7, "H": 2}),  # and a group of seven (Qwen2.5-0.5B's 14 query heads over 2)
        ("criticalkv", {"D": 20, "kv_dtype": "int8"}),
        ("expected-attention", {"D": 40, "G": 3}),  # the rotary map's pairs over the masked lanes
        ("keydiff", {"D": 80, "G": 1, "H": 2, "B": 1, "pad": False}),
        # an eviction across a layer's KV heads (the third kernel): per-head budgets, heads forced down to the widest
        # target, MHA, and as many steps as heads so that heads grow and shrink
        ("ada-snapkv[decode_scope=layer]", {"budget": 20, "H": 3, "steps": 3}),
        ("kvzip[decode_scope=layer]", {"G": 1, "H": 3, "steps": 5}),
        ("kvzip[decode_scope=layer,keep_generated=true]", {"B": 3, "kv_dtype": "int8"}),
        ("ada-criticalkv[decode_scope=layer]", {"budget": 20}),  # two stages, then across the heads
        ("ada-expected-attention[decode_scope=layer]", {"budget": 20, "G": 1, "H": 3, "steps": 4}),
    ],
)
def test_fused_step_covers_head_layouts_storage_and_eviction_orders(name, options, split_rows):
    method = _method(name)
    ref, ref_out = _run(method, "torch", **options)
    fused, fused_out = _run(method, "triton", **options)
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


def test_positional_pooling_sorts_long_keys_as_it_sorts_short_ones(monkeypatch, split_rows):
    """The positional pooling sorts int32 keys where the row's positions allow (``launch_config.key_span``) and
    int64 keys otherwise; with the short keys switched off the step is the same as the torch step."""
    monkeypatch.setattr(launch_config, "SHORT_KEYS", False)
    for name in ("slake", "ada-snapkv"):
        method = _method(name)
        ref, ref_out = _run(method, "torch", garbage=True)
        fused, fused_out = _run(method, "triton", garbage=True)
        _assert_same(ref, ref_out, fused, fused_out, 1e-5)


def test_the_position_order_ranks_valid_slots_by_position_with_keys_of_either_width():
    """:func:`slake.kernels.triton_pooling.position_order` on rows whose positions span less than the int32 keys'
    limit, exactly the limit, and far more: the valid slots by position, then the empty ones and those past the
    row's width by slot (a 32-bit key would overflow in the last two and rank them wrongly)."""
    from slake.kernels import load

    load()  # the interpreter on a machine without CUDA, before kernel_probes imports Triton
    from kernel_probes import order_kernel

    BW, W = 16, 13
    limit = launch_config.key_span(BW)
    assert limit == (1 << 31) // BW - 2
    g = torch.Generator().manual_seed(0)
    for span in (40, limit - 1, limit, 1 << 36):
        for trial in range(3):
            valid = torch.rand(W, generator=g) < 0.7
            valid[:2] = True
            pos = torch.randint(0, span + 1, (W,), generator=g)
            pos[0], pos[1] = 5, 5 + span  # the lowest and the highest valid position
            pos = torch.where(valid, pos + 1000 * trial, torch.full_like(pos, -1))
            if int(pos[valid].unique().numel()) != int(valid.sum()):
                continue  # positions of valid slots are distinct
            out = torch.empty(BW, dtype=torch.int32, device=DEVICE)
            order_kernel[(1,)](pos.to(DEVICE), valid.to(DEVICE, torch.int8), out, W, BW=BW, KEY_SPAN=limit)
            slots = torch.arange(W)
            held = slots[valid][pos[valid].argsort()]
            want = torch.cat([held, slots[~valid], torch.arange(W, BW)])
            assert torch.equal(out.cpu().long(), want), (span, trial, out, want)


def test_the_victim_found_among_ranks_is_the_one_argmin_finds_among_slots():
    """:func:`slake.kernels.triton_pooling.lane_victim` on scores with ties (a pooled row of equal attention ties
    everywhere) and guarded slots, the lanes ranked by a random order and the new token apart, and
    :func:`slake.kernels.triton_eviction.lane_argmin` on the lanes in their own order: the first lowest in slot
    order, as ``argmin`` over the slots picks it (with every slot guarded: slot 0), whether it is the new token or a
    kept slot. Ranks past ``held`` (a row's empty slots) hold any lane and are not read: the slots they leave out are
    guarded, as empty slots are. Rows whose width less one is a power of two (every lane used) and rows with lanes
    past the row."""
    from slake.kernels import load

    load()
    from kernel_probes import victim_kernel

    BW = 16
    g = torch.Generator().manual_seed(0)
    for trial in range(48):
        W = 17 if trial % 2 else 13
        newslot = int(torch.randint(0, W, (1,), generator=g))
        scores = torch.randint(0, 3, (W,), generator=g).float()  # many ties
        guard = torch.rand(W, generator=g) < (0.3 if trial % 12 < 11 else 1.1)
        lanes = torch.arange(BW)
        lslot = torch.where(lanes == newslot, W - 1, lanes)
        order = torch.randperm(BW, generator=g).to(torch.int32)
        order = torch.cat([order[order < W - 1], order[order >= W - 1]])  # the lanes past the row rank last
        held = W - 1 if trial < 24 else int(torch.randint(0, W, (1,), generator=g))
        empty = lslot[order[held:].long()]
        guard[empty[empty < W]] = True  # the unlisted lanes' slots are empty
        if held < BW:
            order[held:] = torch.randint(0, BW, (BW - held,), generator=g).to(torch.int32)
        out = torch.empty(2, dtype=torch.int32, device=DEVICE)
        victim_kernel[(1,)](scores.to(DEVICE), guard.to(DEVICE, torch.int8), order.to(DEVICE), out, W, held, newslot,
                            BW=BW)  # fmt: skip
        want = int(scores.masked_fill(guard, float("inf")).argmin())
        assert out.cpu().tolist() == [want, want], (trial, scores, guard, order, held, newslot)


def test_the_pooling_with_the_new_token_apart_pools_the_row_in_position_order():
    """:func:`slake.kernels.triton_pooling.pool_lanes` after a sort of the lanes: each valid slot's score pooled
    (average and maximum) over its neighbours in the row's position order, the new token's included wherever its
    position falls (last in a real step, anywhere here), as ``avg_pool1d``/``max_pool1d`` pool the row's scores
    sorted by position with the empty slots after them at 0."""
    from slake.kernels import load

    load()
    from kernel_probes import pool_kernel

    BW = 16
    g = torch.Generator().manual_seed(2)
    for trial in range(24):
        W = (17, 13, 9)[trial % 3]
        K, pool_max = (5, 3, 4, 7)[trial % 4], trial % 2 == 1
        newslot = int(torch.randint(0, W, (1,), generator=g))
        valid = torch.rand(W, generator=g) < (0.7 if trial % 5 else 1.1)
        valid[newslot] = False
        pos = torch.randperm(60, generator=g)[:W]
        if trial % 3 == 0:
            pos[newslot] = 100  # the newest, as in a step
        pos = torch.where(valid | (torch.arange(W) == newslot), pos, torch.full_like(pos, -1))
        scores = torch.rand(W, generator=g)
        out = torch.full((W,), -7.0, device=DEVICE)
        pool_kernel[(1,)](scores.to(DEVICE), pos.to(DEVICE), valid.to(DEVICE, torch.int8), out, W, newslot, BW=BW,
                          KEY_SPAN=launch_config.key_span(2 * BW), POOL_K=K, POOL_MAX=pool_max)  # fmt: skip
        live = valid.clone()
        live[newslot] = True
        slots = torch.arange(W)[live][pos[live].argsort()]
        row = torch.zeros(W)
        row[: slots.numel()] = scores[slots]
        if pool_max:
            padded = torch.nn.functional.pad(row, (K // 2, K - 1 - K // 2), value=float("-inf"))
        else:
            padded = torch.nn.functional.pad(row, (K // 2, K - 1 - K // 2), value=0.0)
        windows = padded.unfold(0, K, 1)
        pooled = windows.amax(1) if pool_max else windows.sum(1) / K
        want = torch.full((W,), -7.0)
        want[slots] = pooled[: slots.numel()]
        assert torch.allclose(out.cpu(), want, rtol=1e-6, atol=1e-6), (trial, out, want)


def test_a_held_order_is_used_only_when_it_proves_to_be_the_sorted_order():
    """:func:`slake.kernels.triton_pooling.listed_lanes`: the order a row's previous step left (its valid slots but
    the new token's, by position) holds, and gives those slots sorted by position; every corruption of it (empty,
    reordered, a slot missing, repeated, empty or out of range, the new token listed, a slot newer than the new
    token) and random buffers either fail the check or give the sorted order, never another. Rows whose new token
    is in the last slot and rows whose last slot sits in the new token's lane."""
    from slake.kernels import load

    load()
    from kernel_probes import listed_kernel

    BW = 16
    g = torch.Generator().manual_seed(1)

    def check(buf, pos, valid, newslot, W) -> int:
        out = torch.empty(BW, dtype=torch.int32, device=DEVICE)
        holds = torch.empty(1, dtype=torch.int32, device=DEVICE)
        padded = torch.zeros(BW, dtype=torch.int32)
        padded[: buf.numel()] = buf
        listed_kernel[(1,)](padded.to(DEVICE), pos.to(DEVICE), valid.to(DEVICE, torch.int8), out, holds, W, newslot,
                            BW=BW)  # fmt: skip
        slots = torch.arange(W)
        want = slots[valid][pos[valid].argsort()]
        if int(holds.cpu()):
            assert torch.equal(out.cpu()[: want.numel()].long(), want), (buf, pos, valid, newslot, out)
        return int(holds.cpu())

    rejected = 0
    for trial in range(40):
        W = 17 if trial % 2 else 13
        valid = torch.rand(W, generator=g) < 0.7
        if trial % 4 == 1:
            newslot = W - 1
        else:
            newslot = int(torch.nonzero(~valid)[0]) if (~valid).any() else 0
        valid[newslot] = False
        pos = torch.randperm(100, generator=g)[:W]
        pos[newslot] = 100 + trial  # the new token's position: the newest
        pos = torch.where(valid | (torch.arange(W) == newslot), pos, torch.full_like(pos, -1))
        held = torch.arange(W)[valid][pos[valid].argsort()].to(torch.int32)
        assert check(held, pos, valid, newslot, W) == 1, "the order a step left must hold"
        n = held.numel()
        corrupt = [torch.zeros(n, dtype=torch.int32), torch.randint(-3, BW + 3, (n,), generator=g).to(torch.int32)]
        if n >= 2:
            corrupt += [held.flip(0), torch.cat([held[1:], held[:1]]), torch.cat([held[:1], held])[:n]]
            corrupt.append(torch.cat([held[:-1], torch.tensor([newslot], dtype=torch.int32)]))
        if n >= 1 and (~valid).sum() > 1:
            empty = int(torch.nonzero(~valid & (torch.arange(W) != newslot))[0])
            corrupt.append(torch.cat([held[:-1], torch.tensor([empty], dtype=torch.int32)]))
        for buf in corrupt:
            if not torch.equal(buf, held):
                rejected += 1 - check(buf, pos, valid, newslot, W)
        if n >= 1:  # a valid slot newer than the new token: the sorted order does not end with it
            late = pos.clone()
            late[held[-1].long()] = 200 + trial
            assert check(held, late, valid, newslot, W) == 0
    assert rejected > 80


def test_the_fused_step_keeps_each_rows_order_and_survives_a_corrupted_one(monkeypatch):
    """After fused steps, the order a store keeps (``LayerStore.kernel_order``) lists each row's valid slots by
    position, and the next step sorts no row (counted in the interpreter); random contents written into it between
    steps change nothing but the sorts."""
    from slake.kernels import load, triton_pooling

    load()
    sorts: list[int] = []
    if DEVICE == "cpu":  # the interpreter runs the kernels' helpers as Python: count the sorts
        sort = triton_pooling.position_order
        monkeypatch.setattr(triton_pooling, "position_order", lambda *a, **k: sorts.append(1) or sort(*a, **k))
    method = _method("snapkv")
    ref, ref_out = _run(method, "torch", steps=4, garbage=True)
    seen = []
    rows = 2 * 2 * 2  # layers x rows x KV heads

    def corrupt(eng) -> None:
        if DEVICE == "cpu":
            assert len(sorts) == rows, "the first step sorts every row, the second none"
        for st in eng.layers:
            order = st.kernel_order()
            _assert_order_held(order, st.positions, st.valid)
            seen.append(order.data_ptr())
            gen = torch.Generator().manual_seed(5)
            order.copy_(torch.randint(-2, order.shape[-1] + 2, order.shape, generator=gen))

    fused, fused_out = _run(method, "triton", steps=4, garbage=True, meddle=(2, corrupt))
    assert len(seen) == 2
    if DEVICE == "cpu":
        assert len(sorts) == 2 * rows, "the step after the corruption sorts every row, the next none"
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    for st, ptr in zip(fused.layers, seen, strict=True):
        assert st.kernel_order().data_ptr() == ptr  # the same buffer, step after step
        _assert_order_held(st.kernel_order(), st.positions, st.valid)


def test_a_reordered_or_repeated_batch_keeps_each_rows_order_of_slots():
    """Beam search reorders a batch's rows (``select_batch``) and ``num_return_sequences`` repeats them
    (``repeat_batch``): each row's order of slots moves with its slots, so the next step finds it holding. It stayed
    in place, so that every row read another's order: a sort per row in the narrow form, and in the blockwise form of
    wide rows, whose slots after some steps are not in position order, each slot's rank counted against every other
    (``slake.kernels.triton_wide``)."""
    eng, _ = _run(_method("slake"), "triton", steps=3)
    st = eng.layers[0]
    before = st.kernel_order().clone()
    _assert_order_held(before, st.positions, st.valid)
    st.select_batch(torch.tensor([1, 0]))
    assert torch.equal(st.kernel_order(), before[[1, 0]])
    _assert_order_held(st.kernel_order(), st.positions, st.valid)
    st.repeat_batch(2)
    assert torch.equal(st.kernel_order(), before[[1, 1, 0, 0]])
    _assert_order_held(st.kernel_order(), st.positions, st.valid)


def test_the_two_stages_count_their_first_stage_in_float64():
    """Rows of 10 held slots at ratio 0.7: ``floor(10 * 0.7)`` is 7 in float64, as the torch rule computes it, and
    6 with the ratio rounded to float32 (a kernel's float argument is float32)."""
    method = _method("criticalkv[first_stage_ratio=0.7]")
    ref, ref_out = _run(method, "torch", budget=9)
    assert int(ref.layers[0].valid[0, 0].sum()) == 9
    assert int((ref.layers[0].scores[ref.layers[0].valid] > 1e29).sum()) > 0
    fused, fused_out = _run(method, "triton", budget=9)
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["slake", "h2o", "criticalkv", "expected-attention"])
def test_fused_step_with_a_half_precision_cache(name, dtype):
    """A half-precision model's step: the fused kernels return the query's dtype (their float32 result rounded once,
    no cast for the model to launch), the torch step float32; they agree to half precision's rounding."""
    method = _method(name)
    ref, ref_out = _run(method, "torch", dtype=dtype)
    fused, fused_out = _run(method, "triton", dtype=dtype)
    _assert_same(ref, ref_out, fused, fused_out, 2e-2)
    assert {o.dtype for o in fused_out} == {dtype} and {o.dtype for o in ref_out} == {torch.float32}


@pytest.mark.parametrize("name", ["snapkv", "slake", "criticalkv"])
def test_fp8_rows_through_their_bits_equal_the_torch_step(name, monkeypatch):
    """On GPUs where Triton has no e4m3 conversion (an A100, a T4, AMD's) the kernels write and read fp8 codes
    through integer arithmetic on their bits (``QUANT`` 3, :mod:`slake.kernels.device_support`): the same codes and
    scales bit for bit, the same victims and outputs, as the torch step (and so as the conversion's path)."""
    from slake.kernels import device_support

    monkeypatch.setattr(device_support, "FP8_BITS", True)
    method = _method(name)
    ref, ref_out = _run(method, "torch", kv_dtype="fp8_e4m3", steps=2, seed=3)
    fused, fused_out = _run(method, "triton", kv_dtype="fp8_e4m3", steps=2, seed=3)
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)


def test_the_new_token_is_quantised_as_the_torch_step_quantises_it():
    """int8 codes round half to even (``torch.round``) and fp8 codes round to nearest even across binades: the
    kernels' codes and scales are bit-identical (checked in ``_assert_same`` through ``keys``/``k_scale``) on rows
    built to hit those ties."""
    for kv_dtype in ("int8", "fp8_e4m3"):
        method = _method("snapkv")
        ref, ref_out = _run(method, "torch", kv_dtype=kv_dtype, steps=2, seed=3)
        fused, fused_out = _run(method, "triton", kv_dtype=kv_dtype, steps=2, seed=3)
        _assert_same(ref, ref_out, fused, fused_out, 1e-5)


# ---------------------------------------------------------------------------------------------- the vLLM pool
@pytest.mark.parametrize(
    "name",
    ["snapkv", "slake", "h2o", "streamingllm", "keydiff", "criticalkv", "expected-attention",
     "ada-snapkv[decode_scope=layer]"],
)  # fmt: skip
@pytest.mark.parametrize(
    "layout, row_slice", [(CpuAttnLayout(), False), (FlashAttnLayout(), True)], ids=["cpu", "flash"]
)
def test_fused_pool_step_equals_the_torch_pool_step(name, layout, row_slice, split_rows):
    ref, ref_cache, ref_out = _pool_run(name, "torch", layout, row_slice)
    fused, cache, out = _pool_run(name, "triton", layout, row_slice)
    assert fused.report.summary() == "triton" and ref.report.summary() == "torch"
    for a, b in zip(ref_out, out, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.valid, fused.valid) and torch.equal(ref.positions, fused.positions)
    torch.testing.assert_close(fused.scores, ref.scores, rtol=1e-5, atol=1e-5)  # the empty slots' too
    assert torch.equal(ref_cache, cache)
    if ref.linear is not None:
        torch.testing.assert_close(fused.linear, ref.linear, rtol=1e-5, atol=1e-5)
    if ref.weights is not None:
        torch.testing.assert_close(fused.weights[ref.valid], ref.weights[ref.valid], rtol=1e-5, atol=1e-5)
    assert (
        ref.order is None
        and (fused.order is not None) == (name in ("snapkv", "slake", "criticalkv"))
        or ("decode_scope=layer" in name)
    )
    if name in ("snapkv", "slake"):  # the step's rows keep their order for the next step (the two stages read it
        # only over rows read in blocks, and sort narrower ones)
        _assert_order_held(fused.order[:, :3], fused.positions[:, :3], fused.valid[:, :3])


# ---------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize(
    "name, wide",
    [("slake", False), ("criticalkv", False), ("expected-attention", False), ("slake", True), ("h2o", True),
     ("slake[decode_eviction=false]", False), ("ada-snapkv[decode_scope=layer]", False)],
)  # fmt: skip
def test_torch_compile_captures_the_fused_step_as_one_operator(name, wide, monkeypatch):
    """A static cache's decode step with the fused kernels compiles to one graph (``fullgraph=True``): the kernels
    are one opaque operator with declared mutations, so nothing breaks the graph; the compiled step (run through
    ``aot_eager``, which executes the operator, here in Triton's interpreter) equals the torch step and advances the
    layer's position counter. CriticalKV's kept weights and Expected Attention's per-layer map are made before the
    first captured step. ``wide``: the rows read in blocks (``WIDE_SLOTS`` lowered to 16); and a layer that keeps
    every slot (append-only); and an eviction across a layer's KV heads (the third kernel)."""
    if wide:
        monkeypatch.setattr(launch_config, "WIDE_SLOTS", 16)
        monkeypatch.setattr(launch_config, "WIDE_BLOCK", 16)
    B, H, G, D, S = 2, 2, 2, 16, 40

    def build(kernels):
        eng = CompressedKV(_method(name), 16, 1, kernels=kernels)
        g = torch.Generator().manual_seed(0)
        if eng.method.layer_facts():
            eng.layer_context = [_layer_context(torch.randn(24, H * G * D, generator=g).to(DEVICE), D)]
        eng.max_cache_len = S + 8
        q, k, v = (torch.randn(B, n, S, D, generator=g).to(DEVICE) for n in (H * G, H, H))
        eng.prefill_layer(0, q, k, v, None, D**-0.5)
        return eng

    def step(eng, q, k, v):
        eng.append(0, k, v)
        return eng.decode_attention(0, q, D**-0.5)

    torch._dynamo.reset()
    ref, fused = build("torch"), build("triton")
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for t in range(3):
        q, k, v = (torch.randn(B, n, 1, D, generator=g).to(DEVICE) for n in (H * G, H, H))
        torch.testing.assert_close(compiled(fused, q, k, v), step(ref, q, k, v), rtol=1e-5, atol=1e-5)
        assert torch.equal(fused.layers[0].valid, ref.layers[0].valid)
        assert int(fused.position[0]) == int(ref.position[0]) == S + t + 1
    torch._dynamo.reset()
    step(fused, q, k, v)  # one eager step (compiled steps record nothing): the kernels cover this layer
    assert fused.decoder.report.summary() == "triton"
