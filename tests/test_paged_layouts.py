"""The paged-cache layouts of the vLLM plugin (:mod:`slake.engines.vllm.plugin.paged`) on plain torch tensors, no vLLM
needed: each
layout reads back exactly what its writer wrote (one slot per request and KV head, each head its own slot), its
tensor holds the entries where its kernels look for them, and the batched decode step is device-agnostic (on the
``meta`` device every tensor it touches stays there and nothing is read back to the host).

The CPU layout against vLLM's own cache-write op, the FlashAttention layout on vLLM's own cache views, and the decode
pool in both layouts against the transformers engine are in ``tests_vllm/test_paged.py`` and
``tests_vllm/test_batched.py``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slake.budgets.budget import Budget
from slake.engines.vllm.plugin.config import SUPPORTED_METHODS, with_layer_cap
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout, PagedLayout, slot_blocks
from slake.methods import make_method
from slake.methods.base import LayerContext
from slake.methods.rotary import Rotary

NB, H, BS, D = 16, 3, 8, 4


def _cache(kind: str, dtype=torch.float32) -> torch.Tensor:
    """A zeroed ``(NB, H, BS, 2D)`` layer cache: ``cpu`` (contiguous), ``nhd`` (FlashAttention's default memory
    order, slot-major inside a block: a strided view) or ``hnd`` (head-major, contiguous)."""
    if kind == "nhd":
        return torch.zeros(NB, BS, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3)
    return torch.zeros(NB, H, BS, 2 * D, dtype=dtype)


CASES = [(CpuAttnLayout(), "cpu"), (FlashAttnLayout(), "nhd"), (FlashAttnLayout(), "hnd")]
IDS = ["cpu", "flash-nhd", "flash-hnd"]


def _fill(layout: PagedLayout, kv: torch.Tensor, tables: torch.Tensor, n: int, g: torch.Generator):
    """Write the first ``n`` slots of every request (rows of ``tables``) one writer call at a time, each call one
    slot per request and head, every head in its own random slot order. Returns the keys/values ``(R, H, n, D)``."""
    R = tables.shape[0]
    keys = torch.randn(R, H, n, D, generator=g).to(kv.dtype)
    values = torch.randn(R, H, n, D, generator=g).to(kv.dtype)
    order = torch.stack([torch.stack([torch.randperm(n, generator=g) for _ in range(H)]) for _ in range(R)])
    blocks, offsets = slot_blocks(tables, n, BS)  # (R, n), (n,)
    for t in range(n):
        slot = order[:, :, t]  # (R, H): a different slot per request and head
        k = keys.gather(2, slot[..., None, None].expand(R, H, 1, D))[:, :, 0]
        v = values.gather(2, slot[..., None, None].expand(R, H, 1, D))[:, :, 0]
        layout.write(kv, blocks.gather(1, slot), offsets[slot], k, v)
    return keys, values


@pytest.mark.parametrize("layout, kind", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reader_returns_what_the_writer_wrote(layout, kind, dtype):
    g = torch.Generator().manual_seed(0)
    kv = _cache(kind, dtype)
    tables = torch.tensor([[5, 2, 7], [1, 9, 3], [12, 0, 15]])  # not contiguous, different per request
    n = 2 * BS + 5
    keys, values = _fill(layout, kv, tables, n, g)
    for r in range(3):
        k, v = layout.read(kv, tables[r], n)
        assert torch.equal(k, keys[r]) and torch.equal(v, values[r])
        layout.check(kv, keys[r], values[r], tables[r])
        with pytest.raises(RuntimeError, match="layout"):
            layout.check(kv, values[r], keys[r], tables[r])
    # nothing else of the cache was written: the entries are exactly the requests' n slots per head
    assert int((kv != 0).sum()) == 3 * H * n * 2 * D
    # the batched reader: values in slot order, logits of a query, and the keys of chosen slots
    gk, gv = layout.gather(kv, tables)
    assert gv.shape == (3, H, 3 * BS, D) and torch.equal(gv[:, :, :n], values)
    q = torch.randn(3, H, 2, D, generator=g)
    x = layout.logits(q, gk)
    assert x.shape == (3, H, 2, 3 * BS)
    torch.testing.assert_close(x[..., :n], q @ keys.float().transpose(-1, -2), rtol=1e-5, atol=1e-5)
    slots = torch.randint(0, n, (3, H, 2), generator=g)
    torch.testing.assert_close(layout.select_keys(gk, slots), keys.gather(2, slots[..., None].expand(-1, -1, -1, D)))


@pytest.mark.parametrize("layout, kind", CASES, ids=IDS)
def test_kernel_memory_views_are_the_entries_the_kernels_address(layout, kind):
    """The keys and values the fused kernels get are views whose elements at (block, head, offset, dim), by the
    strides the layout gives, are the entries :meth:`PagedLayout.read` reads, and whose extent covers exactly what
    the kernels address: Triton's interpreter checks every access against its argument's extent
    (``tests/kernel_bounds.py``), and the CPU layout's values were once a one-element view addressed past its end."""
    g = torch.Generator().manual_seed(1)
    kv = _cache(kind)
    tables = torch.tensor([[NB - 1, 2], [0, 9]])  # the last block: the end of the values' view
    n = 2 * BS
    keys, values = _fill(layout, kv, tables, n, g)
    k_mem, v_mem, ks, vs = layout.kernel_memory(kv)
    for mem, strides, want in ((k_mem, ks, keys), (v_mem, vs, values)):
        assert mem.data_ptr() >= kv.data_ptr()
        got = mem.as_strided((NB, H, BS, D), strides, mem.storage_offset())  # element (b, h, o, i), as addressed
        blocks = tables[:, :, None].expand(-1, -1, BS).reshape(2, n)
        offsets = torch.arange(BS).repeat(2)
        picked = got[blocks, :, offsets]  # (R, n, H, D)
        assert torch.equal(picked.permute(0, 2, 1, 3), want)
        last = sum((size - 1) * stride for size, stride in zip((NB, H, BS, D), strides))
        extent = sum((size - 1) * stride for size, stride in zip(mem.shape, mem.stride()))
        assert extent >= last  # the view holds the farthest element the kernels read


