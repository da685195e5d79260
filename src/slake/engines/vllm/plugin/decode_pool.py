"""The batched decode step of compressed requests: one computation per layer for all of them (worker side).

After a compressed request's prefill (done per request by :class:`slake.cache.compressed.CompressedKV`), its
per-slot metadata moves into one row of a :class:`DecodePool`: persistent per-layer tensors
``(rows, Hkv, W)`` (positions, validity, scores), the layer's target size ``(rows, Hkv)`` and, for methods with a
PTAA linear state (SLAKE, ``cake[linear_cache=true]``), ``(rows, Hkv, d + 1, d + 1)``. ``W`` is the most slots a
compressed request holds (:meth:`slake.engines.vllm.plugin.config.SlakeVllmConfig.slots`); a row's slots beyond its own
are
invalid. Keys and values stay in vLLM's paged blocks only.

Each decode step, per layer, :meth:`DecodePool.decode_layer` runs the transformers engine's evict-one-insert-one
step (:meth:`CompressedKV.append` + :meth:`CompressedKV.decode_attention`) for all ``R`` decoding compressed
requests at once, with no loop over requests:

1. the new token's key/value is written to each row's first free slot (per KV head: the slot evicted at the
   previous step, or the one extra slot after prefill), straight into vLLM's blocks (the layout's
   :meth:`~slake.engines.vllm.plugin.paged.PagedLayout.write`); nothing else of the cache is written;
2. the rows' slots are gathered from the blocks (:meth:`~slake.engines.vllm.plugin.paged.PagedLayout.gather`, values
   ``(R, Hkv, W, d)``), logits of the scaled queries in group layout
   (:meth:`~slake.engines.vllm.plugin.paged.PagedLayout.logits`),
   ``-inf`` on invalid slots;
3. softmax, the method's ``decode_scores``, the protected slots (window relative to each row's newest position,
   sinks), one victim per row and KV head (``argmin``, the first minimum, as the transformers engine);
4. SLAKE (evict before the output): fold the victim into the linear state and attend with PTAA; other methods:
   output from the same softmax, then fold/evict;
5. the rows' metadata is written back to the pool (``index_copy_``).

The arithmetic per row is the transformers engine's (same slot choice, same operations over the same slots), so a
request's tokens equal its batch-1 run there; the tests say so for every supported method.

The pool never indexes vLLM's cache tensor itself: a :class:`slake.engines.vllm.plugin.paged.PagedLayout` reads and
writes it
(vLLM's ``CPU_ATTN`` layout by default; :class:`slake.engines.vllm.plugin.paged.FlashAttnLayout` for a GPU backend,
``docs/gpu.md``). The step is device-agnostic torch: its tensors live on the pool's ``device`` and the cache's, it
reads nothing back to the host and branches on no tensor value, and its shapes depend only on ``R`` and ``W``.
"""

from __future__ import annotations

import torch

from slake.attention.linear_state import LinearState
from slake.attention.ptaa import attend
from slake.attention.softmax import probs_values, safe_softmax
from slake.engines.vllm.plugin.paged import CpuAttnLayout, PagedLayout
from slake.methods.base import DecodeInputs, Method


