"""The fused decode tests' shared cases (:mod:`test_fused_decode`, :mod:`test_fused_decode_wide_rows`,
:mod:`test_fused_decode_launches`): a transformers-engine run with either kernels, the check that a fused run equals
the torch run, the vLLM pool's run, and the fixtures that cut the tests' tiny rows as a GPU cuts long ones."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import FlashAttnLayout, slot_blocks
from slake.kernels import launch_config
from slake.methods import available_methods, make_method
from slake.methods.base import LayerContext, Method
from slake.methods.rotary import Rotary

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


def _assert_order_held(order: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
    """Every row's and KV head's first ``count`` order entries are its valid slots by position."""
    for o, p, v in zip(order.reshape(-1, order.shape[-1]), positions.reshape(-1, order.shape[-1]),
                       valid.reshape(-1, order.shape[-1]), strict=True):  # fmt: skip
        slots = torch.nonzero(v).flatten()
        want = slots[p[slots].argsort()]
        assert torch.equal(o[: want.numel()].long().cpu(), want.cpu()), (o, p, v)


@pytest.fixture
def wide_rows(monkeypatch):
    """Rows of more than 16 slots read in blocks of 16 (``launch_config.WIDE_SLOTS``, ``WIDE_BLOCK``), as a GPU reads
    rows of more than 16,384 slots in blocks of 1,024: so that the tests' rows of 17 to 60 slots take the blockwise
    form, over several blocks."""
    monkeypatch.setattr(launch_config, "WIDE_SLOTS", 16)
    monkeypatch.setattr(launch_config, "WIDE_BLOCK", 16)


#: the pool runs' shape: block size, KV heads, group, head size, budget (``tests/fuzz_fused.py`` draws others)
BS, H, G, D, BUDGET = 8, 2, 2, 16, 24


def _pool_run(name: str, kernels: str, layout, row_slice: bool, *, BS=BS, H=H, G=G, D=D, BUDGET=BUDGET):
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
