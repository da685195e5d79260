"""Reading and writing compressed requests' slots in vLLM's paged KV cache, behind one small interface.

The decode pool (:mod:`slake.engines.vllm.plugin.decode_pool`) and the backend never index a cache tensor themselves:
they call a
:class:`PagedLayout`, which knows how one layer's cache tensor stores a key and a value. Two layouts exist:

* :class:`CpuAttnLayout`: vLLM's ``CPU_ATTN`` backend, the one the plugin runs on. A layer's cache is
  ``(num_blocks, Hkv, block_size, 2 * d)``; inside a block and head the keys are stored transposed
  ``(d, block_size)`` and then the values row-major ``(block_size, d)`` (the layout of vLLM's ``vec``/``vec16`` CPU
  kernels).
* :class:`FlashAttnLayout`: vLLM 0.32's FlashAttention (and FlashInfer) per-layer view, the same logical shape
  ``(num_blocks, Hkv, block_size, 2 * d)`` with the key in ``[..., :d]`` and the value in ``[..., d:]`` of every
  (block, head, offset); its memory order is vLLM's resolved ``KVCacheLayout`` (``NHD`` by default: slot-major
  inside a block), which only changes the strides. Tested on CPU tensors, and on an H100 without vLLM; no GPU
  backend uses it yet (``docs/gpu.md``).

A request's cache slot ``i`` lives in block ``block_ids[i // block_size]`` at offset ``i % block_size``, whatever
the layout. Every operation is device-agnostic torch: no host synchronisation and no Python branch on tensor values,
so the decode step's calls can be captured in a CUDA graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from slake.attention.softmax import matmul_f32

__all__ = ["CpuAttnLayout", "FlashAttnLayout", "PagedLayout", "slot_blocks", "slot_mapping"]


def slot_mapping(block_ids: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Global slot indices (``block * block_size + offset``) of a request's first ``n`` cache slots."""
    i = torch.arange(n, dtype=torch.int64, device=block_ids.device)
    return block_ids.to(torch.int64)[i // block_size] * block_size + i % block_size


def slot_blocks(table: torch.Tensor, width: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block id ``(R, width)`` and in-block offset ``(width,)`` of every slot ``0..width-1`` of ``R`` requests whose
    block tables are the rows of ``table`` ``(R, >= ceil(width / block_size))``."""
    i = torch.arange(width, dtype=torch.int64, device=table.device)
    return table.to(torch.int64)[:, i // block_size], i % block_size


class PagedLayout(ABC):
    """How one layer's paged cache tensor stores keys and values: what the decode pool and the backend need.

    ``kv_cache`` is always one layer's ``(num_blocks, Hkv, block_size, 2 * d)`` tensor as vLLM hands it to the
    attention backend; what the last two axes mean is the layout's business. Subclasses implement the six
    operations below; :meth:`check` is shared.
    """

    name = "abstract"
    #: the kernel ISAs of vLLM's CPU backend (the metadata builder's ``isa``) whose cache layout this layout reads;
    #: an engine whose builder picks another stops at start-up (empty: the layout is not a CPU one)
    isas: tuple[str, ...] = ()
    #: ISAs whose layout is known to differ: refused at start-up
    refused_isas: tuple[str, ...] = ()

    def __init__(self) -> None:
        #: ``torch.arange(n)`` per ``(n, device)``: the step's constant index tensors (request and head numbers),
        #: made once per layout (one per engine) instead of once per operation; never written to
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        key = (int(n), torch.device(device))
        t = self._aranges.get(key)
        if t is None:
            if len(self._aranges) > 256:  # request counts vary; keep the memo bounded
                self._aranges.clear()
            t = self._aranges[key] = torch.arange(n, dtype=torch.int64, device=device)
        return t

    @abstractmethod
    def gather(self, kv_cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``R`` requests' first ``nb * block_size`` slots, ``table`` ``(R, nb)`` their block
        ids in slot order. Returns ``(keys, values)``: ``keys`` in the form this layout's :meth:`logits` and
        :meth:`select_keys` take (layout-specific), ``values`` ``(R, Hkv, nb * block_size, d)`` in slot order (may
        be a strided view)."""

    @abstractmethod
    def logits(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``queries`` ``(R, Hkv, g, d)`` float32 times the gathered ``keys``: ``(R, Hkv, g, nb * block_size)``
        float32 in slot order (one batched matmul)."""

    @abstractmethod
    def select_keys(self, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The gathered keys of ``slots`` ``(R, Hkv, k)`` (slot indices per request and head): ``(R, Hkv, k, d)``."""

    @abstractmethod
    def dense_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The gathered ``keys`` as ``(R, Hkv, nb * block_size, d)`` in slot order (a copy or a view), for decode
        rules that read the kept keys themselves (KeyDiff, Expected Attention)."""

    @abstractmethod
    def write(
        self,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Write one key/value per row and KV head, each to its own slot: ``blocks``/``offsets`` ``(R, Hkv)``,
        ``keys``/``values`` ``(R, Hkv, d)``. Unlike vLLM's cache-write ops (one slot per token for every head),
        each head may take a different slot, as per-head eviction frees different slots per head. (``R`` rows
        may as well be ``n`` slots of one request: ``blocks[i, h]``, ``offsets[i, h]`` of its slot ``i``.)"""

    @abstractmethod
    def kernel_memory(
        self, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int], tuple[int, int, int, int]]:
        """Keys and values as the fused decode kernels address them (:class:`slake.cache.decode_step.KVMemory`):
        ``(keys, values, key strides, value strides)``, views of ``kv_cache`` whose first element is element 0 of
        block 0, head 0, offset 0, and the element strides of (block, head, offset, dim)."""

    @abstractmethod
    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of a request's first ``n`` slots, each ``(Hkv, n, d)`` (copies); ``block_ids``
        ``(>= ceil(n / block_size),)`` the request's block ids in slot order."""

    def check(self, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Raise ``RuntimeError`` unless :meth:`read` returns exactly ``keys``/``values`` (``(Hkv, n, d)``), the
        entries vLLM's own cache-write op just wrote to the request's first ``n`` slots. Run once per process, so
        that a vLLM build storing another layout fails loudly instead of corrupting the cache (a host
        synchronisation: never inside the decode step)."""
        k, v = self.read(kv_cache, block_ids, keys.shape[1])
        if not (torch.equal(k, keys) and torch.equal(v, values)):
            raise RuntimeError(
                f"slake: this vLLM build stores the KV cache in a layout the plugin cannot read as {self.name} "
                "(e.g. AMX bf16 on CPU); run the model in float32/float16 or without AMX"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CpuAttnLayout(PagedLayout):
    """vLLM's ``CPU_ATTN`` layout: per (block, head), the keys transposed ``(d, block_size)``, then the values
    ``(block_size, d)``.

    :meth:`gather` copies whole (block, head) rows with two ``index_select`` calls, one over the keys' half of the
    cache and one over the values' half, ordered by request, head and block, so that the values come out slot-major
    with no further copy; the keys stay block-transposed and :meth:`logits` multiplies them per block without a copy
    (several times faster on CPU than indexing single slots out of the transposed key layout)."""

    name = "CPU_ATTN"
    #: vLLM's ``vec`` and ``vec16`` kernels store this layout; ``amx`` (bfloat16 with a block size that is a multiple
    #: of 32 on an AMX CPU) packs the keys for its tile instructions (refused at start-up); the other ISAs (``neon``,
    #: ``vsx``, ``vxe``, ``rvv``) were never run with the plugin (a warning; the first write's check still guards)
    isas = ("vec", "vec16")
    refused_isas = ("amx",)

    @staticmethod
    def _views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``(nb, H, d, bs)`` (transposed inside a block) and values ``(nb, H, bs, d)`` views of the cache."""
        nb, H, bs, d2 = kv_cache.shape
        d = d2 // 2
        flat = kv_cache.view(nb, H, 2 * bs * d)
        return flat[:, :, : bs * d].view(nb, H, d, bs), flat[:, :, bs * d :].view(nb, H, bs, d)

    def gather(self, kv_cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys block-wise transposed ``(R, H, nb, d, block_size)``, values ``(R, H, nb * block_size, d)``
        slot-major: each one ``index_select`` of its half of the (block, head) rows (the cache is read once, and
        nothing is copied twice)."""
        nblk, H, bs, d2 = kv_cache.shape
        d = d2 // 2
        R, nb = table.shape
        if kv_cache.stride(0) != H * kv_cache.stride(1):  # blocks not evenly spaced: whole blocks, then the values
            blk = kv_cache.index_select(0, table.reshape(-1)).view(R, nb, H, 2 * bs * d)
            keys = blk[..., : bs * d].view(R, nb, H, d, bs).transpose(1, 2)
            return keys, blk[..., bs * d :].view(R, nb, H, bs, d).transpose(1, 2).reshape(R, H, nb * bs, d)
        rows = kv_cache.view(nblk * H, 2 * bs * d)  # one row per (block, head): its keys, then its values
        # row ``block * H + head`` of every (request, head, block), in that order
        index = torch.add(self._arange(H, table.device).view(1, H, 1), table[:, None, :], alpha=H).view(-1)
        keys = rows[:, : bs * d].index_select(0, index).view(R, H, nb, d, bs)
        values = rows[:, bs * d :].index_select(0, index).view(R, H, nb * bs, d)
        return keys, values

    def logits(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        R, H, nb, d, bs = keys.shape
        g = queries.shape[2]
        x = torch.matmul(queries.unsqueeze(2), keys if keys.dtype == queries.dtype else keys.to(queries.dtype))
        return x.transpose(2, 3).reshape(R, H, g, nb * bs)  # (R, H, nb, g, bs) -> slot order

    def select_keys(self, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        R, H, nb, d, bs = keys.shape
        r = self._arange(R, slots.device).view(R, 1, 1)
        h = self._arange(H, slots.device).view(1, H, 1)
        blk, off = torch.floor_divide(slots, bs), torch.remainder(slots, bs)
        return keys[r, h, blk, :, off]  # advanced indices split by a slice go first: (R, H, k, d)

    def dense_keys(self, keys: torch.Tensor) -> torch.Tensor:
        R, H, nb, d, bs = keys.shape
        return keys.transpose(-1, -2).reshape(R, H, nb * bs, d)  # (R, H, nb, bs, d): one copy

    def write(
        self,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        keys_t, vals = self._views(kv_cache)
        H = kv_cache.shape[1]
        h = self._arange(H, blocks.device).view(1, H)
        keys_t[blocks, h, :, offsets] = keys.to(kv_cache.dtype)
        vals[blocks, h, offsets, :] = values.to(kv_cache.dtype)

    def kernel_memory(
        self, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int], tuple[int, int, int, int]]:
        nb, H, bs, d2 = kv_cache.shape
        d = d2 // 2
        sb, sh = kv_cache.stride(0), kv_cache.stride(1)
        # the values follow the (d, block_size) keys of a block and head: a view starting there, of exactly the
        # elements the kernels address (not a one-element base whose reads run past its end)
        values = kv_cache.as_strided((nb, H, bs, d), (sb, sh, d, 1), kv_cache.storage_offset() + bs * d)
        return kv_cache, values, (sb, sh, 1, bs), (sb, sh, d, 1)

    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys_t, values = self._views(kv_cache)
        bs = kv_cache.shape[2]
        i = torch.arange(n, dtype=torch.int64, device=block_ids.device)
        blk = block_ids.to(torch.int64)[i // bs]
        off = i % bs
        k = keys_t[blk, :, :, off]  # (n, H, d): advanced indices split by slices go first
        v = values[blk, :, off, :]  # (n, H, d)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


class FlashAttnLayout(PagedLayout):
    """vLLM 0.32's FlashAttention layout: the key of (block ``b``, head ``h``, offset ``o``) is
    ``kv_cache[b, h, o, :d]`` and its value ``kv_cache[b, h, o, d:]`` (FlashAttention's forward reads
    ``kv_cache.transpose(1, 2).split(d, dim=-1)``, i.e. ``(num_blocks, block_size, Hkv, d)`` key and value caches).

    The tensor's strides follow vLLM's resolved ``KVCacheLayout`` (``LBNHC`` = NHD by default, ``LBHNC`` = HND,
    block-outermost variants); every operation here indexes the logical view, so it holds for all of them, and for
    FlashInfer's view of the same tensor (``kv_cache.permute(*layout.layer_view_order).split(d, dim=-1)``).
    :meth:`gather` reads the rows' slots straight into slot-major order ``(R, Hkv, slots, 2 * d)`` with one gather
    (one pass over the kept cache, the cheapest on a GPU; on CPU whole-block ``index_select`` is faster, which is why
    :class:`CpuAttnLayout` uses it); keys and values are views of it, and :meth:`logits` is one matmul over the slots
    (the transformers engine's own product, :func:`slake.attention.softmax.matmul_f32`)."""

    name = "FLASH_ATTN"

    def gather(self, kv_cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(R, H, nb * block_size, d)``, slot-major views of one gathered copy."""
        _, H, bs, d2 = kv_cache.shape
        d = d2 // 2
        blocks, offsets = slot_blocks(table, table.shape[1] * bs, bs)  # (R, slots), (slots,)
        h = self._arange(H, table.device).view(1, H, 1)
        kv = kv_cache[blocks[:, None, :], h, offsets]  # (R, H, slots, 2d)
        return kv[..., :d], kv[..., d:]

    def logits(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return matmul_f32(queries, keys.transpose(-1, -2))  # (R, H, g, d) @ (R, H, d, slots)

    def select_keys(self, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return keys.gather(2, slots[..., None].expand(-1, -1, -1, keys.shape[-1]))

    def dense_keys(self, keys: torch.Tensor) -> torch.Tensor:
        return keys  # already slot-major

    def write(
        self,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        H = kv_cache.shape[1]
        h = self._arange(H, blocks.device).view(1, H)
        kv_cache[blocks, h, offsets] = torch.cat([keys, values], dim=-1).to(kv_cache.dtype)  # one scatter

    def kernel_memory(
        self, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int], tuple[int, int, int, int]]:
        d = kv_cache.shape[3] // 2
        strides = tuple(kv_cache.stride())
        return kv_cache, kv_cache[..., d:], strides, strides  # type: ignore[return-value]

    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs, d = kv_cache.shape[2], kv_cache.shape[3] // 2
        i = torch.arange(n, dtype=torch.int64, device=block_ids.device)
        x = kv_cache[block_ids.to(torch.int64)[i // bs], :, i % bs]  # (n, H, 2d): advanced indices go first
        return x[..., :d].transpose(0, 1).contiguous(), x[..., d:].transpose(0, 1).contiguous()
