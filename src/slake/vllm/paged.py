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


# ---------------------------------------------------------------------------------------------------------------
# Batched access for the decode step (:mod:`slake.vllm.batched`): many requests' slots at once, one op each.


def _views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``(nb, H, d, bs)`` (transposed inside a block) and values ``(nb, H, bs, d)`` views of one layer's cache."""
    nb, H, bs, d2 = kv_cache.shape
    d = d2 // 2
    flat = kv_cache.view(nb, H, 2 * bs * d)
    return flat[:, :, : bs * d].view(nb, H, d, bs), flat[:, :, bs * d :].view(nb, H, bs, d)


def slot_blocks(table: torch.Tensor, width: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block id ``(R, width)`` and in-block offset ``(width,)`` of every slot ``0..width-1`` of ``R`` requests whose
    block tables are the rows of ``table`` ``(R, >= ceil(width / block_size))``."""
    i = torch.arange(width, dtype=torch.int64)
    return table.to(torch.int64)[:, i // block_size], i % block_size


def gather_rows(kv_cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``R`` requests' first ``nb * block_size`` slots: keys block-wise transposed
    ``(R, nb, H, d, block_size)`` (vLLM's layout, a view), values ``(R, H, nb * block_size, d)`` slot-major.

    ``table`` ``(R, nb)``: each request's block ids in slot order. Whole blocks are copied with one
    ``index_select`` (contiguous rows of the cache); only the values are then laid out slot-major (one copy).
    Several times faster on CPU than indexing single slots out of the transposed key layout."""
    nb_all, H, bs, d2 = kv_cache.shape
    d = d2 // 2
    R, nb = table.shape
    blk = kv_cache.index_select(0, table.reshape(-1)).view(R, nb, H, 2 * bs * d)
    keys_t = blk[..., : bs * d].view(R, nb, H, d, bs)
    values = blk[..., bs * d :].view(R, nb, H, bs, d).permute(0, 2, 1, 3, 4).reshape(R, H, nb * bs, d)
    return keys_t, values


def block_logits(queries: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """``queries`` ``(R, H, g, d)`` float32 times the block-wise transposed keys of :func:`gather_rows`:
    logits ``(R, H, g, nb * block_size)`` in slot order (one batched matmul, no copy of the keys)."""
    R, nb, H, d, bs = keys_t.shape
    g = queries.shape[2]
    x = torch.matmul(queries.unsqueeze(1), keys_t if keys_t.dtype == queries.dtype else keys_t.to(queries.dtype))
    return x.permute(0, 2, 3, 1, 4).reshape(R, H, g, nb * bs)  # (R, nb, H, g, bs) -> slot order


def write_slot(
    kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Write one key/value per request and KV head, each to its own slot: ``blocks``/``offsets`` ``(R, H)``,
    ``keys``/``values`` ``(R, H, d)``. Unlike vLLM's cache-write op (one slot per token for every head), each head
    may take a different slot, as per-head eviction frees different slots per head."""
    keys_t, vals = _views(kv_cache)
    H = kv_cache.shape[1]
    h = torch.arange(H, dtype=torch.int64).view(1, H)
    keys_t[blocks, h, :, offsets] = keys.to(kv_cache.dtype)
    vals[blocks, h, offsets, :] = values.to(kv_cache.dtype)
