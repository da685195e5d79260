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
