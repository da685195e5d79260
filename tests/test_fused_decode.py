"""The fused decode kernels (:mod:`slake.kernels.triton_decode`, through Triton's interpreter on the CPU) against
the torch step (:func:`slake.cache.decode_step.decode_step`): the same victims, kept slots, keys and values, and the
same outputs, scores and linear state within float32 rounding, for every method with decode eviction, in the
transformers engine's dense store (padded batches, GQA and MHA, per-head budgets, 8-bit and bf16 storage) and in
the vLLM pool's paged layouts; and the number of launches of one step of one layer. Through a model:
``tests/test_fused_decode_models.py``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from slake.cache.compressed import CompressedKV, resolve_kernels
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout, slot_blocks
from slake.kernels import launch_config
from slake.methods import available_methods, make_method
from slake.methods.base import LayerContext, Method
from slake.methods.rotary import Rotary

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free

FUSED = [n for n in available_methods() if make_method(n).fused_rule() is not None]
#: where the kernels run: a GPU's compiled kernels where there is one, else the interpreter on CPU tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_WINDOW = {"window": 4}


def _method(name: str, **hyper) -> Method:
    base = make_method(name)
    extra = dict(SMALL_WINDOW) if base.window > 4 else {}
    return make_method(name, **{**extra, **hyper})


def _layer_context(out_proj: torch.Tensor, D: int) -> LayerContext:
    """Expected Attention's rotary embedding (base 10^4) and CriticalKV's output projection, for the tests' layers."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    return LayerContext(rotary=Rotary(inv.to(DEVICE)), out_proj=out_proj)


def _run(method: Method, kernels: str, *, B=2, H=2, G=2, D=16, S=40, budget=16, steps=3, layers=2, pad=True,
         kv_dtype=None, dtype=torch.float32, seed=0, garbage=False, meddle=None):  # fmt: skip
    """Prefill ``layers`` random layers, then decode ``steps`` tokens; the engine and every step's outputs.
    ``garbage``: three more free slots per row, holding random keys and values (as freed slots hold their last
    token's), which no rule may read. ``meddle``: ``(step, f)``, call ``f(engine)`` before that step."""
    g = torch.Generator().manual_seed(seed)
    eng = CompressedKV(method, budget, layers, kv_dtype=kv_dtype, kernels=kernels)
    padding = torch.zeros(B, S, dtype=torch.bool)
    if pad and B > 1:
        padding[0, :7] = True
    padding = padding.to(DEVICE)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    if method.layer_facts():  # Expected Attention's rotary embedding, CriticalKV's output projection
        eng.layer_context = [_layer_context(rnd(24, H * G * D), D) for _ in range(layers)]
    if method.second_pass is not None:  # KVzip: its reconstruction pass's scores, random here
        eng.pass_scores = torch.rand(layers, B, H, S, generator=g).to(DEVICE)
    for li in range(layers):
        eng.prefill_layer(li, rnd(B, H * G, S, D), rnd(B, H, S, D), rnd(B, H, S, D), padding, D**-0.5)
        if garbage:
            st = eng.layers[li]
            st._grow(3)
            empty = ~st.valid
            st.keys[empty] = rnd(int(empty.sum()), D)
            st.values[empty] = rnd(int(empty.sum()), D)
    outs = []
    for step in range(steps):
        if meddle is not None and meddle[0] == step:
            meddle[1](eng)
        for li in range(layers):
            eng.append(li, rnd(B, H, 1, D), rnd(B, H, 1, D))
            outs.append(eng.decode_attention(li, rnd(B, H * G, 1, D), D**-0.5))
    return eng, outs


