"""Reading a request's slots back from vLLM's paged CPU cache, written by vLLM's own op."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from slake.vllm.paged import check_layout, read_slots, slot_mapping


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
    rk, rv = read_slots(kv, blocks, n)
    assert torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))
    check_layout(kv, k.transpose(0, 1), v.transpose(0, 1), blocks)
    with pytest.raises(RuntimeError, match="layout"):
        check_layout(kv, v.transpose(0, 1), k.transpose(0, 1), blocks)


def test_slot_mapping_follows_the_block_table():
    assert slot_mapping(torch.tensor([4, 1, 6]), 5, 2).tolist() == [8, 9, 2, 3, 12]


def test_batched_reader_and_per_head_writer_follow_vllms_layout():
    from slake.vllm.paged import block_logits, gather_rows, slot_blocks, write_slot

    nb, H, bs, d, n = 10, 3, 32, 64, 70
    kv = torch.zeros(nb, H, bs, 2 * d)
    key_cache, value_cache = kv.view(nb, H, 2 * bs, d).chunk(2, dim=2)
    tables = torch.tensor([[5, 2, 7], [1, 9, 3]])
    ks = [torch.randn(n, H, d) for _ in range(2)]
    vs = [torch.randn(n, H, d) for _ in range(2)]
    for r in range(2):
        ops.cpu_attn_reshape_and_cache(ks[r], vs[r], key_cache, value_cache, slot_mapping(tables[r], n, bs), "vec")
    keys_t, values = gather_rows(kv, tables)
    assert values.shape == (2, H, 3 * bs, d)
    for r in range(2):
        assert torch.equal(values[r, :, :n], vs[r].transpose(0, 1))
        q = torch.randn(H, 2, d)
        ref = q @ ks[r].permute(1, 2, 0)  # (H, 2, n)
        torch.testing.assert_close(block_logits(q[None], keys_t[r : r + 1])[0, :, :, :n], ref)
    # one slot per request and head, each head its own: read back by vLLM's layout
    blocks, offsets = slot_blocks(tables, 3 * bs, bs)
    slot = torch.tensor([[4, 40, 69], [0, 33, 64]])
    k_new, v_new = torch.randn(2, H, d), torch.randn(2, H, d)
    write_slot(kv, blocks.gather(1, slot), offsets[slot], k_new, v_new)
    for r in range(2):
        rk, rv = read_slots(kv, tables[r], n)
        for h in range(H):
            assert torch.equal(rk[h, slot[r, h]], k_new[r, h]) and torch.equal(rv[h, slot[r, h]], v_new[r, h])
            other = [i for i in range(n) if i != slot[r, h]]
            assert torch.equal(rk[h, other], ks[r][other, h])
