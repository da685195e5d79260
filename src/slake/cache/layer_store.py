"""Storage of one compressed layer: kept keys/values at KV-head granularity with per-slot metadata.

Layout (``docs/design.md#storage-layout``, ``docs/conventions.md#memory-and-byte-accounting``): dense tensors
``(B, Hkv, capacity, d)`` padded to the longest head, with a validity mask. Each slot also records the absolute position
of its token and a float32 score carried between eviction decisions. After a prefill compaction the kept tokens sit in
position order at the front of each row (between the stages of CAKE's cascade, in score order: ``keep``); at decode,
evicted slots are freed in place and the next token is written into a free slot, so no step reallocates the layer (the
capacity only grows when a row has no free slot, e.g. with no decode eviction).

Optionally a per-query-head visibility mask ``head_visible`` ``(B, Hkv, g, capacity)`` restricts which query heads of
a GQA group see a slot (SAGE-KV's per-query-head selections stored once per KV head); slots written at decode are
visible to every head. It is carried through keep / append / select_batch / repeat_batch and counted as metadata.

Methods whose decode rule weighs each slot by a function of its value alone (``Method.slot_weighted``: CriticalKV's
``||W_o v||_1``) get those weights kept in ``weights`` ``(B, Hkv, capacity)`` float32, filled by the decode engine
(:meth:`slake.cache.decoding.Decoder.step`) and updated by the shared decode step as it writes each token. The store's
own writes (multi-token appends) and compactions drop them (None), so they are never stale: the engine fills them
again.
"""

from __future__ import annotations

import torch

from slake.attention.linear_state import LinearState
from slake.attention.softmax import matmul_f32
from slake.cache.decode_step import KVMemory
from slake.cache.quant import dequantize_rows, parse_kv_dtype, quantize_rows, scale_bytes_per_row