def _assert_same(ref, ref_out, fused, fused_out, tol: float) -> None:
    assert fused.decoder.report.summary() == "triton"
    for a, b in zip(ref_out, fused_out, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)
    for sa, sb in zip(ref.layers, fused.layers, strict=True):
        assert torch.equal(sa.valid, sb.valid), "the kept slots differ"
        assert torch.equal(sa.positions, sb.positions)
        assert torch.equal(sa.keys, sb.keys) and torch.equal(sa.values, sb.values)
        if sa.k_scale is not None:
            assert torch.equal(sa.k_scale, sb.k_scale) and torch.equal(sa.v_scale, sb.v_scale)
        # every slot's score, the empty slots' too (the pooled rules store theirs by rank after the valid slots)
        torch.testing.assert_close(sb.scores, sa.scores, rtol=tol, atol=tol)
        if sa.head_visible is not None:
            assert torch.equal(sa.head_visible, sb.head_visible)
        if sa.linear is not None:
            torch.testing.assert_close(sb.linear.aug, sa.linear.aug, rtol=tol, atol=tol)
        if sa.weights is not None:  # CriticalKV's projected value norms, the new slots' from the kernels
            torch.testing.assert_close(sb.weights[sb.valid], sa.weights[sa.valid], rtol=tol, atol=tol)
    for a, b in zip(ref.position, fused.position, strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def split_rows(monkeypatch):
    """The first kernel's rows split over programs of 16 slots (flash-decoding), so that the tiny rows of these
    tests span several programs as a GPU's long rows do (the new slot, the victim and the combination of the
    programs' partial sums then fall in different programs); fails if no row was split."""
    used: list[tuple[int, int]] = []
    choose = launch_config.split_size

    def recording(width: int, programs: int) -> int:
        used.append((width, choose(width, programs)))
        return used[-1][1]

    monkeypatch.setattr(launch_config, "MIN_SPLIT", 16)
    monkeypatch.setattr(launch_config, "split_size", recording)
    yield
    assert any(split < width for width, split in used), f"no row was split: {used}"


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


def _assert_order_held(order: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
    """Every row's and KV head's first ``count`` order entries are its valid slots by position."""
    for o, p, v in zip(order.reshape(-1, order.shape[-1]), positions.reshape(-1, order.shape[-1]),
                       valid.reshape(-1, order.shape[-1]), strict=True):  # fmt: skip
        slots = torch.nonzero(v).flatten()
        want = slots[p[slots].argsort()]
        assert torch.equal(o[: want.numel()].long().cpu(), want.cpu()), (o, p, v)


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
BS, H, G, D, BUDGET = 8, 2, 2, 16, 24


def _pool_run(name: str, kernels: str, layout, row_slice: bool):
    """Three requests of different lengths in one paged cache, decoded 4 steps by a :class:`DecodePool`."""
    torch.manual_seed(0)
    method = _method(name)
    lengths = [40, 57, 31]
    width = (2 * BUDGET if method.evicts_across_heads else BUDGET) + 1  # AdaKV's widest head: up to 2x the budget
    nb = -(-max(lengths) // BS) + 1
    if isinstance(layout, FlashAttnLayout):
        cache = torch.zeros(64, BS, H, 2 * D, device=DEVICE).permute(0, 2, 1, 3)
    else:
        cache = torch.zeros(64, H, BS, 2 * D, device=DEVICE)
    contexts = None
    if method.layer_facts():
        contexts = [_layer_context(torch.randn(24, H * G * D).to(DEVICE), D)]
    pool = DecodePool(
        method, 1, H, D, width, BS, rows=2, layout=layout, kernels=kernels, device=DEVICE, layer_context=contexts
    )
    rows, tables = [], []
    perm = torch.randperm(63)[: nb * len(lengths)] + 1
    for r, n in enumerate(lengths):
        ref = CompressedKV(method, BUDGET, 1, kernels="torch")
        if contexts is not None:
            ref.layer_context = contexts
        ref.prefill_layer(0, torch.randn(1, H * G, n, D), torch.randn(1, H, n, D), torch.randn(1, H, n, D), None, 0.25)
        blocks = perm[r * nb : (r + 1) * nb]
        st = ref.layers[0]
        i = torch.arange(st.capacity)
        b, o = blocks[i // BS, None].expand(-1, H), (i % BS)[:, None].expand(-1, H)
        k0, v0 = st.keys[0].transpose(0, 1), st.values[0].transpose(0, 1)
        layout.write(cache, b.to(DEVICE), o.to(DEVICE), k0.to(DEVICE), v0.to(DEVICE))
        row = pool.allocate(n, BUDGET)
        pool.load_layer(row, 0, st, ref.targets[0])
        rows.append(row)
        tables.append(blocks)
    rows_t = torch.tensor(rows, device=DEVICE)
    table = torch.stack(tables).to(DEVICE)
    blocks_t, offsets = slot_blocks(table, width, BS)
    outs = []
    for _ in range(4):
        newest = pool.seen.index_select(0, rows_t).view(-1, 1, 1)
        pool.seen.index_add_(0, rows_t, torch.ones_like(rows_t))
        q, k, v = (torch.randn(3, n, D).to(DEVICE) for n in (H * G, H, H))
        index = slice(0, 3) if row_slice else rows_t
        outs.append(pool.decode_layer(0, index, table, blocks_t, offsets, newest, q, k, v, cache, D**-0.5))
    return pool, cache, outs


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


# ---------------------------------------------------------------------------------------------- launches
class _Launches(TorchDispatchMode):
    """Counts the torch operations that launch work (not views, not allocations); the fused op itself is counted
    through its Triton kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if not (func.is_view or "empty" in name or name.startswith("slake::") or name == "aten::lift_fresh"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _counted_kernels(monkeypatch) -> list:
    """The Triton kernels launched from now on (each launch appends its kernel)."""
    from slake.kernels import triton_decode

    launched: list = []

    class Counting:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(self.kernel)
            launch = self.kernel[grid]

            def run(*args, **kwargs):  # one launch: what Triton's interpreter does inside it is not counted
                with _disable_current_modes():
                    return launch(*args, **kwargs)

            return run

    for kernel in ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel",
                   "_layer_eviction_kernel"):  # fmt: skip
        monkeypatch.setattr(triton_decode, kernel, Counting(getattr(triton_decode, kernel)))
    return launched


def _count_one_step(name: str, kernels: str, monkeypatch) -> int:
    launched = _counted_kernels(monkeypatch)
    method = _method(name)
    eng, _ = _run(method, kernels, steps=1, layers=1)
    q, k, v = (torch.randn(2, n, 1, D, device=DEVICE) for n in (H * G, H, H))
    eng.append(0, k, v)
    launched.clear()
    with _Launches() as mode:
        eng.decode_attention(0, q, D**-0.5)
    return len(mode.ops) + len(launched)


@pytest.mark.parametrize("name", ["snapkv", "slake", "tova", "ahakv", "keydiff", "kvzip", "expected-attention",
                                  "criticalkv", "ada-criticalkv", "ada-snapkv[decode_scope=layer]"])  # fmt: skip
def test_one_fused_step_of_one_layer_is_at_most_four_launches(name, monkeypatch):
    assert _count_one_step(name, "triton", monkeypatch) <= 4
    # the counter sees the torch step's operations (a count that cannot pass by accident)
    assert _count_one_step(name, "torch", monkeypatch) > 20


#: torch operations of one torch step of one layer in the transformers engine (docs/gpu.md's table): on a CPU each
#: costs a few microseconds whatever its size, so the step costs its count; a change that adds operations fails here
TORCH_STEP_OPS = {"tova": 30, "h2o": 40, "snapkv": 42, "cake": 42, "ahakv": 55, "slake": 65}


@pytest.mark.parametrize("name", sorted(TORCH_STEP_OPS))
def test_the_torch_step_of_one_layer_stays_within_its_operation_count(name, monkeypatch):
    assert _count_one_step(name, "torch", monkeypatch) <= TORCH_STEP_OPS[name]


class _AllOps(TorchDispatchMode):
    """Every operator name dispatched, custom operators included."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def test_eager_fused_step_calls_the_kernels_without_the_custom_operator():
    """The custom operator exists for torch.compile; in eager code its Python dispatch cost ~0.35 ms per call on a CPU
    host (more than the rest of the layer's step), so eager code calls the kernels' function directly."""
    eng, _ = _run(_method("slake"), "triton", steps=1, layers=1)
    q, k, v = (torch.randn(2, n, 1, D, device=DEVICE) for n in (H * G, H, H))
    eng.append(0, k, v)
    with _AllOps() as mode:
        eng.decode_attention(0, q, D**-0.5)
    assert not [op for op in mode.ops if op.startswith("slake::")]
    assert mode.ops  # the mode saw the step


def test_one_fused_pool_step_of_one_layer_is_at_most_four_launches(monkeypatch):
    """The vLLM pool's ``decode_layer`` for three requests: the two kernels, nothing else (the rows are a slice)."""
    pool, cache, _ = _pool_run("slake", "triton", FlashAttnLayout(), True)
    launched = _counted_kernels(monkeypatch)
    rows = torch.arange(3, device=DEVICE)
    table = torch.stack([torch.arange(8, device=DEVICE) + 1 + 8 * r for r in range(3)])
    blocks, offsets = slot_blocks(table, BUDGET + 1, BS)
    newest = pool.seen.index_select(0, rows).view(-1, 1, 1)
    q, k, v = (torch.randn(3, n, D, device=DEVICE) for n in (H * G, H, H))
    with _Launches() as mode:
        pool.decode_layer(0, slice(0, 3), table, blocks, offsets, newest, q, k, v, cache, D**-0.5)
    assert len(mode.ops) + len(launched) == 2, mode.ops
    assert pool.report.steps == {"triton": 5}


# ---------------------------------------------------------------------------------------------- choosing kernels
def test_a_step_the_kernels_do_not_cover_runs_in_torch_and_says_why(caplog, monkeypatch):
    """A method whose decode rule has no fused form (here, a subclass with its own rule) runs the torch step; the
    report names the reason and a warning is logged once (per process: the reasons already said are forgotten here)."""
    from slake.cache import fused_step
    from uncovered_rule import Reversed  # SnapKV with its own rule, which has no fused form

    monkeypatch.setattr(fused_step, "_LOGGED", set())
    method = Reversed(window=4)
    with caplog.at_level("WARNING", logger="slake.kernels"):
        eng, _ = _run(method, "triton", steps=2, layers=1)
    assert eng.decoder.report.steps == {"torch": 2}
    assert "no fused form" in eng.decoder.report.summary()
    assert sum("fused decode kernels do not cover" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "prefix"])
@pytest.mark.parametrize("name", ["slake", "cake[linear_cache=true]", "snapkv"])
def test_a_prompt_within_the_budget_decodes_as_the_full_cache_does(name, pad, caplog):
    """A batch whose prompts all fit the budget is not compressed: no layer evicts at decode and nothing is folded,
    so the step is the full cache's (the token's write and one attention), for the methods with a linear state too.
    It was the torch step for SLAKE and ``cake[linear_cache=true]`` (the linear-state flag of the method, not the
    layer's state, chose it), which the fused kernels do not cover: on a GPU its 40-odd operations per layer, and a
    warning that the kernels were not used for a cache that has nothing for them to do."""
    full, full_out = _run(make_method("full"), "torch", S=20, budget=24, steps=3, pad=pad)
    for kernels in ("torch", "triton"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="slake.kernels"):
            eng, outs = _run(_method(name), kernels, S=20, budget=24, steps=3, pad=pad)
        assert all(t is None for t in eng.targets)
        # a padded row's masked attention is the dense kernels; a prefix is one SDPA call, reported as such
        if kernels == "triton":
            assert eng.decoder.report.steps == ({"triton": 6} if pad else {"sdpa": 6}), eng.decoder.report.summary()
        assert not any("do not cover" in r.message for r in caplog.records)
        for a, b in zip(full_out, outs, strict=True):
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    ["slake[decode_eviction=false]", "cake[linear_cache=true,decode_eviction=false]", "sagekv[decode_eviction=false]"],
)
def test_a_layer_that_does_not_evict_but_keeps_a_linear_state_or_hidden_slots_runs_the_kernels(
    name, split_rows, monkeypatch
):
    """Compressed at prefill, then append-only (``decode_eviction=False``, kvpress's protocol): SLAKE's layers keep
    the evicted tokens' linear state and SAGE-KV's the slots hidden from some query heads, so their steps are not the
    full cache's. They ran the torch step (31 operations per layer for SLAKE); the kernels now run them with a target
    of -1 and no rule (``KEEP_ALL``: nothing scored, no victim sought): the same outputs, linear state, slots and
    stored scores (the new slot's 0, as the torch step's), every row growing by a token per step. The rows grow 3
    slots at a time here (256 by default), twice in four steps, so that the held arguments are made again (the test
    patched the growth of multi-token appends instead, and its rows grew once, by 256: nine times the programs)."""
    from slake.cache import state

    monkeypatch.setattr(state, "_GROWTH", 3)
    method = _method(name)
    ref, ref_out = _run(method, "torch", steps=4)
    fused, fused_out = _run(method, "triton", steps=4)
    assert not any(fused.decoder.state.scored(li) for li in range(2))
    assert fused.decoder.report.steps == {"triton": 8}, fused.decoder.report.summary()
    kept = [s.valid.sum(-1) for s in fused.layers]
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    shorter, _ = _run(method, "torch", steps=0)  # the prefill's kept counts: 4 steps add 4 slots to every row
    for k, s, f in zip(kept, shorter.layers, fused.layers, strict=True):
        assert torch.equal(k, s.valid.sum(-1) + 4)
        assert f.valid.shape[-1] == s.valid.shape[-1] + 2 * 3  # grown twice


@pytest.fixture
def wide_rows(monkeypatch):
    """Rows of more than 16 slots read in blocks of 16 (``launch_config.WIDE_SLOTS``, ``WIDE_BLOCK``), as a GPU reads
    rows of more than 16,384 slots in blocks of 1,024: so that the tests' rows of 17 to 60 slots take the blockwise
    form, over several blocks."""
    monkeypatch.setattr(launch_config, "WIDE_SLOTS", 16)
    monkeypatch.setattr(launch_config, "WIDE_BLOCK", 16)


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


def test_kernel_choice_is_checked():
    with pytest.raises(ValueError, match="unknown kernels"):
        CompressedKV("snapkv", 64, 2, kernels="cuda")
    assert resolve_kernels("auto", "cpu") == "torch"
    assert resolve_kernels("torch", "cpu") == "torch"


def test_an_old_triton_is_refused_and_auto_is_the_torch_step_with_it(monkeypatch, caplog):
    """Triton 3.3 (torch 2.7's) has no run-time knobs for the launches to read and its interpreter does not take the
    kernels: on a GPU with it ``"auto"`` is the torch step, said once, and ``"triton"`` is refused with the versions
    named; Triton 3.4 (torch 2.8's) is the oldest taken."""
    import slake.kernels
    from slake.cache import compressed

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(compressed, "_told_old", False)
    monkeypatch.setattr(slake.kernels, "triton_version", lambda: (3, 3, 1))
    with caplog.at_level("WARNING", logger="slake.kernels"):
        assert resolve_kernels("auto", "cuda") == "torch"
        assert resolve_kernels("auto", "cuda") == "torch"
    assert sum("need Triton 3.4 or later, and this is 3.3.1" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="needs Triton 3.4 or later, and this is 3.3.1; use kernels='torch'"):
        resolve_kernels("triton", "cpu")
    monkeypatch.setattr(slake.kernels, "triton_version", lambda: (3, 4, 0))
    assert resolve_kernels("auto", "cuda") == "triton" and resolve_kernels("triton", "cpu") == "triton"


def test_the_triton_version_is_read_from_its_release_string(monkeypatch):
    import triton

    from slake.kernels import triton_version

    for text, parsed in (("3.6.0", (3, 6, 0)), ("3.4.0+rocm6.4.1", (3, 4, 0)), ("3.7.0rc1", (3, 7, 0))):
        monkeypatch.setattr(triton, "__version__", text)
        assert triton_version() == parsed


def test_auto_is_the_torch_step_on_an_amd_gpu_and_says_so(monkeypatch, caplog):
    """On an NVIDIA GPU ``"auto"`` is the fused kernels; on an AMD one (a ROCm build of torch: ``torch.version.hip``
    set, devices still ``"cuda"``) the torch step, with a warning once, since the kernels compile for it but have
    not run on one; ``"triton"`` asked for is the kernels there too."""
    from slake.cache import compressed

    monkeypatch.setattr(torch.version, "hip", None)
    assert resolve_kernels("auto", "cuda") == "triton"
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(compressed, "_told_amd", False)
    with caplog.at_level("WARNING", logger="slake.kernels"):
        assert resolve_kernels("auto", "cuda") == "torch"
        assert resolve_kernels("auto", "cuda:1") == "torch"
    assert sum("have not run on an AMD GPU" in r.message for r in caplog.records) == 1
    assert resolve_kernels("triton", "cuda") == "triton"


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


def test_rows_are_split_over_programs_when_few_rows_would_leave_a_gpu_idle():
    """One row of 8 KV heads at 1,056 slots (batch 1, budget 1024 on Llama-3-8B) runs as 17 programs per head, not
    one; 32 rows of 8 heads already fill a GPU and are not split; a split is never under MIN_SPLIT slots."""
    assert launch_config.split_size(1056, 8) == 64
    assert launch_config.split_size(1056, 256) >= 1056
    assert launch_config.split_size(40, 8) == launch_config.MIN_SPLIT
    for width in (1, 17, 1000, 16384):
        for programs in (1, 8, 64, 1000):
            split = launch_config.split_size(width, programs)
            assert split >= launch_config.MIN_SPLIT and split & (split - 1) == 0


@pytest.mark.parametrize(
    "constants",
    [
        {"COMBINE": 1, "RECOMPUTE_BLOCK": 16, "MIN_SPLIT": 16, "TARGET_PROGRAMS": 512},  # many pieces, one at a time
        {"COMBINE": 8, "MIN_SPLIT": 16, "TARGET_PROGRAMS": 1, "WIDE_WARPS": 16},  # one piece per row
        {"POOL_GATHER": 0, "SHORT_KEYS": 0},  # the pooling of before, through memory, on int64 keys
        {"HELD_ORDER": 0},  # every row sorted at every step
        {"NEW_TOKEN_APART": 0},  # the pooled rules over the row's slots, the new token's among them
    ],
)
def test_launch_constants_change_how_the_step_is_cut_not_what_it_computes(constants):
    """``launch_config.tuned`` (``python -m benchmarks kernel-tune``): SLAKE's step with rows cut into more or fewer
    pieces, combined more or fewer at a time, pooled as before (through memory), sorted at every step, or pooled over
    the row's slots with the new token among them, equals the torch step; bad constants are refused."""
    method = _method("slake")
    ref, ref_out = _run(method, "torch")
    with launch_config.tuned(**constants):
        assert all(getattr(launch_config, k) == v for k, v in constants.items())
        fused, fused_out = _run(method, "triton")
    assert launch_config.COMBINE == 4 and launch_config.MIN_SPLIT == 64 and launch_config.POOL_GATHER  # restored
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    bad_values = ({"COMBINE": 0}, {"MIN_SPLIT": 24}, {"WIDE_WARPS": 2}, {"BLOCK": 8}, {"COMBINE": True})
    for bad in (*bad_values, {"SHORT_KEYS": 2}, {"POOL_GATHER": True}, {"HELD_ORDER": -1}, {"NEW_TOKEN_APART": 2}):
        with pytest.raises(ValueError):
            with launch_config.tuned(**bad):
                pass


def test_leaving_out_a_part_of_the_second_kernel_is_for_timing_only():
    """``launch_config.leaving_out`` (``python -m benchmarks kernel-parts``) launches the second kernel without a
    part: every variant runs; without the fold SLAKE's ``d x d`` state keeps what the prefill left, where a real
    step folds each victim into it; outside the block the step is the real one again."""
    m = _method("slake")
    run = dict(B=1, steps=2, layers=1, pad=False)
    prefilled, _ = _run(m, "triton", **{**run, "steps": 0})
    real, real_out = _run(m, "triton", **run)
    d = prefilled.layers[0].keys.shape[-1]
    block = prefilled.layers[0].linear.aug[..., :d, :d]
    assert not torch.equal(real.layers[0].linear.aug[..., :d, :d], block)  # the real step folded its victims
    for part in launch_config.SKIP_PARTS:
        with launch_config.leaving_out(part):
            eng, outs = _run(m, "triton", **run)
        assert all(bool(torch.isfinite(o).all()) for o in outs), part
        if part == "fold":
            assert torch.equal(eng.layers[0].linear.aug[..., :d, :d], block)
    again, again_out = _run(m, "triton", **run)
    for a, b in zip(real_out, again_out, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown kernel parts"):
        with launch_config.leaving_out("everything"):
            pass


@pytest.mark.parametrize("name", ["slake", "snapkv", "h2o", "keydiff", "criticalkv"])
def test_the_second_kernel_holds_a_row_of_budget_plus_one_slots_in_pow2_budget_lanes(name, monkeypatch):
    """A row is its budget plus one slot wide (the slot the next token is written into). With the new token apart
    (``launch_config.NEW_TOKEN_APART``) the second kernel's vectors are ``pow2(budget)`` wide, not twice that: for
    every rule but CriticalKV's two stages, which keep the row's slots in slot order; with it off, for none."""
    from slake.kernels import load, triton_decode

    load()
    seen: list[tuple[int, bool]] = []
    kernel = triton_decode._evict_attend_kernel

    class Recording:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                seen.append((kwargs["BW"], kwargs["APART"]))
                return launch(*args, **kwargs)

            return run

    monkeypatch.setattr(triton_decode, "_evict_attend_kernel", Recording())
    run = dict(B=1, pad=False, steps=2, layers=1, budget=16)
    eng, _ = _run(_method(name), "triton", **run)
    assert eng.layers[0].positions.shape[-1] == 17  # budget + 1
    apart = name != "criticalkv"
    assert seen == [(16, True)] * 2 if apart else seen == [(32, False)] * 2
    seen.clear()
    with launch_config.tuned(NEW_TOKEN_APART=0):
        _run(_method(name), "triton", **run)
    assert seen == [(32, False)] * 2


def test_a_steps_launch_plan_is_made_once_and_follows_the_launch_configuration(monkeypatch):
    """The launches' constants are worked out once per shape, flags and launch configuration
    (``step_plan.launch_plan``): later steps of the same layer reuse them, and a change of a launch constant (by
    ``tuned``, ``leaving_out`` or an assignment) or of the first kernel's split takes effect at the next step."""
    from slake.kernels import load, step_plan, triton_decode

    load()
    seen: list[dict] = []
    kernel = triton_decode._evict_attend_kernel

    class Recording:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                seen.append(kwargs)
                return launch(*args, **kwargs)

            return run

    monkeypatch.setattr(triton_decode, "_evict_attend_kernel", Recording())
    step_plan._PLANS.clear()
    run = dict(B=1, pad=False, steps=3, layers=1, budget=16)
    _run(_method("slake"), "triton", **run)
    assert len(step_plan._PLANS) == 1 and len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert seen[0]["COMBINE"] == launch_config.COMBINE and seen[0]["SKIP"] == 0 and seen[0]["KEY_SPAN"] > 0
    seen.clear()
    with launch_config.tuned(COMBINE=8, NEW_TOKEN_APART=0):
        _run(_method("slake"), "triton", **run)
    assert [(k["COMBINE"], k["BW"], k["APART"]) for k in seen] == [(8, 32, False)] * 3
    seen.clear()
    with launch_config.leaving_out("fold"):
        _run(_method("slake"), "triton", **run)
    assert [k["SKIP"] for k in seen] == [launch_config.SKIP_PARTS["fold"]] * 3
    seen.clear()
    monkeypatch.setattr(launch_config, "SHORT_KEYS", False)
    monkeypatch.setattr(launch_config, "MIN_SPLIT", 16)  # rows of 17 slots in two pieces of 16
    _run(_method("slake"), "triton", **run)
    assert [(k["KEY_SPAN"], k["SPLIT"], k["COMBINE"]) for k in seen] == [(0, 16, launch_config.COMBINE)] * 3
    assert len(step_plan._PLANS) == 4


def _count_fused_arguments(monkeypatch, *modules) -> list[int]:
    """Count the calls of ``fused_step.fused_arguments`` made through ``modules`` (each module's name for it replaced
    by a counting wrapper); the returned list grows by one per call."""
    from slake.cache import fused_step

    made: list[int] = []
    real = fused_step.fused_arguments

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, "fused_arguments", counting)
    return made


def test_a_layers_fused_arguments_are_made_once_and_again_when_what_they_came_from_is_replaced(monkeypatch):
    """In eager decoding the transformers engine makes a layer's fused-step arguments once
    (``fused_step.fused_arguments``) and reuses them while every object they were made from is the same
    (``Decoder._fused_sources``): replacing one of them, as a reordered batch, a grown store or a new prefill does,
    makes them again, and every step still equals the torch step."""
    from slake.cache import decoding

    made = _count_fused_arguments(monkeypatch, decoding)
    method = _method("slake")
    ref, ref_out = _run(method, "torch", steps=4)
    fused, fused_out = _run(method, "triton", steps=4)
    assert len(made) == 2  # one per layer; the three later steps of each reuse them
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)

    def replace(eng):  # the same contents in new tensors: the arguments' old ones are no longer the store's
        for st in eng.layers:
            st.scores, st.positions = st.scores.clone(), st.positions.clone()
        eng.state.targets[1] = eng.state.targets[1].clone()

    made.clear()
    ref, ref_out = _run(method, "torch", steps=4, meddle=(2, replace))
    fused, fused_out = _run(method, "triton", steps=4, meddle=(2, replace))
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    assert len(made) == 4  # the first step and the one after the replacement, per layer
    assert fused.decoder.report.steps == {"triton": 8}


def test_the_layers_held_steps_share_one_scratch_arena_and_carve_it_again_when_it_grows():
    """Eager decoding holds each layer's fused step (:class:`slake.kernels.held_step.HeldStep`) with its scratch
    carved from one arena the layers share. A layer widened mid-decode makes its step again with more scratch than
    the arena holds: the arena grows, the other layer carves its scratch again at its next step, and every step
    still equals the torch step."""
    from slake.kernels.held_step import HeldStep

    method = _method("slake")

    def widen(eng):  # layer 1's rows get 40 more free slots: new tensors, so a new held step
        eng.layers[1]._grow(40)

    ref, ref_out = _run(method, "torch", steps=4, meddle=(2, widen))
    fused, fused_out = _run(method, "triton", steps=4, meddle=(2, widen))
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    arena = fused.decoder._arena
    assert arena.generation == 2 and len(arena._flat) == 1  # made once, grown once, one device
    (flat,) = arena._flat.values()
    for li in range(2):
        step = fused.decoder._fused[li][3]
        assert isinstance(step, HeldStep) and step._made[1] == arena.generation
        carved = [
            t for run in step._made[2] for t in run.args
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        ]  # fmt: skip
        assert len({t.storage_offset() for t in carved}) >= 4, li  # x, stat, part, newslot and the linear share


def test_steps_made_afresh_equal_held_steps(monkeypatch):
    """With :data:`~slake.kernels.launch_config.HELD_STEP` off, each step makes its scratch and launch arguments
    again (:class:`slake.kernels.held_step.Afresh`), with the same results."""
    from slake.kernels.held_step import Afresh

    monkeypatch.setattr(launch_config, "HELD_STEP", False)
    for name in ("snapkv", "criticalkv"):
        method = _method(name)
        ref, ref_out = _run(method, "torch", steps=3)
        fused, fused_out = _run(method, "triton", steps=3)
        _assert_same(ref, ref_out, fused, fused_out, 1e-5)
        assert isinstance(fused.decoder._fused[0][3], Afresh) and fused.decoder._arena is not None


def test_the_scratch_arena_carves_aligned_buffers_that_do_not_overlap():
    """:class:`slake.kernels.held_step.ScratchArena`: views of one float32 buffer per device, each starting on a
    multiple of 128 bytes, none overlapping; grown to at least twice its size when a carve needs more, which
    ``generation`` counts; 4-byte dtypes only."""
    from slake.kernels.held_step import ScratchArena

    cpu = torch.device("cpu")
    arena = ScratchArena()
    specs = (((2, 3, 5), torch.float32), None, ((7,), torch.int32), ((1, 33), torch.float32))
    a, unused, b, c = arena.carve(specs, cpu)
    assert unused is None and a.shape == (2, 3, 5) and b.shape == (7,) and b.dtype == torch.int32
    assert c.shape == (1, 33) and c.dtype == torch.float32
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in (a, b, c))
    assert all(start % 32 == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert arena.generation == 1 and arena.nbytes() == 4 * (32 + 32 + 64)  # each rounded up to 32 elements
    arena.carve(specs, cpu)
    assert arena.generation == 1  # it fits: the same buffer
    (big,) = arena.carve((((200,), torch.float32),), cpu)
    assert arena.generation == 2 and big.numel() == 200 and arena.nbytes() == 4 * 2 * 128  # twice its size
    with pytest.raises(ValueError, match="4-byte"):
        arena.carve((((4,), torch.float16),), cpu)


def test_a_step_the_kernels_do_not_cover_works_out_the_fused_arguments_once(monkeypatch, wide_rows):
    """A step the fused kernels do not cover (a positional pooling over rows wider than the kernels' vectors, in a
    store without the order to rank them by) runs the torch step, says why, and works out the fused arguments once
    per step, not again inside the torch fallback."""
    from slake.cache import decoding, fused_step

    made = _count_fused_arguments(monkeypatch, decoding, fused_step)
    monkeypatch.setattr(decoding, "keeps_order", lambda method, kernels: False)
    method = _method("ada-snapkv", decode_scope="layer")
    ref, ref_out = _run(method, "torch", steps=2)
    fused, fused_out = _run(method, "triton", steps=2)
    assert len(made) == 4  # two layers, two steps, once each
    assert "without their order by position" in fused.decoder.report.summary()
    for a, b in zip(ref_out, fused_out, strict=True):
        torch.testing.assert_close(b, a)


def test_a_release_string_reads_as_its_leading_numbers():
    from slake.release import release

    cases = {"2.8.0+cu128": (2, 8, 0), "2.10.0a0+git1": (2, 10, 0), "3.7.0rc1": (3, 7, 0), "3.4.0+rocm6.4": (3, 4, 0)}
    for text, parsed in cases.items():
        assert release(text) == parsed
    assert release("2.9.0") >= (2, 9) > release("2.8.1")