def _take(t: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """``t``'s rows (dim 0): a view for a slice, a copy for an index tensor."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _put(t: torch.Tensor, rows: torch.Tensor | slice, x: torch.Tensor) -> None:
    """Write ``x`` into ``t``'s rows, unless ``x`` already is that view (:func:`_take` of a slice, updated in place)."""
    if not isinstance(rows, slice):
        t.index_copy_(0, rows, x)
        return
    view = t[rows]
    if x.data_ptr() != view.data_ptr() or x.stride() != view.stride():
        view.copy_(x)


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
    ) -> None:
        self.method = method
        self.layout = CpuAttnLayout() if layout is None else layout
        self.device = torch.device("cpu" if device is None else device)
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
        return out

    def restore_row(self, row: int, saved: dict) -> None:
        """Put metadata saved by :meth:`row_state` back into ``row``."""
        for name in ("positions", "valid", "scores", "target"):
            getattr(self, name)[:, row] = saved[name]
        if self.linear is not None:
            self.linear[:, row] = saved["linear"]
        self.prompt_len[row], self.budget[row], self.seen[row] = saved["prompt_len"], saved["budget"], saved["seen"]
        self.row_widths[row] = list(saved["widths"])

    def row_bytes(self) -> tuple[int, int]:
        """Bytes one row holds: (per-slot metadata, linear state), all layers."""
        L, H, W = self.num_layers, self.kv_heads, self.width
        meta = L * H * W * (8 + 1 + 4) + L * H * 8
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
        """One decode step of layer ``layer`` for ``R`` compressed requests.

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
        m = self.method
        layout = self.layout
        R, Hq, d = query.shape
        H = self.kv_heads
        g = Hq // H
        W = self.width if width is None else width
        nb = -(-W // self.block_size)
        table, blocks, offsets = table[:, :nb], blocks[:, :W], offsets[:W]
        positions_l, valid_l, scores_l = (t[layer][..., :W] for t in (self.positions, self.valid, self.scores))
        pos, valid, stored = _take(positions_l, rows), _take(valid_l, rows), _take(scores_l, rows)
        target = _take(self.target[layer], rows)
        # 1. append: the first free slot of every row and head (argmax returns the first maximum)
        free = (~valid).to(torch.uint8).argmax(-1, keepdim=True)  # (R, H, 1)
        slot = free[..., 0]
        layout.write(kv_cache, blocks.gather(1, slot), offsets[slot], key, value)  # blocks/offsets are per slot
        valid.scatter_(-1, free, True)
        pos.scatter_(-1, free, newest.expand(R, H, 1))
        stored.scatter_(-1, free, 0.0)
        # 2. logits over the rows' slots
        # whole blocks, W' >= W slots; the cache is allocated zeroed and holds only written keys/values, so the
        # invalid slots' values are finite (their probability is 0, and 0 * x must stay 0)
        keys, values = layout.gather(kv_cache, table)  # keys in the layout's form, values (R, H, W', d)
        values = values[:, :, :W]
        qf = (query.float() * scaling).reshape(R, H, g, 1, d)
        x = layout.logits(qf.reshape(R, H, g, d), keys)[..., :W].reshape(R, H, g, 1, W)
        x.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
        # 3. scores and the victim of every row and head
        probs = safe_softmax(x)
        scores = m.decode_scores(
            DecodeInputs(
                probs=probs.reshape(R, H * g, 1, W),
                positions=pos,
                valid=valid,
                stored=stored,
                prompt_len=_take(self.prompt_len, rows),
                budget=_take(self.budget, rows),
                newest=newest,
            )
        ).float()
        counts = valid.sum(-1)
        excess = torch.where(target >= 0, counts - target, torch.zeros_like(counts))
        protected = ~valid
        if m.window and not m.newest_evictable:
            protected = protected | (pos > newest - m.window)
        if m.sinks:
            protected = protected | ((pos >= 0) & (pos < m.sinks))  # vLLM prompts have no left padding
        lowest = scores.masked_fill(protected, float("inf")).argmin(-1, keepdim=True)  # (R, H, 1)
        chosen = (excess[..., None] > 0) & valid.gather(-1, lowest)
        mask = torch.zeros_like(valid).scatter_(-1, lowest, chosen)
        linear = None if self.linear is None else LinearState(_take(self.linear[layer], rows))
        # 4. output and eviction, in the method's order
        if m.evict_before_output:
            self._fold(linear, layout, keys, values, lowest, chosen)
            x.masked_fill_(mask[:, :, None, None, :], float("-inf"))
            out = attend(qf, x, values, linear, 1.0, overwrite_logits=True)
        else:
            if linear is None:
                out = probs_values(probs, values)
            else:
                out = attend(qf, x, values, linear, 1.0, overwrite_logits=True)
            self._fold(linear, layout, keys, values, lowest, chosen)
        valid &= ~mask
        pos.masked_fill_(mask, -1)
        scores.masked_fill_(mask, float("-inf"))
        # 5. write the rows back
        _put(positions_l, rows, pos)
        _put(valid_l, rows, valid)
        _put(scores_l, rows, scores)
        if linear is not None:
            _put(self.linear[layer], rows, linear.aug)
        return out.reshape(R, Hq, d)

    def _fold(
        self,
        linear: LinearState | None,
        layout: PagedLayout,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        chosen: torch.Tensor,
    ) -> None:
        """Fold the victims (``slots`` ``(R, H, 1)``) into the linear state, as ``LayerStore.free`` does.

        :meth:`LinearState.fold_slots`' fold (:meth:`LinearState.fold_buffered`), with its two row buffers kept by
        the pool across steps and layers (the state object is made anew each step) and the victims' rows written
        straight into them from the gathered blocks."""
        if linear is None:
            return
        d = values.shape[-1]
        k = layout.select_keys(keys, slots)  # (R, H, 1, d)
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