_GROWTH = 256  # slots added at once when a row runs out of free slots (amortises reallocation)
_FOLD_ROWS = 1024  # dropped rows gathered and folded at once by a prefill compaction (bounds the transient copies)


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, i]]`` for a ``(B, Hkv, n, ...)`` tensor and ``(B, Hkv, k)`` slot indices.

    One ``index_select`` over the rows of a flat view: on CPU a ``gather`` with an index expanded over the head
    dimension is several times slower. A ``(B, n, Hkv, ...)`` buffer seen as ``(B, Hkv, n, ...)`` (the engines'
    token-major keys and values) is read in place too; other layouts fall back to advanced indexing. Nothing is
    copied but the picked rows.
    """
    B, H, n = t.shape[:3]
    rest = t.shape[3:]
    b = torch.arange(B, device=idx.device).view(B, 1, 1)
    h = torch.arange(H, device=idx.device).view(1, H, 1)
    if t.is_contiguous():
        flat, src = (b * H + h) * n + idx, t.view(B * H * n, *rest)
    elif t.transpose(1, 2).is_contiguous():
        flat, src = (b * n + idx) * H + h, t.transpose(1, 2).view(B * n * H, *rest)
    else:
        return t[b, h, idx]
    return src.index_select(0, flat.reshape(-1)).view(B, H, idx.shape[-1], *rest)


def _put_slots(t: torch.Tensor, slots: torch.Tensor, src: torch.Tensor | float | bool) -> None:
    """``t[b, h, slots[b, h, i]] = src[b, h, i]`` in place, for a ``(B, Hkv, n, ...)`` tensor and ``(B, Hkv, k)``
    slots (``src`` ``(B, Hkv, k, ...)`` or a scalar): a ``scatter_`` along the slot dimension in eager code; under
    ``torch.compile`` an ``index_put_``, which inductor writes in place, where it turns a ``scatter_`` into an
    out-of-place copy of the whole tensor and a copy back (two passes over a layer's store per step: 16 ms of a
    128K-token full-cache step on an H200, ``docs/compile.md``)."""
    if torch.compiler.is_compiling():
        B, H = slots.shape[:2]
        b = torch.arange(B, device=slots.device).view(B, 1, 1)
        h = torch.arange(H, device=slots.device).view(1, H, 1)
        value = src if isinstance(src, torch.Tensor) else torch.tensor(src, dtype=t.dtype, device=t.device)
        t.index_put_((b, h, slots), value)
        return
    index = slots.view(*slots.shape, *([1] * (t.dim() - 3))).expand(*slots.shape, *t.shape[3:])
    t.scatter_(2, index, src)


class LayerStore:
    """Kept entries of one layer plus, optionally, the PTAA linear state of its evicted entries.

    Parameters
    ----------
    keys, values : torch.Tensor
        ``(B, Hkv, n, d)`` initial entries (model dtype).
    positions : torch.Tensor
        ``(B, Hkv, n)`` int64 absolute positions.
    valid : torch.Tensor
        ``(B, Hkv, n)`` bool.
    scores : torch.Tensor
        ``(B, Hkv, n)`` float32 per-slot scores.
    linear : LinearState | None
        Linear state of evicted entries (SLAKE's PTAA), or None for plain eviction.
    head_visible : torch.Tensor | None
        ``(B, Hkv, g, n)`` bool per-query-head visibility of each slot, or None (every head sees every slot).
    kv_dtype : str | None
        ``"int8"`` or ``"fp8_e4m3"``: store keys and values as 8-bit codes with one float32 scale per row
        (:mod:`slake.cache.quant`); ``keys``/``values`` then hold the codes and ``k_scale``/``v_scale``
        ``(B, Hkv, n, 1)`` the scales. Readers use :meth:`dense_keys` / :meth:`dense_values`. None: model dtype.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        scores: torch.Tensor,
        linear: LinearState | None = None,
        head_visible: torch.Tensor | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        self.kv_dtype = parse_kv_dtype(kv_dtype)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.kv_dtype is not None:
            keys, self.k_scale = quantize_rows(keys, self.kv_dtype)
            values, self.v_scale = quantize_rows(values, self.kv_dtype)
        self.keys = keys
        self.values = values
        self.positions = positions
        self.valid = valid
        self.scores = scores
        self.linear = linear
        self.head_visible = head_visible
        #: per-slot weights of a ``slot_weighted`` method, exact for every valid slot, or None (module docstring)
        self.weights: torch.Tensor | None = None
        self._row_table: torch.Tensor | None = None  # (B, 1) row numbers: the fused kernels' block table
        self._order: torch.Tensor | None = None  # the fused kernels' order of the slots (kernel_order)

    # ------------------------------------------------------------------ shape
    @property
    def capacity(self) -> int:
        """Slots per row (the padded length of every head)."""
        return self.keys.shape[2]

    def dense_keys(self) -> torch.Tensor:
        """``(B, Hkv, n, d)`` keys for attention: the stored tensor, or its float32 dequantisation (8-bit storage)."""
        return self.keys if self.k_scale is None else dequantize_rows(self.keys, self.k_scale)

    def dense_values(self) -> torch.Tensor:
        """``(B, Hkv, n, d)`` values for attention (float32 dequantisation under 8-bit storage)."""
        return self.values if self.v_scale is None else dequantize_rows(self.values, self.v_scale)

    def _slot_tensors(self) -> tuple[str, ...]:
        """Names of the per-slot tensors with the slot axis at dim 2 (row data and scales)."""
        return ("keys", "values") + (("k_scale", "v_scale") if self.k_scale is not None else ())

    def counts(self) -> torch.Tensor:
        """``(B, Hkv)`` number of kept tokens per sequence and KV head."""
        return self.valid.sum(-1)

    # ------------------------------------------------------------------ prefill compaction
    def keep(
        self,
        order: torch.Tensor | None,
        keep_counts: torch.Tensor,
        *,
        positional: bool = True,
        host: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Keep, per row, the first ``keep_counts[b, h]`` slots listed in ``order``; drop every other slot, folding the
        dropped valid ones into the linear state when there is one.

        Parameters
        ----------
        order : torch.Tensor | None
            ``(B, Hkv, n)`` every slot index in preference order (best first), or None when the store's slots already
            are in that order (a store left by ``positional=False``): the kept slots are then a prefix of each row,
            and dropping is a slice, with no sort and no gather.
        keep_counts : torch.Tensor
            ``(B, Hkv)`` int64 tokens to keep per row.
        positional : bool
            True (the layout everything else reads): kept slots are re-packed in position order, empty slots last.
            False: they stay in ``order``'s order, so that the next, smaller ``keep`` of the CAKE cascade
            (``docs/methods/cake.md#cascading-prefill``) is ``order=None``.
        host : tuple[list[int], list[int]] | None
            ``keep_counts`` and the valid slots per row, flattened, when the caller has read them back already.

        The kept set is the same whatever the layout: the first ``keep_counts`` valid slots of ``order``.
        """
        B, H, n = self.valid.shape
        dev = self.valid.device
        if host is None:
            both = torch.stack([keep_counts.reshape(-1), self.counts().reshape(-1).to(keep_counts)]).tolist()
            host = (both[0], both[1])
        keep_list, count_list = host
        # at least one slot, even where every row keeps nothing: a store of capacity 0 would leave the decode step no
        # slot to write its token into; such a slot is empty (invalid), never a kept token
        kmax = min(max(max(keep_list, default=0), 1), n)
        kmin = min(keep_list, default=0)
        # every slot valid and one keep count >= kmax for all rows (a batch of one, no padding): no mask anywhere.
        # Not when the rows keep nothing (kmin 0 < kmax 1): the one slot left must then be marked empty, and the
        # fold must not take it as kept (it is dropped and folded like every other slot)
        uniform = all(c == n for c in count_list) and len(set(keep_list)) <= 1 and kmin >= kmax
        sel = None if order is None else order[..., :kmax]  # None: the identity, each row's first slots
        sel_valid = None  # None: every kept slot is valid
        if not uniform:
            first = torch.arange(kmax, device=dev) < keep_counts[..., None]
            sel_valid = first & (self.valid[..., :kmax] if sel is None else self.valid.gather(-1, sel))
        if positional:  # position order for the kept slots, empty ones last
            pos = self.positions[..., :kmax] if sel is None else self.positions.gather(-1, sel)
            perm = (pos if sel_valid is None else torch.where(sel_valid, pos, pos + (1 << 40))).argsort(-1)
            sel = perm if sel is None else sel.gather(-1, perm)
            sel_valid = None if sel_valid is None else sel_valid.gather(-1, perm)
        if self.linear is not None and kmin < n:
            self._fold_dropped(order, keep_counts, kmin, uniform)
        if sel is None:  # a prefix of every row: slice (copied, so that the dropped slots' memory is released)
            take = (lambda t: t[:, :, :kmax].clone()) if kmax < n else (lambda t: t)
            # head_visible (B, Hkv, G, n) has its slot axis last, not at dim 2
            take_last = (lambda t: t[..., :kmax].clone()) if kmax < n else (lambda t: t)
        else:
            take = lambda t: _rows(t, sel)  # noqa: E731
            take_last = lambda t: t.gather(-1, sel[:, :, None, :].expand(-1, -1, t.shape[2], -1))  # noqa: E731
        for name in self._slot_tensors():
            setattr(self, name, take(getattr(self, name)))
        self.positions = take(self.positions)
        self.scores = take(self.scores)
        self.weights = None
        if self.head_visible is not None:
            self.head_visible = take_last(self.head_visible)
        if sel_valid is None:
            self.valid = torch.ones(B, H, kmax, dtype=torch.bool, device=dev)
        else:
            self.positions.masked_fill_(~sel_valid, -1)
            self.scores.masked_fill_(~sel_valid, float("-inf"))
            self.valid = sel_valid

    def _fold_dropped(self, order: torch.Tensor | None, keep_counts: torch.Tensor, kmin: int, uniform: bool) -> None:
        """Fold the valid slots past each row's ``keep_counts`` in ``order`` (None: slot order) into the linear state,
        gathering only those rows (``_FOLD_ROWS`` at a time), not the whole layer. ``uniform``: every such slot is
        valid and dropped (one keep count for all rows, no empty slot), so no mask is needed."""
        n = self.valid.shape[-1]
        for r0 in range(kmin, n, _FOLD_ROWS):
            r1 = min(r0 + _FOLD_ROWS, n)
            rows = None if order is None else order[..., r0:r1]
            chosen = None
            if not uniform:
                valid = self.valid[..., r0:r1] if rows is None else self.valid.gather(-1, rows)
                chosen = valid & (torch.arange(r0, r1, device=valid.device) >= keep_counts[..., None])
                if not bool(chosen.any()):
                    continue
            k, v = self.dense_rows(rows, r0, r1)
            if self.linear is not None:
                self.linear.fold(k, v, chosen)

    def dense_rows(
        self, rows: torch.Tensor | None, r0: int = 0, r1: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots ``rows`` ``(B, Hkv, r)`` (None: slots ``r0:r1``), dequantised under 8-bit
        storage, as :meth:`dense_keys` / :meth:`dense_values` would give them."""
        pick = (lambda t: t[:, :, r0:r1]) if rows is None else (lambda t: _rows(t, rows))
        k, v = pick(self.keys), pick(self.values)
        if self.k_scale is not None:
            k = dequantize_rows(k, pick(self.k_scale))
            v = dequantize_rows(v, pick(self.v_scale))
        return k, v

    # ------------------------------------------------------------------ decode
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        score: float = 0.0,
        growth: int = _GROWTH,
    ) -> torch.Tensor:
        """Write ``n_new`` new tokens into free slots of every row; grow the capacity only if a row is full.

        ``keys, values``: ``(B, Hkv, n_new, d)``; ``positions``: ``(n_new,)`` int64 (same for the whole batch,
        because positions index the padded sequence). ``growth``: slots added when a row has no free slot for a
        single new token (a layer that evicts one token per step needs one extra slot, once; an append-only layer
        amortises reallocation with a larger step). Returns the ``(B, Hkv, n_new)`` slot indices written.
        """
        # refused before anything is written: scatter_ only needs its source to be at least the index's size, so keys
        # of another batch, KV-head count or head size (or token-major (B, n, Hkv, d) ones) were silently cut to the
        # store's shape, and a batch of 2 continuing a batch-1 cache read the first row's cache for both
        Bs, Hs, _, ds = self.keys.shape
        dv = self.values.shape[-1]
        if (
            keys.dim() != 4
            or values.dim() != 4
            or (keys.shape[0], keys.shape[1], keys.shape[3]) != (Bs, Hs, ds)
            or tuple(values.shape) != (Bs, Hs, keys.shape[2], dv)
            or positions.numel() != keys.shape[2]
        ):
            raise ValueError(
                f"new keys and values must be (B, Hkv, n, d) = ({Bs}, {Hs}, n, {ds}) and ({Bs}, {Hs}, n, {dv}) for "
                f"this layer, with n positions; got keys {tuple(keys.shape)}, values {tuple(values.shape)} and "
                f"{positions.numel()} positions"
            )
        B, H, n_new, d = keys.shape
        if n_new == 1:
            full = self.valid.all(-1)
            if bool(full.any()):  # one host sync per layer and step (free on CPU)
                self._grow(max(int(growth), 1))
            # the first free slot of each row (argmax returns the first maximum)
            slots = (~self.valid).to(torch.uint8).argmax(-1, keepdim=True)
        else:
            free = ~self.valid
            short = n_new - int(free.sum(-1).min().item())
            if short > 0:  # multi-token appends (prompt chunks) grow by what is missing only
                self._grow(short)
                free = ~self.valid
            # the first n_new free slots of each row (stable sort puts free slots first in slot order)
            slots = torch.sort(free.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :n_new]
        self._write(slots, keys, values, positions.view(1, 1, -1).expand(B, H, -1), score)
        return slots

    def append_one(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Write one new token per row into the row's first free slot (a decode step); returns the ``(B, Hkv, 1)``
        slots written.

        ``keys, values``: ``(B, Hkv, 1, d)``; ``position``: ``(1,)`` int64 on the store's device. Fixed shapes and
        no read-back: the caller guarantees a free slot in every row (:meth:`min_free`, :meth:`reserve`); a full row
        would have its slot 0 overwritten.
        """
        B, H, _, d = keys.shape
        slots = (~self.valid).to(torch.uint8).argmax(-1, keepdim=True)  # the first free slot (first maximum)
        self._write(slots, keys, values, position.view(1, 1, 1).expand(B, H, 1), 0.0)
        return slots

    def _write(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        score: torch.Tensor | float,
    ) -> None:
        """Store ``keys``/``values`` ``(B, Hkv, n, d)`` (8-bit codes and scales where the store is 8-bit), their
        ``positions`` ``(B, Hkv, n)`` and ``score`` in ``slots`` ``(B, Hkv, n)``, and mark the slots valid (and
        visible to every query head of the group)."""
        self.write_kv(slots, keys, values)
        self.weights = None  # the new slots have none: the decode engine computes them again
        _put_slots(self.positions, slots, positions)
        _put_slots(self.valid, slots, True)
        _put_slots(self.scores, slots, score)
        if self.head_visible is not None:
            g = self.head_visible.shape[2]
            self.head_visible.scatter_(-1, slots[:, :, None, :].expand(-1, -1, g, -1), True)

    def write_at(self, slot: int, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        """:meth:`_write` of one new token per row into ``slot``, the same slot of every row and KV head, known on the
        host (the eager full cache's valid prefix, :meth:`slake.cache.decoding.Decoder._prefix_of`): slice writes,
        a few operations where the scatters by a slot tensor are a dozen (an eager decode step on a GPU is bound by
        its host). ``keys``/``values`` ``(B, Hkv, 1, d)``, ``position`` the 0-dim int64 position; the slot's score is
        0 and it is visible to every query head."""
        at = slice(slot, slot + 1)
        if self.k_scale is not None and self.v_scale is not None and self.kv_dtype is not None:
            keys, ks = quantize_rows(keys, self.kv_dtype)
            values, vs = quantize_rows(values, self.kv_dtype)
            self.k_scale[:, :, at] = ks
            self.v_scale[:, :, at] = vs
        self.keys[:, :, at] = keys
        self.values[:, :, at] = values
        self.weights = None
        self.positions[:, :, slot] = position
        self.valid[:, :, slot] = True
        self.scores[:, :, slot] = 0.0
        if self.head_visible is not None:
            self.head_visible[:, :, :, slot] = True

    # ------------------------------------------------------------------ the decode step's view (SlotKV)
    def write_kv(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``(B, Hkv, n, d)`` in ``slots`` ``(B, Hkv, n)`` (quantised under 8-bit storage);
        the slots' metadata is the caller's (:func:`slake.cache.decode_step.decode_step`)."""
        if self.k_scale is not None and self.v_scale is not None and self.kv_dtype is not None:
            keys, ks = quantize_rows(keys, self.kv_dtype)
            values, vs = quantize_rows(values, self.kv_dtype)
            _put_slots(self.k_scale, slots, ks)
            _put_slots(self.v_scale, slots, vs)
        _put_slots(self.keys, slots, keys.to(self.keys.dtype))
        _put_slots(self.values, slots, values.to(self.values.dtype))

    def read_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(B, Hkv, n, d)`` for attention (:meth:`dense_keys`, :meth:`dense_values`)."""
        return self.dense_keys(), self.dense_values()

    def kv_logits(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``queries`` ``(B, Hkv, g, d)`` float32 times ``keys`` ``(B, Hkv, n, d)``: ``(B, Hkv, g, n)`` float32 (one
        matmul per KV head for its ``g`` query rows; the cache is never expanded per query head)."""
        return matmul_f32(queries, keys.transpose(-1, -2))

    def slot_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``keys`` as they are: :meth:`read_kv` gives them dense ``(B, Hkv, n, d)`` already."""
        return keys

    def kernel_memory(self) -> KVMemory:
        """The store as the fused kernels address it: one block per row (:class:`slake.cache.decode_step.KVMemory`)."""
        B, H, n, d = self.keys.shape
        table = self._row_table
        if table is None or table.shape[0] != B or table.device != self.keys.device:
            table = self._row_table = torch.arange(B, device=self.keys.device).view(B, 1)
        ks, vs = self.keys.stride(), self.values.stride()
        scales = (
            (0, 0, 0)
            if self.k_scale is None
            else (self.k_scale.stride(0), self.k_scale.stride(1), self.k_scale.stride(2))
        )
        return KVMemory(
            self.keys,
            self.values,
            (ks[0], ks[1], ks[2], ks[3]),
            (vs[0], vs[1], vs[2], vs[3]),
            table,
            n,
            n,
            self.kv_dtype,
            self.k_scale,
            self.v_scale,
            scales,
        )

    def kernel_order(self) -> torch.Tensor:
        """``(B, Hkv, n)`` int32 with the strides of :attr:`positions`: each row's valid slots in position order as
        the fused kernels' last step left them (:attr:`slake.cache.decode_step.StepSlots.order`). Made on first use
        and again when the slots' tensors change shape; whatever it holds is safe, the kernels check it (a stale one
        costs one sort)."""
        t, pos = self._order, self.positions
        if t is None or t.shape != pos.shape or t.stride() != pos.stride() or t.device != pos.device:
            # the positions' own layout, even when they are a view with gaps (the kernels share one set of strides)
            t = self._order = torch.empty_strided(pos.shape, pos.stride(), dtype=torch.int32, device=pos.device)
            t.zero_()
        return t

    def fold_kv(
        self,
        linear: LinearState,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        chosen: torch.Tensor,
    ) -> None:
        """Fold the rows ``slots`` ``(B, Hkv, 1)`` of :meth:`read_kv`'s ``keys``/``values`` where ``chosen`` into
        ``linear`` (stored rows are finite: kept, freed or zero-grown slots)."""
        if keys.dtype == linear.dtype and values.dtype == linear.dtype:  # fp32 or dequantised storage
            linear.fold_slots(keys, values, slots, chosen)
            return
        gi = slots[..., None].expand(-1, -1, -1, keys.shape[-1])
        k, v = keys.gather(2, gi), values.gather(2, gi)
        linear.fold(k.to(linear.dtype), v.to(linear.dtype), chosen, finite=True)

    def min_free(self) -> int:
        """Free slots of the fullest row (one read-back; called once after prefill, not per step)."""
        return int((~self.valid).sum(-1).min().item()) if self.valid.numel() else 0

    def room_when_some_rows_evict(self, bound: torch.Tensor) -> int:
        """Free slots of the fullest row and KV head that keeps every new token (``bound`` -1), for a layer whose rows
        do not all evict at decode (a padded batch with a prompt within the budget), after growing the layer, once,
        by what a row that evicts (``bound`` >= 0) lacks: it grows to its bound and then evicts one token per step,
        so ``bound + 1`` slots are all it ever needs. ``1 << 30`` where every row evicts. One read-back, once after
        the prefill, as :meth:`min_free`. ``bound``: ``(B, Hkv)`` int, on any device."""
        if not self.valid.numel():
            return 0
        counts = self.valid.sum(-1)  # (B, H)
        bound = bound.to(counts.device)
        growing = torch.where(bound < 0, self.capacity - counts, 1 << 30).min()
        spare = torch.where(bound >= 0, self.capacity - torch.maximum(counts, bound) - 1, 1 << 30).min()
        free, least = torch.stack([growing, spare]).tolist()  # one read-back for both
        lacking = max(0, -int(least))
        if lacking:
            self._grow(lacking)
        return int(free) + lacking

    def free(
        self, evicted: torch.Tensor, slots: torch.Tensor | None = None, chosen: torch.Tensor | None = None
    ) -> None:
        """Evict the slots where ``evicted`` (``(B, Hkv, capacity)`` bool) is True, folding them if linear.

        ``slots``/``chosen`` (``(B, Hkv, e)`` slot indices and which of them are evicted; they must describe the
        same set as ``evicted``) let the linear state fold only those ``e`` rows instead of masking the whole layer.
        """
        if self.linear is not None:
            if slots is not None and chosen is not None:
                keys, values = self.read_kv()
                self.fold_kv(self.linear, keys, values, slots, chosen)
            else:
                self.linear.fold(self.dense_keys(), self.dense_values(), evicted)
        self.valid &= ~evicted
        self.positions.masked_fill_(evicted, -1)
        self.scores.masked_fill_(evicted, float("-inf"))

    def _grow(self, extra: int) -> None:
        B, H, n, d = self.keys.shape
        pad = lambda t, v: torch.cat([t, t.new_full((*t.shape[:2], extra, *t.shape[3:]), v)], 2)  # noqa: E731
        self.keys = pad(self.keys, 0)
        self.values = pad(self.values, 0)
        if self.k_scale is not None:  # scale 0: an empty slot decodes to zeros
            self.k_scale = pad(self.k_scale, 0)
            self.v_scale = pad(self.v_scale, 0)
        self.positions = pad(self.positions, -1)
        self.valid = pad(self.valid, False)
        self.scores = pad(self.scores, float("-inf"))
        if self.weights is not None:  # empty slots: any finite weight (the step writes a token's own)
            self.weights = pad(self.weights, 0.0)
        if self.head_visible is not None:
            hv = self.head_visible
            self.head_visible = torch.cat([hv, hv.new_ones((*hv.shape[:3], extra))], -1)

    def reserve(self, extra_free: int) -> None:
        """Make sure every row has at least ``extra_free`` free slots (preallocation before decoding)."""
        free = int((~self.valid).sum(-1).min().item())
        if free < extra_free:
            self._grow(extra_free - free)

    # ------------------------------------------------------------------ batch manipulation (generate helpers)
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep / reorder batch rows (beam search, batch selection)."""
        for name in self._slot_tensors() + ("positions", "valid", "scores"):
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.keys.device)))
        if self.head_visible is not None:
            self.head_visible = self.head_visible.index_select(0, index.to(self.keys.device))
        if self.weights is not None:
            self.weights = self.weights.index_select(0, index.to(self.keys.device))
        if self._order is not None:  # each row's order moves with its slots (else the kernels rank them anew)
            self._order = self._order.index_select(0, index.to(self.keys.device))
        if self.linear is not None:
            self.linear.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (``num_return_sequences``)."""
        for name in self._slot_tensors() + ("positions", "valid", "scores"):
            setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))
        if self.head_visible is not None:
            self.head_visible = self.head_visible.repeat_interleave(repeats, dim=0)
        if self.weights is not None:
            self.weights = self.weights.repeat_interleave(repeats, dim=0)
        if self._order is not None:
            self._order = self._order.repeat_interleave(repeats, dim=0)
        if self.linear is not None:
            self.linear.repeat_interleave(repeats)

    # ------------------------------------------------------------------ accounting
    def byte_counts(
        self, sequence: int | None = None, *, weighted: bool = False, compressed: bool = True
    ) -> dict[str, int]:
        """Honest byte accounting: kept entries, padding slots, per-slot metadata and linear state.

        ``sequence``: count one batch row as if it were stored alone (its capacity being its own longest head),
        which is what a batch-1 run of that sequence would hold after prefill compaction. Without it, the whole
        batch's tensors are counted as allocated. ``weighted``: count the per-slot :attr:`weights` whether or not
        they are allocated yet (they are, from the first decode step of a ``slot_weighted`` method's scored layer).
        ``compressed=False`` (with ``sequence``): the row is within the budget, and alone it would hold its entries
        with their positions, validity and scores only (no linear state, head visibility, weights or slot order,
        which exist for the batch's compressed rows).
        """
        B, H, n, d = self.keys.shape
        per_slot_kv = 2 * d * self.keys.element_size()
        if self.k_scale is not None:  # 8-bit codes plus one scale per key row and per value row
            per_slot_kv += 2 * scale_bytes_per_row()
        meta_per_slot = self.positions.element_size() + self.valid.element_size() + self.scores.element_size()
        alone_uncompressed = sequence is not None and not compressed
        if self.head_visible is not None and not alone_uncompressed:
            meta_per_slot += self.head_visible.shape[2] * self.head_visible.element_size()
        if (self.weights is not None or weighted) and not alone_uncompressed:
            meta_per_slot += 4  # float32
        if self._order is not None and not alone_uncompressed:
            meta_per_slot += 4  # int32
        linear = self.linear.nbytes() if self.linear is not None and not alone_uncompressed else 0
        if sequence is None:
            kept = int(self.valid.sum().item())
            slots = B * H * n
        else:
            counts = self.valid[sequence].sum(-1)
            kept = int(counts.sum().item())
            slots = H * max(int(counts.max().item()), 1)
            linear //= B
        return {
            "kept": kept * per_slot_kv,
            "padding": (slots - kept) * per_slot_kv,
            "metadata": meta_per_slot * slots,
            "linear_state": linear,
        }
