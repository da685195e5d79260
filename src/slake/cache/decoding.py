"""The decode phase of a compressed cache: new tokens, attention over the compressed layers, decode-time eviction,
and the fixed-shape (static) mode that compiled decoding needs.

A single new token per sequence (a decode step) goes through the one decode step shared with the vLLM plugin
(:func:`slake.cache.decode_step.decode_step`, or its fused Triton kernels, :mod:`slake.kernels`):
:meth:`Decoder.append` stages the token (after making room for it on the host), :meth:`Decoder.decode_attention`
runs the step. Several tokens at once (a continuation prompt of a multi-turn chat) take the general path here:
appended first, attended causally by position, then evicted back to the targets, after the output for every method
(a block's eviction never changes the block's own outputs; :meth:`Decoder.decode_attention`).
"""

from __future__ import annotations

from typing import Any

import torch

from slake.attention.ptaa import attend
from slake.attention.softmax import probs_values, safe_softmax
from slake.cache.block_logits import layer_logits
from slake.cache.decode_step import StepSlots, decode_extras, layer_victims, protected_slots, sdpa_step
from slake.cache.dense_step import dense_kernel_reason, masked_dense_attention
from slake.cache.free_runs import FreeRuns
from slake.cache.fused_step import KernelReport, fused_arguments, fused_reason, keeps_order, run_step
from slake.cache.layer_store import _GROWTH, LayerStore
from slake.cache.state import CacheState
from slake.kernels import launch_config
from slake.methods.base import DecodeInputs

__all__ = ["BLOCK_REASON", "Decoder"]

#: why a block of new tokens after the prefill (a later chat turn, several tokens fed at once) runs in torch where the
#: fused kernels were asked for: they take one token per row and step (the block's count is left out, so that the
#: warning is logged once whatever the block's length); a chunked prefill's chunks are prefill, not counted here
BLOCK_REASON = "a multi-token block after the prefill, e.g. a later chat turn"


def _held_step():
    """:mod:`slake.kernels.held_step` (loaded with the fused kernels), looked up once."""
    global _HELD_STEP
    if _HELD_STEP is None:
        import slake.kernels.held_step as module

        _HELD_STEP = module
    return _HELD_STEP


_HELD_STEP = None


