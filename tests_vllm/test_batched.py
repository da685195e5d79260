"""The batched decode step (:class:`slake.engines.vllm.plugin.decode_pool.DecodePool`) equals the transformers engine's
per-request
step (:class:`slake.cache.compressed.CompressedKV`) on random tensors: the same kept slots (positions, validity, keys
in the paged cache) and the same outputs and linear state up to float32 rounding, for several requests of different
lengths decoding together in one paged cache, in vLLM's CPU layout and in the FlashAttention layout (on CPU
tensors)."""

from __future__ import annotations

import pytest
import torch

from slake.budgets.budget import Budget
from slake.cache.compressed import CompressedKV
from slake.engines.vllm.plugin.config import SUPPORTED_METHODS, with_layer_cap
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout, PagedLayout, slot_blocks
from slake.methods import make_method
from slake.methods.base import LayerContext
from slake.methods.rotary import Rotary

BUDGET = 24
BS = 8
H, G, D = 2, 2, 16
LAYERS = 2


def _cache(layout: PagedLayout, device: str = "cpu") -> torch.Tensor:
    """One layer's zeroed paged cache of 64 blocks in ``layout``'s tensor, as vLLM allocates it (FlashAttention:
    its default NHD memory order, a strided ``(blocks, Hkv, block_size, 2d)`` view)."""
    if isinstance(layout, FlashAttnLayout):
        return torch.zeros(64, BS, H, 2 * D, device=device).permute(0, 2, 1, 3)
    return torch.zeros(64, H, BS, 2 * D, device=device)


