"""Reading a request's slots back from vLLM's paged caches: the CPU layout against what vLLM's own op writes, the
FlashAttention layout on cache views built by vLLM's own allocator code for each of its memory layouts."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout, slot_blocks, slot_mapping

CPU = CpuAttnLayout()


@pytest.mark.parametrize(
    "dtype, head_dim, isa", [(torch.float32, 64, "vec"), (torch.bfloat16, 32, "vec"), (torch.float32, 48, "vec16")]
)
def test_vllm_written_slots_read_back_exactly(dtype, head_dim, isa):
    nb, H, bs, n = 8, 3, 32, 70
    kv = torch.zeros(nb, H, bs, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv.view(nb, H, 2 * bs, head_dim).chunk(2, dim=2)
    blocks = torch.tensor([5, 2, 7])  # a request's blocks, not contiguous
    k = torch.randn(n, H, head_dim).to(dtype)
    v = torch.randn(n, H, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping(blocks, n, bs), isa)
    rk, rv = CPU.read(kv, blocks, n)
    assert torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))
    CPU.check(kv, k.transpose(0, 1), v.transpose(0, 1), blocks)
    with pytest.raises(RuntimeError, match="layout"):
        CPU.check(kv, v.transpose(0, 1), k.transpose(0, 1), blocks)


def test_slot_mapping_follows_the_block_table():
    assert slot_mapping(torch.tensor([4, 1, 6]), 5, 2).tolist() == [8, 9, 2, 3, 12]


def test_batched_reader_and_per_head_writer_follow_vllms_layout():
    nb, H, bs, d, n = 10, 3, 32, 64, 70
    kv = torch.zeros(nb, H, bs, 2 * d)
    key_cache, value_cache = kv.view(nb, H, 2 * bs, d).chunk(2, dim=2)
    tables = torch.tensor([[5, 2, 7], [1, 9, 3]])
    ks = [torch.randn(n, H, d) for _ in range(2)]
    vs = [torch.randn(n, H, d) for _ in range(2)]
    for r in range(2):
        ops.cpu_attn_reshape_and_cache(ks[r], vs[r], key_cache, value_cache, slot_mapping(tables[r], n, bs), "vec")
    keys_t, values = CPU.gather(kv, tables)
    assert values.shape == (2, H, 3 * bs, d)
    for r in range(2):
        assert torch.equal(values[r, :, :n], vs[r].transpose(0, 1))
        q = torch.randn(H, 2, d)
        ref = q @ ks[r].permute(1, 2, 0)  # (H, 2, n)
        torch.testing.assert_close(CPU.logits(q[None], keys_t[r : r + 1])[0, :, :, :n], ref)
    # one slot per request and head, each head its own: read back by vLLM's layout
    blocks, offsets = slot_blocks(tables, 3 * bs, bs)
    slot = torch.tensor([[4, 40, 69], [0, 33, 64]])
    k_new, v_new = torch.randn(2, H, d), torch.randn(2, H, d)
    CPU.write(kv, blocks.gather(1, slot), offsets[slot], k_new, v_new)
    for r in range(2):
        rk, rv = CPU.read(kv, tables[r], n)
        for h in range(H):
            assert torch.equal(rk[h, slot[r, h]], k_new[r, h]) and torch.equal(rv[h, slot[r, h]], v_new[r, h])
            other = [i for i in range(n) if i != slot[r, h]]
            assert torch.equal(rk[h, other], ks[r][other, h])


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC"])
def test_flash_layout_on_vllms_own_cache_views(name):
    """vLLM 0.32 allocates one buffer and gives each layer a strided ``(num_blocks, Hkv, block_size, 2 * d)`` view
    whose memory order is the resolved ``KVCacheLayout`` (NHD ``LBNHC`` by default, HND ``LBHNC``, block-outermost
    ``BLNHC``). What :class:`FlashAttnLayout` writes per head is what FlashAttention's forward and FlashInfer's
    forward take out of that view (their own split, copied from vLLM's source), and it reads back exactly."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[name]
    nb, H, bs, d, L = 12, 3, 8, 16, 2
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=d, dtype=torch.float32)
    page = spec.page_size_bytes
    strides = (page * nb, page) if layout.is_layer_compact else (page, page * L)
    tensor = KVCacheTensor(size=page * nb * L, layers=["l0", "l1"], layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(page * nb * L, dtype=torch.int8)
    kv, other = create_kv_cache_views(raw, spec, nb, layout, tensor)
    assert kv.shape == (nb, H, bs, 2 * d)
    fa = FlashAttnLayout()
    tables = torch.tensor([[5, 2, 7], [1, 9, 3]])
    n = 3 * bs - 2
    g = torch.Generator().manual_seed(0)
    ks, vs = torch.randn(2, n, H, d, generator=g), torch.randn(2, n, H, d, generator=g)
    blocks, offsets = slot_blocks(tables, n, bs)
    for i in torch.randperm(n, generator=g).tolist():  # every slot once, in a random order
        fa.write(kv, blocks[:, i, None].expand(2, H), offsets[i].expand(2, H), ks[:, i], vs[:, i])
    key_fa, value_fa = kv.transpose(1, 2).split(d, dim=-1)  # FlashAttentionImpl.forward
    key_fi, value_fi = kv.permute(*layout.layer_view_order).split(d, dim=-1)  # FlashInferImpl.forward
    for r in range(2):
        rk, rv = fa.read(kv, tables[r], n)
        assert torch.equal(rk, ks[r].transpose(0, 1)) and torch.equal(rv, vs[r].transpose(0, 1))
        fa.check(kv, ks[r].transpose(0, 1), vs[r].transpose(0, 1), tables[r])
        for i in (0, bs - 1, bs, n - 1):
            b, o = int(tables[r, i // bs]), i % bs
            assert torch.equal(key_fa[b, o], ks[r, i]) and torch.equal(value_fa[b, o], vs[r, i])  # (Hkv, d)
            fi = (key_fi[b, o], value_fi[b, o]) if name != "LBHNC" else (key_fi[b, :, o], value_fi[b, :, o])  # NHD/HND
            assert torch.equal(fi[0], ks[r, i]) and torch.equal(fi[1], vs[r, i])
    assert not other.any()  # the other layer's pages are untouched