class Decoder:
    """Decoding over the layers of a :class:`~slake.cache.state.CacheState`.

    Attributes
    ----------
    static : bool
        Fixed-shape mode (:meth:`prepare_static`): every layer preallocated, no host bookkeeping per step.
    kernels : str
        ``"torch"`` (the reference step) or ``"triton"`` (the fused kernels, :mod:`slake.kernels`; steps the kernels
        do not cover run the torch step and say so once, :attr:`report`).
    """

    def __init__(self, state: CacheState, kernels: str = "torch") -> None:
        self.state = state
        self.static = False
        self.kernels = kernels
        #: which implementation ran the single-token steps, and why a requested fused step did not
        self.report = KernelReport()
        #: per layer, a host lower bound on the free slots of every row (eager decode; None: not yet known)
        self._free: list[int | None] = [None] * state.num_layers
        #: per layer, the single new token appended and not yet attended ``(keys, values)`` (``(B, Hkv, 1, d)``)
        self._staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * state.num_layers
        #: per layer of an eager cache, ``n`` when every row's and KV head's valid slots are exactly its first ``n``
        #: (an unpadded batch in a layer that never evicts), -1 when not, None when not yet read (:meth:`_prefix_of`)
        self._prefix: list[int | None] = [None] * state.num_layers
        self._order_for: tuple[str, bool] | None = None  # (kernels, whether the stores keep the slots' order)
        #: per layer, the fused step with its arguments after its query, key and value made once
        #: (:class:`~slake.kernels.held_step.HeldStep`), with the objects and facts they were made from: reused while
        #: those are the same objects (:meth:`_fused_sources`)
        self._fused: list[tuple[tuple, tuple, tuple, Any] | None] = [None] * state.num_layers
        #: in static mode, the single-token steps the append-only layers still have a free slot for (None: no layer
        #: appends without evicting, or not static); counted on the host in eager steps only (:meth:`append`)
        self._static_room: int | None = None
        self._static_steps = 0  # the new tokens prepare_static made room for
        #: per layer in static mode, the free slots of an append-only layer without scores, linear state or per-head
        #: visibility, tracked on the device (:class:`~slake.cache.free_runs.FreeRuns`; None: searched at each step)
        self._runs: list[FreeRuns | None] = [None] * state.num_layers
        #: the fused steps' scratch, shared by the layers (:class:`~slake.kernels.held_step.ScratchArena`; made with
        #: the first held step)
        self._arena: Any = None

    @property
    def _keeps_order(self) -> bool:
        """Whether the stores keep the fused step's slot order (:func:`slake.cache.fused_step.keeps_order`), for the
        kernels chosen now (worked out once per choice, not at every step)."""
        known = self._order_for
        if known is None or known[0] != self.kernels:
            known = self._order_for = (self.kernels, keeps_order(self.state.method, self.kernels))
        return known[1]

    def reset_all(self) -> None:
        """Forget the host bookkeeping of every layer (after the batch was reordered or repeated)."""
        for i in range(self.state.num_layers):
            self.reset_layer(i)
            if self.static:  # the rows moved: their free slots with them (beam search runs its reorders eagerly)
                self._runs[i] = self._free_runs(i)

    def reset_layer(self, layer_idx: int) -> None:
        """Forget what the decoder knew of a layer whose slots changed outside a decode step (a prefill, a chunk)."""
        self._free[layer_idx] = None
        self._staged[layer_idx] = None
        self._prefix[layer_idx] = None
        self._fused[layer_idx] = None

    # ------------------------------------------------------------------ new tokens
    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> LayerStore:
        """Add new tokens of layer ``layer_idx``; returns the store.

        A single new token (a decode step) is staged for :meth:`decode_attention`, which writes it into the row's
        first free slot inside the shared decode step; room for it is made here, without reading anything back from
        the device: whether the layer has a free slot is known on the host (:attr:`_free`, set once after prefill: a
        layer that evicts one token per step keeps its free slots, an append-only one uses one per step), and in
        static mode (:meth:`prepare_static`) the room was preallocated. Several tokens at once are written now.
        """
        state = self.state
        store = state.store(layer_idx)
        if self._staged[layer_idx] is not None:
            raise RuntimeError(f"layer {layer_idx}: a new token was appended before the previous one was attended")
        n_new = keys.shape[2]
        if n_new == 1:
            if not self.static:
                self._make_room(layer_idx, store)
                state.seen[layer_idx] += 1
            elif layer_idx == 0 and self._static_room is not None:
                self._use_static_room()
            self._staged[layer_idx] = (keys, values)
            return store
        if self.static:
            raise RuntimeError(
                "a static-mode cache decodes one token per step; a multi-token append needs the "
                "dynamic cache (build the SlakeCache without max_cache_len)"
            )
        start = state.seen[layer_idx]
        pos = torch.arange(start, start + n_new, device=keys.device)
        store.append(keys, values, pos, growth=1 if state.evicts(layer_idx) else _GROWTH)
        state.seen[layer_idx] = start + n_new
        self.position_of(layer_idx).add_(n_new)
        self._free[layer_idx] = None
        self._prefix[layer_idx] = None
        return store

    def _use_static_room(self) -> None:
        """Count one static step against the free slots :meth:`prepare_static` gave the append-only layers, and
        refuse the step that has none left: its token would overwrite a kept one and the step answer from a cache
        that silently lost it. An eager step is counted on the host (a ValueError). A compiled step changes no host
        state, so every step is also checked on the device, against the new token's position
        (``torch._assert_async``: a RuntimeError on the CPU, a device-side assert on CUDA): eager steps after
        compiled ones on one cache count only themselves on the host."""
        seen = self.state.seen[0]
        message = (
            f"this SlakeCache was built with max_cache_len={seen + self._static_steps}: after its prompt of {seen} "
            f"tokens it has room for {self._static_steps} new tokens, and one more was decoded; build it with "
            f"max_cache_len >= prompt + new tokens"
        )
        if not torch.compiler.is_compiling():
            if self._static_room is not None and self._static_room < 1:
                raise ValueError(message)
            self._static_room = None if self._static_room is None else self._static_room - 1
        torch._assert_async(self.position_of(0) < seen + self._static_steps, message)

    def _make_room(self, layer_idx: int, store: LayerStore) -> None:
        """Make sure every row of an eager layer has a free slot for one new token (host bookkeeping only)."""
        free = self._free[layer_idx]
        evicts = self.state.evicts(layer_idx)
        if free is None:  # once per layer after prefill; where some rows evict, only the others grow step by step
            mixed = not evicts and self.state.scored(layer_idx)
            free = store.room_when_some_rows_evict(self.state.decode_bound(layer_idx)) if mixed else store.min_free()
        if free < 1:
            growth = 1 if evicts else self.state.growth
            store._grow(growth)
            free += growth
        self._free[layer_idx] = free if evicts else free - 1

    def position_of(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s next position, a 0-dim int64 device tensor (the layer must be prefilled)."""
        counter = self.state.position[layer_idx]
        if counter is None:
            raise RuntimeError(f"layer {layer_idx} has not been prefilled")
        return counter

    def seen_tokens(self, layer_idx: int) -> int:
        """Tokens layer ``layer_idx`` has seen (its next position); in static mode a read of the device counter."""
        counter = self.state.position[layer_idx]
        if self.static and counter is not None:
            return int(counter)
        return self.state.seen[layer_idx]

    # ------------------------------------------------------------------ attention
    def decode_attention(self, layer_idx: int, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the newest ``n_q`` queries over the compressed layer, with decode-time eviction; returns
        ``(B, Hq, n_q, d)`` float32 (the query's dtype where the fused kernels ran the step, the cache's where the
        full cache's SDPA step did).

        One query after a staged token is the shared decode step (:func:`~slake.cache.decode_step.decode_step`),
        which keeps each method's order: SLAKE (``evict_before_output``) evicts and folds its victim before the
        output (Algorithm 1), the others after it.

        Several queries (after a multi-token :meth:`append`, e.g. a later chat turn) first attend causally by
        position over the layer as it is (kept slots, the block's own tokens and the linear state); only then, if the
        layer is over its budget, does the method's decode rule score the slots and evict the lowest-scored unprotected
        ones, for every method, ``evict_before_output`` included. The rule reads the softmax of the block's last
        ``window`` queries (its observation window, as a prompt chunk is scored), or of every query for a rule that
        accumulates each step's attention (``Method.decode_accumulates``: H2O, AhaKV, KVzip); the mean over every
        query would favour the block's earlier tokens, which more of its queries see. A rule that reads the queries
        as a distribution (``Method.reads_block_queries``: Expected Attention) gets every one of them. A
        block's eviction must not change any of the block's own outputs: it is chosen from every query's scores, so
        evicting first could drop (and, with a linear state, fold) a token of the block, whose fold every query of the
        block would then read and whose masked slot earlier queries would lose too: query ``i``'s output would
        depend on the tokens after it. Output first keeps each query exact over the cache before the block plus the
        block's tokens up to its own, as a prefill of the same tokens would have it.
        """
        staged = self._staged[layer_idx]
        if staged is not None:
            self._staged[layer_idx] = None
            B, Hq, _, d = queries.shape
            return self.step(layer_idx, queries.view(B, Hq, d), *staged, scaling).view(B, Hq, 1, d)
        state = self.state
        store = state.store(layer_idx)
        B, Hq, nq, d = queries.shape
        if not torch.compiler.is_compiling():  # the general path below is torch's, never the fused step: said so
            self.report.record("torch", BLOCK_REASON if self.kernels == "triton" else None)
        newest = state.seen[layer_idx] - 1
        qpos = torch.arange(newest - nq + 1, newest + 1, device=queries.device)
        qf, x = layer_logits(store, queries, qpos, scaling)
        target = state.targets[layer_idx]
        if target is None or not state.scored(layer_idx):
            return attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True).reshape(B, Hq, nq, d)
        probs = safe_softmax(x)  # (B, H, g, nq, n), a new tensor: attend may overwrite x below
        # the block's output first, causal, over the layer before any eviction (see the docstring: an eviction chosen
        # from every query's scores would otherwise let earlier queries see later tokens through the fold and mask)
        if store.linear is None:
            out = probs_values(probs, store.dense_values())
        else:
            out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
        # scored from the block's observation window (its last ``window`` queries), as a prompt chunk is; every query
        # for rules that accumulate each step's attention (``Method.decode_accumulates``)
        method = state.method
        rows = nq if method.decode_accumulates else max(min(method.window, nq), 1)
        q_rows = qf if method.reads_block_queries else qf[:, :, :, nq - rows :]  # every query for a distribution
        evict = self.evict(layer_idx, probs[:, :, :, nq - rows :], target, newest, q_rows)
        if evict is not None:
            slots, chosen, mask = evict
            store.free(mask, slots, chosen)  # folds the victims into the linear state (if any) for later steps
        return out.reshape(B, Hq, nq, d)

    def step(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """The shared single-token decode step of one layer (``query`` ``(B, Hq, d)``, ``key``/``value``
        ``(B, Hkv, 1, d)``); returns ``(B, Hq, d)`` (float32; the query's dtype from the fused kernels, the cache's
        from the full cache's SDPA step) and advances the layer's position counter.

        Every choice here is made from host facts fixed at prefill (the method, whether the layer has targets, a
        linear state, per-head visibility); per-sequence and per-head differences live in the ``targets`` tensor
        and the masks, so a step reads nothing back from the device (``docs/compile.md``)."""
        state = self.state
        store = state.store(layer_idx)
        counter = self.position_of(layer_idx)
        m = state.method
        scored = state.scored(layer_idx)
        B, Hq, d = query.shape
        if not scored and store.linear is None and store.head_visible is None:
            # no score, no linear term (a method with one keeps none where nothing was compressed): write the token,
            # then one attention over the store
            n = None if self.static else self._prefix_of(layer_idx, store)
            runs = self._runs[layer_idx] if self.static else None
            if n is None:
                if runs is not None:  # the next of the layer's free slots, tracked on the device (free_runs)
                    slots = runs.take()
                else:
                    slots = (~store.valid).to(torch.uint8).argmax(-1, keepdim=True)
                if runs is None and self.static and torch.compiler.is_compiling():
                    # a compiled step counts nothing on the host (:meth:`append` does in eager ones): a row without a
                    # free slot (more steps than max_cache_len made room for) gets an index past the store, which
                    # the write refuses (a CUDA device assert), instead of overwriting its slot 0
                    room = (~store.valid).any(-1, keepdim=True)
                    slots = torch.where(room, slots, torch.full_like(slots, store.valid.shape[-1]))
                store._write(slots, key, value, counter.view(1, 1, 1).expand(B, store.valid.shape[1], 1), 0.0)
                # a static store's fixed shape, or rows padded at the front: attend over the whole store, masked;
                # with the fused kernels split over the keys (SDPA with a mask ran as cuDNN's kernel on the H200,
                # which does not split them: the compiled full cache took 148 ms per token at 128K)
                out = masked_dense_attention(self.kernels, store, query, scaling, self.report)
            else:
                store.write_at(n, key, value, counter)  # slot n: the first free one, known on the host
                self._prefix[layer_idx] = n + 1
                if store.kv_dtype is not None and self.kernels == "triton":
                    # 8-bit rows: the dense kernels read the codes and scales (SDPA would dequantise the whole store)
                    out = masked_dense_attention(self.kernels, store, query, scaling, self.report)
                else:
                    # every slot up to the new token's (slot n) is valid and none after it: SDPA over those slots
                    # with no mask, which a GPU runs with its split-over-the-keys decode kernel (a masked call read
                    # the cache at a twentieth of an H200's bandwidth, docs/gpu.md)
                    # (8-bit rows: only those slots dequantised, not the whole store with its free slots)
                    out = sdpa_step(query, *store.dense_rows(None, 0, n + 1), None, scaling)
                    if not torch.compiler.is_compiling():  # no kernel choice applies: said as what it is
                        self.report.record("sdpa")
            counter.add_(1)
            return out
        if scored and m.slot_weighted and store.weights is None:  # once after prefill (prepare_static in static mode)
            store.weights = self._slot_weights(layer_idx)
        B, H = store.valid.shape[:2]
        kv = key.view(B, H, d), value.view(B, H, d)
        # the fused kernels in eager code: the step's arguments but its query, key and value are made once and then
        # reused while every object they were made from is the same (an eager step on a GPU is bound by its host);
        # a layer that does not evict but keeps a linear state or per-head visibility takes them too, evicting nothing
        reuse = self.kernels == "triton" and not torch.compiler.is_compiling()
        if reuse:
            held = self._fused[layer_idx]
            # WIDE_SLOTS: held arguments of narrow rows lack the slot order, which a lowered constant's wide form writes
            facts = (query.device, query.dtype, d, float(scaling), launch_config.WIDE_SLOTS)
            if held is not None and held[1] == facts and held[0] == self._fused_sources(layer_idx, store, counter)[0]:
                self.report.record("triton")
                return held[3](query, *kv)
        slots_ = self._step_slots(layer_idx, store, counter)
        if reuse:
            arguments, reason = fused_arguments(m, slots_, store, query, scaling, counter)
            if arguments is None:  # not covered: the torch step, the reason recorded once (not worked out again)
                self.report.record("torch", reason)
                return run_step("torch", m, slots_, store, query, *kv, scaling, counter=counter)
            ids, sources = self._fused_sources(layer_idx, store, counter)
            module = _held_step()
            if self._arena is None:
                self._arena = module.ScratchArena()
            step = module.HeldStep(arguments, self._arena) if launch_config.HELD_STEP else module.Afresh(arguments)
            self._fused[layer_idx] = (ids, facts, sources, step)
            self.report.record("triton")
            return step(query, *kv)
        return run_step(self.kernels, m, slots_, store, query, *kv, scaling, counter=counter, report=self.report)

    def _step_slots(self, layer_idx: int, store: LayerStore, counter: torch.Tensor) -> StepSlots:
        """The :class:`~slake.cache.decode_step.StepSlots` of a single-token step of layer ``layer_idx`` (one that is
        not the full cache's: scored, or keeping a linear state or per-head visibility)."""
        state = self.state
        info = state.prefill_info()
        dev = store.valid.device
        scored = state.scored(layer_idx)
        return StepSlots(
            positions=store.positions,
            valid=store.valid,
            scores=store.scores,
            target=state.targets[layer_idx] if scored else None,
            newest=counter,
            prompt_len=info.device_copy("real_len", dev),
            budget=info.device_copy("budget", dev),
            first_real=info.device_copy("first_real", dev) if state.method.sinks else None,
            head_visible=store.head_visible,
            linear=store.linear,
            layer=state.layer_context[layer_idx],
            weights=store.weights if scored else None,
            order=store.kernel_order() if scored and self._keeps_order else None,
        )

    def _fused_sources(self, layer_idx: int, store: LayerStore, counter: torch.Tensor) -> tuple[tuple, tuple]:
        """What the fused step's arguments of layer ``layer_idx`` are made from
        (:func:`~slake.cache.fused_step.fused_arguments`): the store and each of its tensors the kernels read or
        write, the layer's targets, position counter and context, the per-sequence facts' device copies, the method;
        as ``(their ids, themselves)``. A tensor that is the same object has the same shape, strides, dtype and
        memory (slake never resizes one in place), so the arguments made from them hold; any one replaced (a prefill,
        a grown store, a reordered batch, new slot weights) makes them again. The method's hyperparameters and
        launch configuration are read when the arguments are made: the first is fixed at prefill, the second is read
        again at every launch (``launch_config``)."""
        state = self.state
        info = state.info
        dev = store.valid.device
        copies = info.on_device if info is not None else {}
        linear = store.linear
        layer = state.layer_context[layer_idx]
        sources = (
            store, store.keys, store.values, store.k_scale, store.v_scale, store._row_table, store.positions,
            store.valid, store.scores, store.head_visible, linear, None if linear is None else linear.aug,
            store.weights, store._order, state.targets[layer_idx], counter, info, copies.get(("real_len", dev)),
            copies.get(("budget", dev)), copies.get(("first_real", dev)), layer,
            None if layer is None else layer.out_proj, state.method,
        )  # fmt: skip
        return tuple(map(id, sources)), sources

    def _prefix_of(self, layer_idx: int, store: LayerStore) -> int | None:
        """``n`` when every row's and KV head's valid slots in layer ``layer_idx`` are exactly its first ``n`` and a
        free slot follows them, else None. Read from the device once per layer after its prefill (a few read-backs,
        beside :meth:`_make_room`'s), then kept on the host: the layer's step writes slot ``n`` and advances it."""
        n = self._prefix[layer_idx]
        if n is None:
            valid = store.valid
            counts = valid.sum(-1)
            n = int(counts.max()) if valid.numel() else 0
            dense = valid.numel() > 0 and n < valid.shape[-1] and bool((counts == n).all())
            n = n if dense and bool(valid[..., :n].all()) else -1
            self._prefix[layer_idx] = n
        if n >= store.valid.shape[-1]:  # no free slot after the prefix (never after _make_room): read it again
            self._prefix[layer_idx] = None
            return None
        return None if n < 0 else n

    def _slot_weights(self, layer_idx: int) -> torch.Tensor:
        """The method's per-slot weights of every slot of layer ``layer_idx`` (``Method.slot_weighted``)."""
        state = self.state
        store = state.store(layer_idx)
        return state.method.slot_weights(store.dense_values().float(), state.layer_context[layer_idx]).contiguous()

    def evict(
        self,
        layer_idx: int,
        probs: torch.Tensor,
        target: torch.Tensor,
        newest: int,
        queries: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None:
        """Score a layer's slots with the method's decode rule from ``probs`` ``(B, Hkv, g, n_q, n)`` and choose the
        slots to evict (the general path: rows may be several tokens over their targets).

        Returns None when no row is over its target, else ``(slots, chosen, mask)``: ``(B, Hkv, e)`` slot indices,
        ``(B, Hkv, e)`` bool (which of them are really evicted) and the dense ``(B, Hkv, n)`` bool mask; a method
        that evicts across the layer's heads gives only the mask (:meth:`_evict_across_heads`).
        """
        state = self.state
        store = state.store(layer_idx)
        info = state.prefill_info()
        B, H, g, nq, n = probs.shape
        store.scores = state.method.decode_scores(
            DecodeInputs(
                probs=probs.reshape(B, H * g, nq, n),
                positions=store.positions,
                valid=store.valid,
                stored=store.scores,
                prompt_len=info.device_copy("real_len", probs.device),
                budget=info.device_copy("budget", probs.device),
                **decode_extras(
                    state.method,
                    state.layer_context[layer_idx],
                    store.dense_keys(),
                    store.dense_values(),
                    None if queries is None else queries.reshape(B, H * g, queries.shape[-2], -1),
                ),
                target=target,
            )
        ).float()
        counts = store.counts()
        across = state.method.evicts_across_heads
        if not across:
            excess = torch.where(target >= 0, counts - target, torch.zeros_like(counts)).clamp_min(0)
            emax = int(excess.max())  # one host sync per layer and call (the general path only)
            if emax == 0:
                return None
        first = info.device_copy("first_real", probs.device) if state.method.sinks else None
        # protected (window, sinks) and empty slots are never chosen while an evictable slot remains
        guard = protected_slots(state.method, store.positions, store.valid, newest, first) | ~store.valid
        scores = store.scores.masked_fill(guard, float("inf"))
        if across:
            return self._evict_across_heads(scores, store.valid, counts, target)
        if emax == 1:  # argmin returns the first minimum, like a stable ascending sort
            lowest = scores.argmin(-1, keepdim=True)
        else:
            lowest = torch.sort(scores, dim=-1, stable=True).indices[..., :emax]
        chosen = (torch.arange(emax, device=probs.device) < excess[..., None]) & store.valid.gather(-1, lowest)
        mask = torch.zeros_like(store.valid).scatter_(-1, lowest, chosen)
        return lowest, chosen, mask

    @staticmethod
    def _evict_across_heads(
        ranked: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, target: torch.Tensor
    ) -> tuple[None, None, torch.Tensor] | None:
        """:meth:`evict` for a method that evicts across a layer's KV heads (:func:`layer_victims`): each head over the
        layer's widest target gives its lowest slots down to it, the rest go by the lowest scores of the layer.
        Returns None (nothing to evict) or ``(None, None, mask)``: such a method keeps no linear state to fold."""
        active = target[:, :1] >= 0
        forced_n = torch.where(active, counts - target.amax(-1, keepdim=True), 0).clamp_min(0)  # (B, H)
        need = torch.where(active[:, 0], counts.sum(-1) - target.sum(-1), 0).clamp_min(0)
        most = int(torch.maximum(need, forced_n.sum(-1)).max())  # one host sync per layer and call
        if most == 0:
            return None
        order = torch.sort(ranked, dim=-1, stable=True).indices  # each head's slots, lowest first
        first_n = torch.arange(valid.shape[-1], device=valid.device) < forced_n[..., None]
        forced = torch.zeros_like(valid).scatter_(-1, order, first_n) & valid  # each head's forced_n lowest
        return None, None, layer_victims(ranked, valid, counts, target, forced, most)

    def attention(self, layer_idx: int, queries: torch.Tensor, positions: torch.Tensor, scaling: float) -> torch.Tensor:
        """Read-only attention of queries at ``positions`` over the layer as it is now (no eviction).

        Kept entries at or before each query's position are visible; the linear term (if any) is included. Used by
        ``slake fidelity`` to compare against full attention. Returns ``(B, Hq, n_q, d)`` float32.
        """
        store = self.state.store(layer_idx)
        B, Hq, nq, d = queries.shape
        qf, x = layer_logits(store, queries, positions, scaling)
        out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
        return out.reshape(B, Hq, nq, d)

    # ------------------------------------------------------------------ fixed shapes
    def prepare_static(self, decode_tokens: int) -> None:
        """Enter static (fixed-shape) decode mode after the prefill: every later step has the same shapes.

        A layer that evicts one token per step gets one free slot per row; an append-only layer (the full cache, a
        prompt within its budget, ``decode_eviction=False``) gets ``decode_tokens`` free slots, allocated now. From
        then on a decode step reads nothing back from the device and changes no host state, so it can be compiled
        as one graph (``docs/compile.md``); more than ``decode_tokens`` steps on an append-only layer are not
        supported (its last free slot would be overwritten), as with transformers' ``StaticCache``.
        """
        state = self.state
        if decode_tokens < 1:
            raise ValueError(f"max_cache_len leaves no room to decode: the prompt has {state.seen[0]} tokens")
        if any(s is None for s in state.layers):
            raise RuntimeError("prepare_static needs every layer prefilled")
        keeps_order = self._keeps_order  # worked out now: a compiled step that set it would compile again
        appends = any(not state.evicts(i) for i in range(state.num_layers))
        self._static_steps = int(decode_tokens)
        self._static_room = int(decode_tokens) if appends else None
        for i in range(state.num_layers):
            store = state.store(i)
            store.reserve(1 if state.evicts(i) else max(int(decode_tokens), 1))
            self._free[i] = None
            self._runs[i] = self._free_runs(i)
            state.position[i] = torch.tensor(state.seen[i], dtype=torch.int64, device=store.keys.device)
            if state.method.slot_weighted and state.scored(i):
                store.weights = self._slot_weights(i)
            if store.linear is not None:
                store.linear.attention_parts()  # made now: a lazily cached view would change the first step's guards
            if self.kernels == "triton":
                # the fused kernels' row table and slot order, made now: one made inside a captured step would be a
                # CUDA graph's output, overwritten by the next replay while the store still holds it
                store.kernel_memory()
                if keeps_order and state.scored(i):
                    store.kernel_order()
            # a decode rule's per-layer map (Expected Attention's rotation), made now rather than in a compiled step
            state.method.decode_query_map(state.layer_context[i], store.values.shape[-1], store.values.device)
            for name in ("real_len", "first_real", "budget"):  # the per-sequence facts on each layer's device
                state.prefill_info().device_copy(name, store.keys.device)
        if not torch.compiler.is_compiling():
            # a compiled step records nothing (a side effect per step would break the graph): what each layer's
            # static steps run, and why not the fused kernels where they were asked for, is worked out now from the
            # same host facts the step reads, recorded in the report and logged
            for i in range(state.num_layers):
                self.report.plan(i, *self.planned_step(i))
        self.static = True
        if not torch.compiler.is_compiling():
            for t in self.static_tensors():
                if t.is_cuda:  # fixed addresses: a CUDA graph replays over them without copying the cache
                    torch._dynamo.mark_static_address(t)

    def _free_runs(self, layer_idx: int) -> FreeRuns | None:
        """The free slots of layer ``layer_idx`` tracked on the device, for a static step that writes the first free
        slot with no score, linear state or per-head visibility (:meth:`step`'s first branch); None for other layers,
        in a compiled region (it reads the device once), or when the free slots are not in runs
        (:meth:`FreeRuns.of`): then the step searches for its slot."""
        state = self.state
        store = state.store(layer_idx)
        if state.scored(layer_idx) or store.linear is not None or store.head_visible is not None:
            return None
        return None if torch.compiler.is_compiling() else FreeRuns.of(store.valid)

    def planned_step(self, layer_idx: int) -> tuple[str, str | None]:
        """Which implementation a static single-token step of layer ``layer_idx`` runs, ``(kind, reason)``: ``kind``
        ``"triton"`` or ``"torch"``, ``reason`` why not the fused kernels where they were asked for (None otherwise).
        Worked out on the host, as :meth:`step` chooses in static mode: the full cache's masked attention
        (:func:`~slake.cache.dense_step.dense_kernel_reason`), or the shared decode step
        (:func:`~slake.cache.fused_step.fused_reason`). Call after :meth:`prepare_static`'s preparations (slot
        weights, the kernels' row table and order), which it reads; ``layer_idx`` must be prefilled."""
        state = self.state
        store = state.store(layer_idx)
        if self.kernels != "triton":
            return "torch", None
        if not state.scored(layer_idx) and store.linear is None and store.head_visible is None:
            reason = dense_kernel_reason(store)  # a static store's masked attention (masked_dense_attention)
        else:
            reason = fused_reason(state.method, self._step_slots(layer_idx, store, self.position_of(layer_idx)), store)
        return ("triton", None) if reason is None else ("torch", reason)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a static decode step reads or updates in place (``torch._dynamo.mark_static_address``)."""
        state = self.state
        out: list[torch.Tensor] = [t for t in state.position if t is not None]
        for s in state.layers:
            if s is None:
                continue
            out += [getattr(s, n) for n in s._slot_tensors() + ("positions", "valid", "scores")]
            if s.head_visible is not None:
                out.append(s.head_visible)
            if s.weights is not None:
                out.append(s.weights)
            if s.linear is not None:
                out.append(s.linear.aug)
            if s._row_table is not None:
                out.append(s._row_table)
            if s._order is not None:
                out.append(s._order)
        out += [t for t in state.targets if t is not None]
        out += [t for runs in self._runs if runs is not None for t in runs.tensors()]
        if state.info is not None:
            out += list(state.info.on_device.values())
        return out
