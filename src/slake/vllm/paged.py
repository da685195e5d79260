"""Reading and writing one request's slots in vLLM's paged CPU KV cache (``CPU_ATTN`` backend, vLLM 0.32).

A layer's cache tensor is ``(num_blocks, Hkv, block_size, 2 * d)``. Inside a block and head, the values are stored
row-major ``(block_size, d)`` and the keys transposed ``(d, block_size)`` (the layout vLLM's ``vec``/``vec16`` CPU
kernels read). Writes go through vLLM's own ``cpu_attn_reshape_and_cache`` op; reads use that layout, and
:func:`check_layout` verifies once per process that what the op wrote reads back bit-exactly, so a different layout
(e.g. AMX's packed bf16 keys) fails loudly instead of corrupting the cache.

A request's cache slot ``i`` lives in block ``block_ids[i // block_size]`` at offset ``i % block_size``.
"""

from __future__ import annotations

import torch


def slot_mapping(block_ids: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Global slot indices (``block * block_size + offset``) of a request's first ``n`` cache slots."""
    i = torch.arange(n, dtype=torch.int64)
    return block_ids.to(torch.int64)[i // block_size] * block_size + i % block_size


def read_slots(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a request's first ``n`` slots, each ``(Hkv, n, d)`` (copies).

    Parameters
    ----------
    kv_cache : torch.Tensor
        One layer's cache, ``(num_blocks, Hkv, block_size, 2 * d)``.
    block_ids : torch.Tensor
        ``(>= ceil(n / block_size),)`` int block ids of the request, in slot order.
    n : int
        Number of slots to read.
    """
    nb, H, bs, d2 = kv_cache.shape
    d = d2 // 2
    flat = kv_cache.view(nb, H, 2 * bs * d)
    keys_t = flat[:, :, : bs * d].view(nb, H, d, bs)
    values = flat[:, :, bs * d :].view(nb, H, bs, d)
    i = torch.arange(n, dtype=torch.int64)
    blk = block_ids.to(torch.int64)[i // bs]
    off = i % bs
    k = keys_t[blk, :, :, off]  # (n, H, d): advanced indices split by slices go first
    v = values[blk, :, off, :]  # (n, H, d)
    return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


def check_layout(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Raise ``RuntimeError`` unless :func:`read_slots` returns exactly ``keys``/``values`` (``(Hkv, n, d)``),
    the entries just written by vLLM's op to the request's first ``n`` slots."""
    n = keys.shape[1]
    k, v = read_slots(kv_cache, block_ids, n)
    if not (torch.equal(k, keys) and torch.equal(v, values)):
        raise RuntimeError(
            "slake: this vLLM build stores the CPU KV cache in a layout the plugin cannot read "
            "(e.g. AMX bf16); run the model in float32/float16 or without AMX"
        )
