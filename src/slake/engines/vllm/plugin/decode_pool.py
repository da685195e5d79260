"""The batched decode step of compressed requests: one computation per layer for all of them (worker side).

After a compressed request's prefill (done per request by :class:`slake.cache.compressed.CompressedKV`), its
per-slot metadata moves into one row of a :class:`DecodePool`: persistent per-layer tensors ``(rows, Hkv, W)``
(positions, validity, scores), the layer's target size ``(rows, Hkv)`` and, for methods with a PTAA linear state
(SLAKE, ``cake[linear_cache=true]``), ``(rows, Hkv, d + 1, d + 1)``; for methods that weigh each slot by its value
(``Method.slot_weighted``: CriticalKV), the slots' weights ``(rows, Hkv, W)``; with the fused kernels and a decode
rule that pools by position, the slots' order as the last step left it ``(rows, Hkv, W)`` int32
(:func:`slake.cache.fused_step.keeps_order`). ``W`` is the most slots a compressed
request holds (:meth:`slake.engines.vllm.plugin.config.SlakeVllmConfig.slots`); a row's slots beyond its own are
invalid.
Keys and values stay in vLLM's paged blocks only.

Each decode step, per layer, :meth:`DecodePool.decode_layer` runs the decode step the transformers engine runs
(:func:`slake.cache.decode_step.decode_step`: append into each row's free slot, attention with the linear term,
the method's decode scores, one victim per row and KV head, fold, eviction) for all ``R`` decoding compressed
requests at once, with no loop over requests; on CUDA its fused Triton kernels (:mod:`slake.kernels`). The two
engines differ only in how a step reads and writes slots: here :class:`PagedSlots`, through a
:class:`slake.engines.vllm.plugin.paged.PagedLayout` (vLLM's ``CPU_ATTN`` layout by default;
:class:`slake.engines.vllm.plugin.paged.FlashAttnLayout` for a GPU backend, ``docs/gpu.md``). Only the new token's
slot is written; the rest of the kept cache is only read. A request's tokens equal its batch-1 run in the
transformers engine; the tests say so for every supported method.
"""

from __future__ import annotations

import torch

from slake.attention.linear_state import LinearState
from slake.cache.compressed import kernel_choice
from slake.cache.decode_step import KVMemory, StepSlots
from slake.cache.fused_step import KernelReport, keeps_order, run_step
from slake.engines.vllm.plugin.paged import CpuAttnLayout, PagedLayout
from slake.methods.base import LayerContext, Method