def test_flash_layout_stores_where_flash_attention_reads():
    """FlashAttention's forward (vLLM 0.32) reads ``kv_cache.transpose(1, 2).split(d, dim=-1)``: key and value caches
    ``(num_blocks, block_size, Hkv, d)``; in the default NHD memory order a slot's heads lie next to each other."""
    g = torch.Generator().manual_seed(1)
    base = torch.zeros(NB, BS, H, 2 * D)  # the memory, slot-major inside a block
    kv = base.permute(0, 2, 1, 3)  # the (num_blocks, Hkv, block_size, 2d) view vLLM hands to the backend
    tables = torch.tensor([[4, 11], [8, 2]])
    n = BS + 3
    keys, values = _fill(FlashAttnLayout(), kv, tables, n, g)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    for r in range(2):
        for i in range(n):
            b, o = int(tables[r, i // BS]), i % BS
            for h in range(H):
                assert torch.equal(key_cache[b, o, h], keys[r, h, i])
                assert torch.equal(value_cache[b, o, h], values[r, h, i])
                assert torch.equal(base[b, o, h, :D], keys[r, h, i]) and torch.equal(base[b, o, h, D:], values[r, h, i])


def test_cpu_layout_stores_where_the_cpu_kernel_reads():
    """vLLM's CPU kernels read, per (block, head), the keys transposed ``(d, block_size)`` and then the values
    ``(block_size, d)``."""
    g = torch.Generator().manual_seed(2)
    kv = _cache("cpu")
    tables = torch.tensor([[4, 11], [8, 2]])
    n = BS + 3
    keys, values = _fill(CpuAttnLayout(), kv, tables, n, g)
    flat = kv.view(NB, H, 2 * BS * D)
    for r in range(2):
        for i in range(n):
            b, o = int(tables[r, i // BS]), i % BS
            for h in range(H):
                assert torch.equal(flat[b, h, : BS * D].view(D, BS)[:, o], keys[r, h, i])
                assert torch.equal(flat[b, h, BS * D :].view(BS, D)[o], values[r, h, i])


class _OffDevice(TorchDispatchMode):
    """Records every operation whose tensor arguments or results are not on the ``meta`` device."""

    def __init__(self) -> None:
        super().__init__()
        self.off: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.off.append(f"{func}: {t.device} {tuple(t.shape)}")
        return out


@pytest.mark.parametrize("layout", [CpuAttnLayout(), FlashAttnLayout()], ids=["cpu", "flash"])
@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_decode_step_is_device_agnostic(layout, method):
    """The whole batched decode step on the ``meta`` device (no data): any ``.item()``/``.tolist()``/``bool()`` on a
    tensor raises there, and every tensor any operation takes or makes is on the pool's device, so the step makes no
    host round trip and creates nothing on the CPU (what a CUDA graph needs; nothing was run on a GPU)."""
    m = with_layer_cap(make_method(method), Budget(24))
    W, G, R = 25, 2, 3
    dev = torch.device("meta")
    contexts = None
    if m.layer_facts():  # the model facts on the pool's device, as the plugin reads them from vLLM's model
        inv = torch.empty(D // 2, device=dev)
        contexts = [LayerContext(rotary=Rotary(inv), out_proj=torch.empty(16, H * G * D, device=dev))] * 2
    pool = DecodePool(m, 2, H, D, W, BS, rows=4, layout=layout, device=dev, layer_context=contexts)
    kv = torch.zeros(NB, H, BS, 2 * D, device=dev)
    rows = torch.arange(R, device=dev)
    table = torch.arange(R * 4, device=dev).view(R, 4)
    blocks, offsets = slot_blocks(table, W, BS)
    newest = torch.zeros(R, 1, 1, dtype=torch.int64, device=dev)
    q, k, v = (torch.empty(R, n, D, device=dev) for n in (H * G, H, H))
    with _OffDevice() as guard:
        out = pool.decode_layer(1, rows, table, blocks, offsets, newest, q, k, v, kv, D**-0.5)
    assert out.shape == (R, H * G, D) and out.device == dev
    assert guard.off == []


def test_layout_interface_is_abstract():
    """A layout must implement every operation: the base class cannot be used as one."""
    with pytest.raises(TypeError, match="abstract"):
        PagedLayout()  # type: ignore[abstract]


@pytest.mark.parametrize("layout", [CpuAttnLayout(), FlashAttnLayout()], ids=["cpu", "flash"])
def test_the_pools_fold_equals_the_linear_states_bit_for_bit(layout):
    """The pool folds the victims through its own row buffers; the state must be exactly what
    ``LinearState.fold_slots`` makes of the same rows (the transformers engine's fold), over several steps with rows
    that are and are not over their budget."""
    from slake.attention.linear_state import LinearState

    R, W, nb = 3, 24, 3
    g = torch.Generator().manual_seed(5)
    pool = DecodePool(make_method("slake"), 1, H, D, W, BS, rows=R, layout=layout)
    kv = _cache("cpu" if isinstance(layout, CpuAttnLayout) else "hnd")
    tables = torch.arange(R * nb).view(R, nb)
    _fill(layout, kv, tables, W, g)
    keys, values = layout.gather(kv, tables)
    ours = torch.rand(R, H, D + 1, D + 1, generator=g)
    ref = ours.clone()
    for _ in range(3):
        slots = torch.randint(0, W, (R, H, 1), generator=g)
        chosen = torch.rand(R, H, 1, generator=g) > 0.3
        pool.fold(LinearState(ours), keys, values, slots, chosen)
        k = layout.select_keys(keys, slots)
        v = values.gather(2, slots[..., None].expand(-1, -1, -1, D))
        LinearState(ref).fold_slots(k, v, torch.zeros_like(slots), chosen)
    assert torch.equal(ours, ref)