def _write(layout, kv, blocks, keys, values):
    """A prefilled request's ``(H, n, d)`` kept keys/values to its first ``n`` slots (``n`` rows of the writer)."""
    n = keys.shape[1]
    i = torch.arange(n)
    b, o = blocks[i // BS, None].expand(n, H), (i % BS)[:, None].expand(n, H)
    dev = kv.device
    layout.write(kv, b.to(dev), o.to(dev), keys.transpose(0, 1).to(dev), values.transpose(0, 1).to(dev))


def _contexts(method) -> list[LayerContext] | None:
    """Random model facts per layer (a RoPE with base 10^4, an output projection) for methods that read them
    (Expected Attention, CriticalKV); None for the others."""
    if not method.layer_facts():
        return None
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    return [LayerContext(rotary=Rotary(inv), out_proj=torch.randn(24, H * G * D)) for _ in range(LAYERS)]


def _pool_against_engine(
    method: str,
    layout: PagedLayout,
    layer_widths: bool = False,
    row_slice: bool = False,
    device: str = "cpu",
    tol: tuple[float, float] = (1e-5, 1e-6),
) -> list:
    """Three requests of different lengths prefilled by ``CompressedKV`` and decoded 12 steps by the pool in
    ``layout``, checked step by step against ``CompressedKV``; returns each step's ``(outputs, positions, valid)``
    per layer (on the CPU). ``layer_widths``: each layer reads only the slots :meth:`DecodePool.layer_widths` gives
    it; ``row_slice``: the rows are passed as a slice and updated in place; ``device``: where the pool and the paged
    cache live (the reference ``CompressedKV`` runs on the CPU); ``tol``: the outputs' ``(rtol, atol)``."""
    torch.manual_seed(0)
    m = with_layer_cap(
        make_method(method, **({} if method in ("streamingllm", "tova") else {"window": 4})), Budget(BUDGET)
    )
    lengths = [40, 57, 31]
    width = (getattr(m, "max_layer_budget", None) or BUDGET) + 1 if m.layer_budgets == "preference" else BUDGET + 1
    nb_req = -(-max(lengths) // BS) + 1
    kv = [_cache(layout, device) for _ in range(LAYERS)]
    contexts = _contexts(m)
    pool = DecodePool(m, LAYERS, H, D, width, BS, rows=2, layout=layout, device=device, layer_context=contexts)
    refs, rows, tables = [], [], []
    perm = torch.randperm(63)[: nb_req * len(lengths)] + 1
    for r, n in enumerate(lengths):
        ref = CompressedKV(m, BUDGET, LAYERS)
        if contexts is not None:
            ref.layer_context = contexts
        blocks = perm[r * nb_req : (r + 1) * nb_req]
        for li in range(LAYERS):
            q = torch.randn(1, H * G, n, D)
            k = torch.randn(1, H, n, D)
            v = torch.randn(1, H, n, D)
            ref.prefill_layer(li, q, k, v, None, D**-0.5)
        row = pool.allocate(n, BUDGET)
        for li in range(LAYERS):
            st = ref.layers[li]
            _write(layout, kv[li], blocks, st.keys[0], st.values[0])
            pool.load_layer(row, li, st, ref.targets[li])
        refs.append(ref)
        rows.append(row)
        tables.append(blocks)
    rows_t = torch.tensor(rows, device=device)
    table_t = torch.stack(tables).to(device)
    blocks_t, offsets = slot_blocks(table_t, width, BS)
    widths = pool.layer_widths(rows) if layer_widths else [None] * LAYERS
    if layer_widths and m.layer_budgets == "preference":  # the cascade gives layers different budgets
        assert min(widths) < width, widths
    assert rows == [0, 1, 2]  # in order: the step may update them in place through a slice
    index = slice(0, 3) if row_slice else rows_t
    trace = []
    for _ in range(12):
        newest = pool.seen.index_select(0, rows_t).view(-1, 1, 1)
        pool.seen.index_add_(0, rows_t, torch.ones_like(rows_t))
        for li in range(LAYERS):
            q = torch.randn(len(lengths), H * G, D)
            k = torch.randn(len(lengths), H, D)
            v = torch.randn(len(lengths), H, D)
            dq, dk, dv = q.to(device), k.to(device), v.to(device)
            out = pool.decode_layer(
                li, index, table_t, blocks_t, offsets, newest, dq, dk, dv, kv[li], D**-0.5, widths[li]
            ).cpu()
            positions, valid = pool.positions[li, rows_t].cpu(), pool.valid[li, rows_t].cpu()
            trace.append((out, positions, valid))
            for r, ref in enumerate(refs):
                ref.append(li, k[r : r + 1, :, None], v[r : r + 1, :, None])
                o = ref.decode_attention(li, q[r : r + 1, :, None], D**-0.5)
                # the CPU layout's logits are one matmul per block (another summation order than the engine's one
                # matmul over the store): equal to float32 rounding, kept sets identical
                torch.testing.assert_close(out[r], o[0, :, 0], rtol=tol[0], atol=tol[1])
                st = ref.layers[li]
                cap = st.capacity
                assert torch.equal(valid[r, :, :cap], st.valid[0])
                assert torch.equal(positions[r, :, :cap], st.positions[0])
                assert not valid[r, :, cap:].any()
                kk, vv = layout.read(kv[li], tables[r].to(device), cap)
                assert torch.equal(kk.cpu()[st.valid[0]], st.keys[0][st.valid[0]])
                if st.linear is not None:
                    lin = pool.linear[li, rows[r]].cpu()
                    torch.testing.assert_close(lin, st.linear.aug[0], rtol=tol[0], atol=tol[1])
                if pool.weights is not None:  # CriticalKV's projected norms, kept per slot by both engines
                    w, keep = pool.weights[li, rows[r]].cpu()[:, :cap], st.valid[0]
                    assert st.weights is not None
                    torch.testing.assert_close(w[keep], st.weights[0][keep], rtol=tol[0], atol=tol[1])
    return trace


def test_a_preempted_row_gets_its_slot_weights_back():
    """``row_state`` / ``restore_row`` (preemption) carry the per-slot weights of a ``slot_weighted`` method."""
    m = with_layer_cap(make_method("criticalkv", window=4), Budget(BUDGET))
    contexts = _contexts(m)
    pool = DecodePool(m, LAYERS, H, D, BUDGET + 1, BS, rows=2, layer_context=contexts)
    ref = CompressedKV(m, BUDGET, LAYERS)
    ref.layer_context = contexts
    for li in range(LAYERS):
        ref.prefill_layer(li, torch.randn(1, H * G, 40, D), torch.randn(1, H, 40, D), torch.randn(1, H, 40, D),
                          None, D**-0.5)  # fmt: skip
    row = pool.allocate(40, BUDGET)
    for li in range(LAYERS):
        pool.load_layer(row, li, ref.layers[li], ref.targets[li])
    assert pool.weights is not None
    for li in range(LAYERS):
        st = ref.layers[li]
        exact = m.slot_weights(st.dense_values().float(), contexts[li])[0]
        torch.testing.assert_close(pool.weights[li, row, :, : st.capacity], exact)
    before = pool.weights[:, row].clone()
    saved = pool.row_state(row)
    pool.release(row)
    again = pool.allocate(40, BUDGET)
    assert again == row and not pool.weights[:, row].any()
    pool.restore_row(row, saved)
    assert torch.equal(pool.weights[:, row], before)


@pytest.mark.parametrize(
    "layer_widths, row_slice", [(False, False), (True, False), (True, True)], ids=["whole-row", "widths", "in-place"]
)
@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_pool_step_equals_compressed_kv(method, layer_widths, row_slice):
    _pool_against_engine(method, CpuAttnLayout(), layer_widths, row_slice)


@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_flash_layout_pool_equals_cpu_layout(method):
    """The same requests through the FlashAttention layout (on CPU tensors, NHD strides): the engine's results, and
    the CPU layout's: identical kept positions and validity, outputs equal to float32 rounding (the logits are one
    matmul over slot-major keys there, one per block here)."""
    flash = _pool_against_engine(method, FlashAttnLayout(), layer_widths=True, row_slice=True)
    cpu = _pool_against_engine(method, CpuAttnLayout())
    for (o_f, p_f, v_f), (o_c, p_c, v_c) in zip(flash, cpu, strict=True):
        assert torch.equal(p_f, p_c) and torch.equal(v_f, v_c)
        torch.testing.assert_close(o_f, o_c, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_flash_layout_pool_on_cuda_equals_compressed_kv(method):
    """The pool and the paged cache on a CUDA device, in the FlashAttention layout (what a GPU backend would run),
    against the transformers engine on the CPU: identical kept positions, validity and keys at every step; outputs
    and linear state equal to float32 rounding of another device's kernels."""
    _pool_against_engine(method, FlashAttnLayout(), layer_widths=True, row_slice=True, device="cuda", tol=(1e-4, 1e-5))