class DecodePool:
    """Per-layer decode metadata of the compressed requests of one worker, one row per request.

    Parameters
    ----------
    method : Method
        The engine's method (its ``decode_scores``, window, sinks, ``evict_before_output``, ``linear_cache``).
    num_layers, kv_heads, head_dim : int
        Model shape on this worker.
    width : int
        Slots per row (the most any compressed request holds).
    block_size : int
        vLLM's block size.
    rows : int
        Initial rows; the pool doubles when full (at a prefill, never inside a decode step).
    layout : PagedLayout | None
        How vLLM's cache tensor stores keys and values (default:
        :class:`~slake.engines.vllm.plugin.paged.CpuAttnLayout`).
    device : torch.device | str | None
        Where the pool's tensors live (default: CPU); the decode step's inputs must be there too.
    kernels : str
        The decode step's implementation: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton's fused kernels on NVIDIA
        GPUs, torch elsewhere; :func:`slake.cache.compressed.resolve_kernels`).
    layer_context : list of LayerContext, optional
        One per layer: the model facts the method's decode rule reads (``method.layer_facts()``: the rotary
        embedding of Expected Attention, CriticalKV's output projection); None for methods that read none.
    """

    def __init__(
        self,
        method: Method,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        width: int,
        block_size: int,
        rows: int = 8,
        layout: PagedLayout | None = None,
        device: torch.device | str | None = None,
        kernels: str = "auto",
        layer_context: list[LayerContext] | None = None,
    ) -> None:
        if method.layer_facts() and (layer_context is None or len(layer_context) != num_layers):
            raise ValueError(
                f"slake: {method.name} reads the model's {' and '.join(method.layer_facts())} at decode: the pool "
                f"needs one LayerContext per layer ({num_layers})"
            )
        self.method = method
        self.layer_context = layer_context
        self.layout = CpuAttnLayout() if layout is None else layout
        self.device = torch.device("cpu" if device is None else device)
        self.kernels, why = kernel_choice(kernels, self.device)
        for context in layer_context or ():  # a decode rule's per-layer map, made now rather than in a captured step
            method.decode_query_map(context, head_dim, self.device)
        #: which implementation ran the decode steps (and why a requested fused step did not)
        self.report = KernelReport()
        self.report.auto = why  # why "auto" chose the torch step on a GPU (None otherwise), as the engine's cache says
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.width, self.block_size = width, block_size
        self.linear_cache = bool(getattr(method, "linear_cache", False))
        self.rows = 0
        self.free_rows: list[int] = []
        #: host-side: per row, the slots each layer can occupy (see :meth:`load_layer`), read by :meth:`layer_widths`
        #: when the step is planned, so that no device value is read in the step
        self.row_widths: dict[int, list[int]] = {}
        self._fold_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grow(max(int(rows), 1))

    # ------------------------------------------------------------------ rows
    def _grow(self, extra: int) -> None:
        L, H, W, d = self.num_layers, self.kv_heads, self.width, self.head_dim

        def new(shape, fill, dtype):
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        def cat(old, t):  # per-layer tensors: rows on dim 1
            return t if old is None else torch.cat([old, t], dim=1)

        n = extra
        self.positions = cat(getattr(self, "positions", None), new((L, n, H, W), -1, torch.int64))
        self.valid = cat(getattr(self, "valid", None), new((L, n, H, W), False, torch.bool))
        self.scores = cat(getattr(self, "scores", None), new((L, n, H, W), float("-inf"), torch.float32))
        self.target = cat(getattr(self, "target", None), new((L, n, H), -1, torch.int64))
        if self.method.slot_weighted:
            self.weights = cat(getattr(self, "weights", None), new((L, n, H, W), 0.0, torch.float32))
        else:
            self.weights = None
        if keeps_order(self.method, self.kernels):  # the fused step's slot order (any content is safe)
            self.order = cat(getattr(self, "order", None), new((L, n, H, W), 0, torch.int32))
        else:
            self.order = None
        if self.linear_cache:
            self.linear = cat(getattr(self, "linear", None), new((L, n, H, d + 1, d + 1), 0.0, torch.float32))
        else:
            self.linear = None
        self.prompt_len = torch.cat([getattr(self, "prompt_len", new((0,), 0, torch.int64)), new((n,), 0, torch.int64)])
        self.budget = torch.cat([getattr(self, "budget", new((0,), 0, torch.int64)), new((n,), 0, torch.int64)])
        self.seen = torch.cat([getattr(self, "seen", new((0,), 0, torch.int64)), new((n,), 0, torch.int64)])
        self.free_rows.extend(range(self.rows, self.rows + n))
        self.rows += n

    def allocate(self, prompt_len: int, budget: int) -> int:
        """A free row for a request of ``prompt_len`` tokens (the pool doubles when none is free)."""
        if not self.free_rows:
            self._grow(self.rows)
        row = min(self.free_rows)  # the lowest: the running rows stay contiguous (see decode_layer's ``rows``)
        self.free_rows.remove(row)
        self.positions[:, row] = -1
        self.valid[:, row] = False
        self.scores[:, row] = float("-inf")
        self.target[:, row] = -1
        if self.linear is not None:
            self.linear[:, row] = 0
        if self.weights is not None:
            self.weights[:, row] = 0.0
        self.prompt_len[row], self.budget[row], self.seen[row] = prompt_len, budget, prompt_len
        self.row_widths[row] = [self.width] * self.num_layers
        return row

    def release(self, row: int) -> None:
        """Return a row to the free list (its contents are reset at the next :meth:`allocate`)."""
        if row not in self.free_rows:
            self.free_rows.append(row)

    def load_layer(self, row: int, layer: int, store, target: torch.Tensor | None) -> None:
        """Copy a prefilled layer's metadata (a batch-1 ``LayerStore``) into ``row``; slots keep their indices."""
        n = store.positions.shape[-1]
        if n > self.width:
            raise RuntimeError(f"slake: layer {layer} keeps {n} slots, more than the {self.width} a request holds")
        self.positions[layer, row, :, :n] = store.positions[0]
        self.valid[layer, row, :, :n] = store.valid[0]
        self.scores[layer, row, :, :n] = store.scores[0]
        self.target[layer, row] = -1 if target is None else target[0]
        # The slots this layer can occupy from now on: a step inserts into the first free slot and evicts down to
        # the target, so the occupied slots stay below max(n, target + 1); without a target, the whole row.
        # (A host read of the target, once per prefilled layer: never inside a decode step.)
        if target is None or int(target[0].min()) < 0:
            self.row_widths[row][layer] = self.width
        else:
            self.row_widths[row][layer] = min(self.width, max(n, int(target[0].max()) + 1))
        if self.linear is not None and store.linear is not None:
            self.linear[layer, row] = store.linear.aug[0]
        if self.weights is not None:
            weights = store.weights
            if weights is None:
                context = None if self.layer_context is None else self.layer_context[layer]
                weights = self.method.slot_weights(store.dense_values().float(), context)
            self.weights[layer, row, :, :n] = weights[0]

    def layer_widths(self, rows: list[int]) -> list[int]:
        """Per layer, the slots a step over ``rows`` must read: the most any of them can occupy in that layer,
        rounded up to whole blocks (so that a step has few distinct shapes), at most :attr:`width`.

        CAKE's and SLAKE's layers keep different budgets (a few tokens to ``max_layer_budget``), so reading every
        layer at the widest layer's width would read and score up to twice the slots a layer holds."""
        bs = self.block_size
        widths = [max(w) for w in zip(*(self.row_widths[r] for r in rows), strict=True)]
        return [min(self.width, -(-w // bs) * bs) for w in widths]

    def kept(self, row: int) -> list[float]:
        """Mean kept tokens per KV head, per layer, of ``row``."""
        return self.valid[:, row].sum(-1).float().mean(-1).tolist()

    def row_state(self, row: int) -> dict:
        """Copies of ``row``'s metadata (saved when its request is preempted)."""
        out = {
            "positions": self.positions[:, row].clone(),
            "valid": self.valid[:, row].clone(),
            "scores": self.scores[:, row].clone(),
            "target": self.target[:, row].clone(),
            "prompt_len": int(self.prompt_len[row]),
            "budget": int(self.budget[row]),
            "seen": int(self.seen[row]),
            "widths": list(self.row_widths[row]),
        }
        if self.linear is not None:
            out["linear"] = self.linear[:, row].clone()
        if self.weights is not None:
            out["weights"] = self.weights[:, row].clone()
        return out

    def restore_row(self, row: int, saved: dict) -> None:
        """Put metadata saved by :meth:`row_state` back into ``row``."""
        for name in ("positions", "valid", "scores", "target"):
            getattr(self, name)[:, row] = saved[name]
        if self.linear is not None:
            self.linear[:, row] = saved["linear"]
        if self.weights is not None:
            self.weights[:, row] = saved["weights"]
        self.prompt_len[row], self.budget[row], self.seen[row] = saved["prompt_len"], saved["budget"], saved["seen"]
        self.row_widths[row] = list(saved["widths"])

    def row_bytes(self) -> tuple[int, int]:
        """Bytes one row holds: (per-slot metadata, linear state), all layers."""
        L, H, W = self.num_layers, self.kv_heads, self.width
        extra = (0 if self.weights is None else 4) + (0 if self.order is None else 4)
        meta = L * H * W * (8 + 1 + 4 + extra) + L * H * 8
        lin = 0 if self.linear is None else L * H * (self.head_dim + 1) ** 2 * 4
        return meta, lin

    # ------------------------------------------------------------------ the step
    def decode_layer(
        self,
        layer: int,
        rows: torch.Tensor | slice,
        table: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        newest: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        scaling: float,
        width: int | None = None,
    ) -> torch.Tensor:
        """One decode step of layer ``layer`` for ``R`` compressed requests: the shared decode step
        (:func:`slake.cache.decode_step.decode_step`, or its fused kernels) over the rows' slots in vLLM's blocks.

        Parameters
        ----------
        rows : torch.Tensor or slice
            ``(R,)`` int64 pool rows, or the slice ``a:a+R`` when they are contiguous and in order (the usual case:
            rows are allocated lowest first and the step lists them in row order): the pool's rows are then updated
            in place through views, instead of being gathered and written back (SLAKE's linear state alone is
            ``(d + 1)^2`` floats per row and head).
        table : torch.Tensor
            ``(R, ceil(W / block_size))`` int64 block ids of each row, in slot order.
        blocks, offsets : torch.Tensor
            ``(R, W)`` block id and ``(W,)`` in-block offset of every slot of each row
            (:func:`slake.engines.vllm.plugin.paged.slot_blocks`), for the layout's writer.
        newest : torch.Tensor
            ``(R, 1, 1)`` int64 position of each row's new token.
        query, key, value : torch.Tensor
            ``(R, Hq, d)`` / ``(R, Hkv, d)`` / ``(R, Hkv, d)`` the new tokens' post-RoPE projections.
        kv_cache : torch.Tensor
            vLLM's cache of this layer, in the pool's layout (the new key/value is written to it, nothing else).
        width : int, optional
            Slots to read and score in this layer (:meth:`layer_widths`; default :attr:`width`): no row occupies a
            slot at or past it, so the result is the same as with the whole row, for less work.

        Returns
        -------
        torch.Tensor
            ``(R, Hq, d)`` float32 attention output.
        """
        W = self.width if width is None else width
        nb = -(-W // self.block_size)
        # a slice of rows (the usual case) is taken here as views of the pool's tensors, once; an index tensor is
        # left to the step (:meth:`StepSlots.take_rows`), which gathers the rows and writes them back
        r = rows if isinstance(rows, slice) else slice(None)
        slots = StepSlots(
            positions=self.positions[layer, r, :, :W],
            valid=self.valid[layer, r, :, :W],
            scores=self.scores[layer, r, :, :W],
            target=self.target[layer, r],
            newest=newest,
            prompt_len=self.prompt_len[r],
            budget=self.budget[r],
            linear=None if self.linear is None else LinearState(self.linear[layer, r]),
            rows=None if isinstance(rows, slice) else rows,
            layer=None if self.layer_context is None else self.layer_context[layer],
            weights=None if self.weights is None else self.weights[layer, r, :, :W],
            order=None if self.order is None else self.order[layer, r, :, :W],
        )
        kv = PagedSlots(self, kv_cache, table[:, :nb], blocks[:, :W], offsets[:W], W)
        return run_step(self.kernels, self.method, slots, kv, query, key, value, scaling, report=self.report)

    def fold(
        self, linear: LinearState, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor
    ) -> None:
        """Fold the victims (``slots`` ``(R, H, 1)``, gathered ``keys`` in the layout's form) into the linear state.

        :meth:`LinearState.fold_slots`' fold (:meth:`LinearState.fold_buffered`), with its two row buffers kept by
        the pool across steps and layers (the state object is made anew each step) and the victims' rows written
        straight into them from the gathered blocks."""
        d = values.shape[-1]
        k = self.layout.select_keys(keys, slots)  # (R, H, 1, d)
        if k.dtype != linear.dtype or values.dtype != linear.dtype:
            v = values.gather(2, slots[..., None].expand(-1, -1, -1, d))
            linear.fold(k.to(linear.dtype), v.to(linear.dtype), chosen, finite=True)
            return
        key = tuple(k.shape[:2])
        buf = self._fold_buffers.get(key)
        if buf is None or buf[0].dtype != linear.dtype:
            if len(self._fold_buffers) > 64:  # one pair per number of rows decoding together
                self._fold_buffers.clear()
            buf = self._fold_buffers[key] = linear.new_row_buffers(1)
        torch.gather(values, 2, slots[..., None].expand(-1, -1, -1, d), out=buf[1][..., :d])  # [v, 1]
        linear.fold_buffered(k, buf, chosen)


class PagedSlots:
    """The slots of a decode step's rows in vLLM's paged blocks, as :func:`slake.cache.decode_step.decode_step`
    reads and writes them (:class:`slake.cache.decode_step.SlotKV`), through the pool's
    :class:`~slake.engines.vllm.plugin.paged.PagedLayout`."""

    def __init__(
        self,
        pool: DecodePool,
        kv_cache: torch.Tensor,
        table: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        width: int,
    ) -> None:
        self.pool, self.kv_cache, self.table, self.blocks, self.offsets, self.width = (
            pool,
            kv_cache,
            table,
            blocks,
            offsets,
            width,
        )

    def write_kv(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` ``(R, Hkv, 1, d)`` into each head's slot of ``slots`` in the paged blocks."""
        slot = slots[..., 0]  # (R, H): each head its own slot (the one it evicted at the previous step)
        self.pool.layout.write(
            self.kv_cache, self.blocks.gather(1, slot), self.offsets.take(slot), keys[:, :, 0], values[:, :, 0]
        )

    def read_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' blocks gathered: keys in the layout's form (:meth:`kv_logits` takes them) and values
        ``(R, Hkv, W, d)``."""
        # whole blocks, W' >= W slots; the cache is allocated zeroed and holds only written keys/values, so the
        # invalid slots' values are finite (their probability is 0, and 0 * x must stay 0)
        keys, values = self.pool.layout.gather(self.kv_cache, self.table)
        return keys, values[:, :, : self.width]

    def kv_logits(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``queries`` ``(R, Hkv, g, d)`` times the gathered keys, over the row's ``W`` slots: ``(R, Hkv, g, W)``."""
        return self.pool.layout.logits(queries, keys)[..., : self.width]

    def slot_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The gathered keys as ``(R, Hkv, W, d)`` in slot order, for decode rules that read them."""
        return self.pool.layout.dense_keys(keys)[:, :, : self.width]

    def fold_kv(
        self, linear: LinearState, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor
    ) -> None:
        """Fold the slots ``slots`` ``(R, Hkv, 1)`` where ``chosen`` into ``linear`` (:meth:`DecodePool.fold`)."""
        self.pool.fold(linear, keys, values, slots, chosen)

    def kernel_memory(self) -> KVMemory:
        """The blocks as the fused kernels address them (:meth:`PagedLayout.kernel_memory`)."""
        keys, values, k_strides, v_strides = self.pool.layout.kernel_memory(self.kv_cache)
        return KVMemory(keys, values, k_strides, v_strides, self.table, self.kv_cache.shape[2], self.width)
