"""The compressor (:class:`CompressedKV`): prefill compression with layer budgets (uniform, pyramid or cascading), and
decode over the compressed cache with decode-time eviction and the optional PTAA linear term.

This module is engine-agnostic (no transformers import). ``slake.engines.transformers`` feeds it each layer's post-RoPE
queries,
keys and values; it owns one :class:`~slake.cache.layer_store.LayerStore` per layer.

Conventions (``docs/conventions.md``; ``docs/methods/README.md#observation-window-attention``):

* Positions index the (left-padded) input sequence; the token decoded at step ``t`` has position ``S + t``.
* Every layer keeps its ``protected`` tokens (sinks + observation window). The rest of the per-layer budget is the
  *selectable* budget; the total selectable budget is ``L * (C - protected)``.
* A sequence whose real prompt length is ``<= C`` is not compressed at all (no eviction at prefill or decode), so its
  results equal the full cache.
* Budgets and evictions are per sequence; padding is never kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from slake.attention.linear_state import LinearState
from slake.attention.ptaa import attend
from slake.attention.softmax import matmul_f32, probs_values, safe_softmax
from slake.budgets import allocation as budget_rules
from slake.budgets.budget import Budget
from slake.cache.layer_store import _GROWTH, LayerStore
from slake.cache.quant import parse_kv_dtype, scale_bytes_per_row
from slake.methods.base import DecodeInputs, LayerContext, Method, PrefillInputs, PrefillScores
from slake.methods.budget_check import check_method_budget

_CHUNK_QUERY_BLOCK = 128  # chunk queries attended at once during a chunked prefill (bounds the logits' memory)


@dataclass
class PrefillInfo:
    """Per-sequence facts fixed at prefill."""

    prompt_len: int  # padded length S
    real_len: torch.Tensor  # (B,) int64
    first_real: torch.Tensor  # (B,) int64 position of the first real token
    budget: torch.Tensor  # (B,) int64 average per-layer budget C (window included)
    compress: torch.Tensor  # (B,) bool: real_len > budget
    preferences: list[torch.Tensor | None] = field(default_factory=list)
    layer_budgets: torch.Tensor | None = None  # (B, L) int64 selectable budgets (final)
    #: host copies of ``compress.any()`` / ``compress.all()``, read at every decode step without a device read-back
    compress_any: bool = False
    compress_all: bool = False
    #: device copies of ``real_len``, ``first_real`` and ``budget``, made once (the decode step reads them)
    on_device: dict[str, torch.Tensor] = field(default_factory=dict)

    def device_copy(self, name: str, device: torch.device) -> torch.Tensor:
        """``getattr(self, name)`` on ``device``, copied once and reused (no host-to-device copy per step)."""
        t = self.on_device.get(name)
        if t is None or t.device != device:
            t = getattr(self, name).to(device)
            self.on_device[name] = t
        return t


class CompressedKV:
    """A compressed KV cache for one generation.

    Parameters
    ----------
    method : Method
        The compression method (see :mod:`slake.methods`).
    budget : Budget | int | float
        Average per-layer cached tokens per KV head (window included), or a ratio of the prompt length.
    num_layers : int
        Number of attention layers of the model.
    charge_linear_state : bool
        Charge the PTAA linear state against the budget (SLAKE "memory honesty" option): the selectable budget of
        each layer shrinks by ``ceil((d*d + 2d) * 4 / (2 * d * itemsize))`` token slots.
    kv_dtype : str | None
        Storage of the kept keys and values: None (the model's dtype) or ``"int8"`` / ``"fp8_e4m3"`` (8-bit codes
        with a float32 scale per row, dequantised in attention; :mod:`slake.cache.quant`).
    defer_cascade : bool
        Layer-preference methods (CAKE, SLAKE, LAVa): evict each layer at its own cascade stage and at the final
        stage only, skipping the re-evictions of earlier layers at the stages in between. The kept sets are the
        same (stage budgets never increase, so any subsequence of the stages ends in one-shot eviction with the final
        budgets, ``docs/methods/cake.md#cascading-prefill``); the PTAA linear state sums the same evicted tokens in
        fewer groups (equal up to float rounding). The cache then holds each layer at its first-stage budget (at most
        the layer cap) until the last layer, not the cascade's bound of the budget plus one layer: for engines that
        hold the whole prompt's KV during prefill anyway (the vLLM plugin), where the intermediate stages are only
        work. Default False: the paper's cascade.
    """

    def __init__(
        self,
        method: Method,
        budget: Budget | int | float | str,
        num_layers: int,
        charge_linear_state: bool = False,
        kv_dtype: str | None = None,
        defer_cascade: bool = False,
    ) -> None:
        self.method, self.budget = check_method_budget(method, budget)
        self.defer_cascade = defer_cascade
        self.kv_dtype = parse_kv_dtype(kv_dtype)
        self.num_layers = num_layers
        self.charge_linear_state = charge_linear_state
        self.layers: list[LayerStore | None] = [None] * num_layers
        #: tokens seen per layer (kept or evicted), on the host; in static mode (:meth:`prepare_static`) the device
        #: counters :attr:`position` are the truth and :meth:`seen_tokens` reads them
        self.seen: list[int] = [0] * num_layers
        #: per layer, the position of the next token as a 0-dim int64 device tensor (updated in place each step)
        self.position: list[torch.Tensor | None] = [None] * num_layers
        #: per layer, a host lower bound on the free slots of every row (eager decode; None: not yet known)
        self._free: list[int | None] = [None] * num_layers
        #: fixed-shape decode: every layer preallocated, no host bookkeeping per step (:meth:`prepare_static`)
        self.static = False
        #: enter static mode right after the prefill, with room for ``max_cache_len`` positions in append-only layers
        self.max_cache_len: int | None = None
        self.info: PrefillInfo | None = None
        self.targets: list[torch.Tensor | None] = [None] * num_layers  # (B, Hkv) decode sizes per layer
        self._raw_scores: dict[int, torch.Tensor] = {}  # prefill scores kept until final (carry_protected_scores)
        #: layers left in score order by an intermediate cascade stage (:meth:`_evict_to`), until the final stage
        #: re-packs them in position order: their valid, protected and (uniform head split) finite-score counts per row
        self._ranked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.chunked_prefill = False  # True between begin_chunked_prefill and end_chunked_prefill
        self._chunk_padding: torch.Tensor | None = None  # (B, S) padding of the whole prompt (chunked prefill)
        #: optional layer -> PrefillScores memo shared by replays of one recorded prefill with the same method
        #: configuration (see :meth:`slake.engines.transformers.prefill_once.PrefillCapture.replay`); used only when
        # the method's
        #: scores do not depend on the budget
        self.score_memo: dict[int, PrefillScores] | None = None
        #: per layer, what the engine knows about the model's layer (rotary embedding, output projection), for
        #: methods whose ``layer_facts()`` name it (``PrefillInputs.layer``, ``DecodeInputs.layer``)
        self.layer_context: list[LayerContext | None] = [None] * num_layers
        #: ``(L, B, Hkv, S)`` scores of the method's second pass over the prompt (``Method.second_pass``), set by the
        #: engine before the prefill (``PrefillInputs.pass_scores``)
        self.pass_scores: torch.Tensor | None = None

    # ================================================================== prefill
    def _prefill_scores(self, layer_idx: int, inputs: PrefillInputs) -> PrefillScores:
        """The method's prefill scores, from :attr:`score_memo` when it may be reused (budget-independent scores,
        whole-prompt prefill). Memo entries are cloned on the way out: the compressor edits scores in place."""
        memo = self.score_memo
        if memo is None or self.method.prefill_scores_use_budget or self.chunked_prefill:
            return self.method.prefill_scores(inputs)
        if layer_idx not in memo:
            memo[layer_idx] = self.method.prefill_scores(inputs)
        hit = memo[layer_idx]
        return PrefillScores(
            scores=hit.scores.clone(),
            preference=None if hit.preference is None else hit.preference.clone(),
            head_visible=None if hit.head_visible is None else hit.head_visible.clone(),
        )

    def _start(self, key_padding: torch.Tensor, head_dim: int, itemsize: int) -> PrefillInfo:
        B, S = key_padding.shape
        real = (~key_padding).sum(-1).to(torch.int64)
        budget = torch.tensor([self.budget.tokens(int(r)) for r in real.tolist()], dtype=torch.int64)
        if self.charge_linear_state and self.method.linear_cache:
            budget = budget - linear_state_slots(head_dim, itemsize)
        compress = real.cpu() > budget
        if self.method.keeps_everything:
            compress[:] = False
        if bool(compress.any()) and int(budget[compress].max()) > self._layer_cap():
            raise ValueError(
                f"{self.method.name}: max_layer_budget={self._layer_cap()} is below the average budget "
                f"{int(budget[compress].max())}; the layers could not hold the total budget"
            )
        if bool(compress.any()) and int(budget[compress].min()) < self.method.protected:
            raise ValueError(
                f"{self.method.name}: a budget of {int(budget[compress].min())} tokens is smaller than the protected "
                f"window + sinks ({self.method.protected}); use a larger budget or a smaller window"
            )
        return PrefillInfo(
            prompt_len=S,
            real_len=real.cpu(),
            first_real=(S - real).cpu(),
            budget=budget,
            compress=compress,
            preferences=[None] * self.num_layers,
            compress_any=bool(compress.any()),
            compress_all=bool(compress.all()),
        )

    def prefill_layer(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_padding: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Store layer ``layer_idx``'s prompt keys/values and compress them (called after its exact attention)."""
        B, H, S, d = keys.shape
        dev = keys.device
        if key_padding is None:
            key_padding = torch.zeros(B, S, dtype=torch.bool, device=dev)
        if self.info is None:
            full = self._chunk_padding if self.chunked_prefill else None
            # bytes per stored number: the model dtype's, or 8-bit codes plus the per-row scale (spread over d)
            itemsize = keys.element_size() if self.kv_dtype is None else (d + scale_bytes_per_row()) / d
            self.info = self._start(key_padding if full is None else full.to(dev), d, itemsize)
        elif self.info.prompt_len != S and not self.chunked_prefill:
            raise RuntimeError(f"layer {layer_idx} prefilled with {S} tokens, layer 0 with {self.info.prompt_len}")
        info = self.info
        if self.static:
            raise RuntimeError("this cache is in static decode mode; prefill a new cache")
        if info.compress_any:
            self._check_engine_inputs(layer_idx)
        self.seen[layer_idx] = S
        self.position[layer_idx] = torch.tensor(S, dtype=torch.int64, device=dev)
        self._free[layer_idx] = None
        positions = torch.arange(S, device=dev).view(1, 1, S).expand(B, H, S).contiguous()
        valid = (~key_padding)[:, None, :].expand(B, H, S).contiguous()
        scores = torch.zeros(B, H, S, dtype=torch.float32, device=dev)
        # the linear state exists only when something will be evicted (an uncompressed cache never folds a token);
        # a cache without it takes the same attention path as with an empty one (see decode_attention)
        linear = LinearState.empty(B, H, d, dev) if self.method.linear_cache and info.compress_any else None
        store = LayerStore(keys, values, positions, valid, scores, linear, kv_dtype=self.kv_dtype)
        self.layers[layer_idx] = store
        if not info.compress_any:
            self.targets[layer_idx] = None
            self._prefill_done(layer_idx)
            return
        result = self._prefill_scores(
            layer_idx,
            PrefillInputs(
                queries=queries,
                keys=keys,
                values=values,
                key_padding=key_padding,
                scaling=scaling,
                window=self.method.window,
                layer_idx=layer_idx,
                num_layers=self.num_layers,
                budget=info.budget.to(dev),
                layer=self.layer_context[layer_idx],
                pass_scores=self.pass_scores,
            ),
        )
        store.scores = self._protect(result.scores.float(), positions, valid, newest=S - 1)
        if result.head_visible is not None:  # uncompressed sequences keep everything visible to every head
            store.head_visible = result.head_visible.bool() | ~info.compress.to(dev).view(B, 1, 1, 1)
        if self.method.carry_protected_scores:
            self._raw_scores[layer_idx] = result.scores.float()
        info.preferences[layer_idx] = result.preference
        policy = self.method.layer_budgets
        if policy == "preference":
            last = layer_idx == self.num_layers - 1
            stage = self._preference_stage(layer_idx, final=last)
            if self.defer_cascade and not last and not self.chunked_prefill:  # the new layer's own stage only
                self._evict_to(layer_idx, stage[:, layer_idx], final=False)
                self._prefill_done(layer_idx)
                return
            batched = [i for i in range(layer_idx) if i in self._ranked and self._ranked[i][2] is not None]
            if batched:  # earlier layers left in score order, with the uniform head split: their keep counts at once
                self._evict_ranked(batched, stage, final=last)
            for layer in range(layer_idx + 1):
                if layer not in batched:
                    self._evict_to(layer, stage[:, layer], final=last)
            if last:
                info.layer_budgets = stage
                for layer in range(self.num_layers):
                    self._carry_protected(layer)
        else:
            sel = self._static_budgets(policy)
            self._evict_to(layer_idx, sel[:, layer_idx])
            self._carry_protected(layer_idx)
            if info.layer_budgets is None:
                info.layer_budgets = sel
        self._prefill_done(layer_idx)

    def _check_engine_inputs(self, layer_idx: int) -> None:
        """Refuse a prefill that lacks what the engine must give the method: its layer facts (rotary embedding,
        output projection) and its second pass's scores."""
        m = self.method
        if m.keeps_everything:
            return
        ctx = self.layer_context[layer_idx]
        missing = [f for f in m.layer_facts() if ctx is None or getattr(ctx, f) is None]
        if missing:
            raise ValueError(
                f"{m.name} needs the model's {' and '.join(missing)} of layer {layer_idx}, which this engine did not "
                f"provide (the transformers engine reads them from the model at the first forward; a model without "
                f"a rotary embedding or an output projection cannot run {m.name})"
            )
        if m.second_pass is not None and self.pass_scores is None:
            raise ValueError(
                f"{m.name} scores the prompt with a second pass ({m.second_pass}) before compressing it: prefill it "
                f"with slake.generate or slake.engines.transformers.generate.prefill, not a plain model forward"
            )
        if m.second_pass is not None and self.chunked_prefill:
            raise ValueError(f"{m.name} needs the whole prompt for its second pass; it cannot prefill in chunks")

    def _decode_extras(self, layer_idx: int, store: LayerStore, queries: torch.Tensor | None) -> dict:
        """``DecodeInputs`` fields a method asks for (``decode_reads_kv``, ``layer_facts``): the step's scaled queries
        ``(B, Hq, n_q, d)`` float32, the slots' keys and values as float32, and the layer's facts."""
        m = self.method
        extras: dict = {}
        if m.layer_facts():
            extras["layer"] = self.layer_context[layer_idx]
        if m.decode_reads_kv:
            extras["keys"] = store.dense_keys().float()
            extras["values"] = store.dense_values().float()
            if queries is not None:
                B, H, g, nq, d = queries.shape
                extras["queries"] = queries.reshape(B, H * g, nq, d)
        return extras

    def _prefill_done(self, layer_idx: int) -> None:
        """After the last layer's (whole-prompt) prefill: enter static mode when :attr:`max_cache_len` asks for it."""
        if layer_idx == self.num_layers - 1 and not self.chunked_prefill and self.max_cache_len is not None:
            self.prepare_static(self.max_cache_len - self.seen[layer_idx])

    def _selectable_total(self) -> torch.Tensor:
        """(B,) average selectable budget C - protected."""
        return (self.info.budget - self.method.protected).clamp_min(0)

    def _static_budgets(self, policy: str) -> torch.Tensor:
        info = self.info
        rows = []
        for b in range(len(info.real_len)):
            sel = int(self._selectable_total()[b])
            if policy == "pyramid":
                rows.append(self.method.pyramid_schedule(self.num_layers, sel, int(info.real_len[b])))
            else:
                rows.append(budget_rules.uniform_budgets(self.num_layers, sel))
        return torch.stack([r.to(torch.int64) for r in rows])

    def _preference_stage(self, m: int, final: bool) -> torch.Tensor:
        """(B, m+1) selectable budgets of layers 0..m at cascade stage m.

        See ``docs/methods/cake.md#cascading-prefill``.
        """
        info = self.info
        rows = []
        prefs_l = info.preferences[: m + 1]
        if len({p.device for p in prefs_l}) > 1:  # layers spread over devices (a model split over GPUs)
            prefs_l = [p.cpu() for p in prefs_l]
        every = torch.stack(prefs_l, -1).float().cpu()  # (B, m + 1), one copy to the host per stage
        for b in range(len(info.real_len)):
            prefs = every[b]
            total = int(self._selectable_total()[b]) * self.num_layers
            cap = max(min(int(info.real_len[b]), self._layer_cap()) - self.method.protected, 0)
            rows.append(budget_rules.preference_budgets(prefs, total, cap, final=final))
        return torch.stack([r.to(torch.int64) for r in rows])

    def _layer_cap(self) -> int:
        """The method's ``max_layer_budget`` (tokens per layer, window included), or a bound no prompt reaches."""
        cap = getattr(self.method, "max_layer_budget", None)
        return int(cap) if cap is not None else 1 << 62

    def _carry_protected(self, layer_idx: int) -> None:
        """Replace the ``+inf`` of kept protected prompt slots by the method's own score (carry_protected_scores)."""
        raw = self._raw_scores.pop(layer_idx, None)
        store = self.layers[layer_idx]
        if raw is None or store is None:
            return
        carried = raw.to(store.scores.device).gather(-1, store.positions.clamp_min(0))  # prompt slot = position
        store.scores = torch.where(store.valid & torch.isposinf(store.scores), carried, store.scores)

    def _protect(self, scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, newest: int) -> torch.Tensor:
        """+inf for the window (most recent tokens) and sinks, -inf for empty slots / padding."""
        scores = scores.masked_fill(self._protected_mask(positions, valid, newest), float("inf"))
        return scores.masked_fill(~valid, float("-inf"))

    def _protected_mask(self, positions: torch.Tensor, valid: torch.Tensor, newest: int | torch.Tensor) -> torch.Tensor:
        """``(B, H, n)`` bool: slots holding a sink or one of the ``window`` most recent tokens (``newest``: the
        newest position, an int or a 0-dim device tensor)."""
        m = self.method
        keep = None
        if m.window and not m.newest_evictable:
            keep = positions > newest - m.window
        if m.sinks:
            first = self.info.device_copy("first_real", positions.device).view(-1, 1, 1)
            sinks = (positions >= first) & (positions < first + m.sinks)
            keep = sinks if keep is None else keep | sinks
        return torch.zeros_like(valid) if keep is None else keep

    def _evict_to(self, layer_idx: int, selectable: torch.Tensor, final: bool = True) -> None:
        """Shrink a layer to its protected tokens plus the method's per-head split (:meth:`Method.head_budgets`,
        uniform by default) of ``selectable * Hkv`` selectable tokens, for compressing sequences (top scores).

        ``final=False`` (an intermediate stage of the cascade) leaves the kept slots in score order (best first), so
        that the next stage, whose budgets are never larger (``docs/methods/cake.md#cascading-prefill``), drops a
        suffix of each row without sorting again (:meth:`_evict_ranked`); ``final=True`` re-packs them in position
        order. The kept sets are the same either way (the top-scored slots, ties to the earlier position)."""
        store = self.layers[layer_idx]
        ranked = self._ranked.pop(layer_idx, None)  # (counts, protected, finite) of a store left in score order
        if ranked is None:
            counts = store.counts()  # (B, H)
            protected = (store.valid & torch.isposinf(store.scores)).sum(-1)
        else:
            counts, protected, _ = ranked
        dev = counts.device
        finite = None
        if self._uniform_head_split():  # Method.head_budgets' own rule, with the candidate count kept for later
            finite = torch.isfinite(store.scores).sum(-1)
            per_head = torch.minimum(selectable.to(dev).view(-1, 1), finite)
        else:
            per_head = self.method.head_budgets(
                store.scores, selectable.to(dev), budget=self.info.budget.to(dev), final=final
            )
        keep = self._keep_counts(layer_idx, per_head, counts, protected)
        host = torch.stack([keep.reshape(-1), counts.reshape(-1)]).tolist()  # one read-back for the host decisions
        if all(k >= c for k, c in zip(*host)) and (ranked is None or not final):  # nothing to drop, layout unchanged
            if ranked is not None:
                self._ranked[layer_idx] = ranked
            return
        order = None if ranked is not None else torch.sort(store.scores, dim=-1, descending=True, stable=True).indices
        if finite is not None and not final and bool(torch.isnan(store.scores).any()):
            finite = None  # NaN sorts first: the suffix rule below would not hold; re-evict with head_budgets
        store.keep(order, keep, positional=final, host=(host[0], host[1]))
        if not final:
            self._ranked[layer_idx] = (
                keep,
                protected,
                None if finite is None else torch.minimum(finite, keep - protected),
            )

    def _evict_ranked(self, layers: list[int], stage: torch.Tensor, final: bool) -> None:
        """:meth:`_evict_to` for layers left in score order by an earlier stage, with the uniform head split: their
        keep counts are computed at once, then each drops the suffix of its rows (folded into the linear state).

        In score order the protected slots (``+inf``) come first, then the finite candidates, then empty or ``-inf``
        ones, so after keeping ``keep`` slots a row has ``min(finite, keep - protected)`` finite candidates left: the
        next stage's split needs no pass over the scores. ``stage``: ``(B, >= max(layers) + 1)`` selectable budgets.
        """
        states = [self._ranked.pop(i) for i in layers]
        counts, protected, finite = (torch.stack([st[j] for st in states]) for j in range(3))  # (n, B, H)
        dev = counts.device
        per_head = torch.minimum(stage[:, layers].to(dev).T[:, :, None], finite)
        keep = self._keep_counts(None, per_head, counts, protected)
        targets = torch.where(self.info.compress.to(dev).view(1, -1, 1), keep, -1).unbind(0)
        remaining = torch.minimum(finite, keep - protected).unbind(0)
        host = torch.stack([keep, counts]).view(2, len(layers), -1).tolist()
        for i, layer in enumerate(layers):
            self.targets[layer] = targets[i]
            kl, cl = host[0][i], host[1][i]
            if not final and all(k >= c for k, c in zip(kl, cl)):
                self._ranked[layer] = states[i]
                continue
            self.layers[layer].keep(None, keep[i], positional=final, host=(kl, cl))
            if not final:
                self._ranked[layer] = (keep[i], protected[i], remaining[i])

    def _keep_counts(
        self, layer_idx: int | None, per_head: torch.Tensor, counts: torch.Tensor, protected: torch.Tensor
    ) -> torch.Tensor:
        """Slots kept per row from a head split: protected + split (clamped to the candidates) where the sequence is
        compressed, everything elsewhere; also records the layer's decode targets (``layer_idx`` None: the caller
        does)."""
        dev = counts.device
        per_head = torch.minimum(per_head.to(dev, torch.int64).clamp_min(0), counts - protected)
        compress = self.info.compress.to(dev).view(*([1] * (counts.ndim - 2)), -1, 1)
        keep = torch.where(compress, torch.minimum(per_head + protected, counts), counts)
        if layer_idx is not None:
            self.targets[layer_idx] = torch.where(compress, keep, -1)
        return keep

    def _uniform_head_split(self) -> bool:
        """True when the method splits a layer's budget evenly over its KV heads (:meth:`Method.head_budgets` not
        overridden), so the compressor may apply that rule itself."""
        return type(self.method).head_budgets is Method.head_budgets

    # ================================================================== decode
    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> LayerStore:
        """Write new tokens of layer ``layer_idx`` into its store; returns the store.

        A single new token (a decode step) goes into the row's first free slot without reading anything back from
        the device: whether the layer has a free slot is known on the host (:attr:`_free`, set once after prefill:
        a layer that evicts one token per step keeps its free slots, an append-only one uses one per step), and in
        static mode (:meth:`prepare_static`) the room was preallocated. Several tokens at once (a prompt chunk, a
        continuation) take the dynamic path.
        """
        store = self.layers[layer_idx]
        if store is None:
            raise RuntimeError(f"layer {layer_idx} received decode tokens before its prefill")
        n_new = keys.shape[2]
        counter = self.position[layer_idx]
        if n_new == 1 and not self.chunked_prefill:
            if not self.static:
                free = self._free[layer_idx]
                if free is None:
                    free = self._free[layer_idx] = store.min_free()  # once per layer after prefill
                if free < 1:
                    growth = 1 if self._evicts(layer_idx) else _GROWTH
                    store._grow(growth)
                    free += growth
                self._free[layer_idx] = free if self._evicts(layer_idx) else free - 1
                self.seen[layer_idx] += 1
            store.append_one(keys, values, counter.view(1))
            counter.add_(1)
            return store
        if self.static:
            raise RuntimeError(
                "a static-mode cache decodes one token per step; a multi-token append needs the "
                "dynamic cache (build the SlakeCache without max_cache_len)"
            )
        start = self.seen[layer_idx]
        pos = torch.arange(start, start + n_new, device=keys.device)
        evicting = self._evicts(layer_idx)
        store.append(keys, values, pos, growth=1 if evicting else _GROWTH)
        self.seen[layer_idx] = start + n_new
        counter.add_(n_new)
        self._free[layer_idx] = None
        return store

    def _evicts(self, layer_idx: int) -> bool:
        """True when every row of the layer evicts one token per decode step (its size then stays fixed)."""
        info = self.info
        return (
            self.targets[layer_idx] is not None
            and self.method.decode_eviction
            and info is not None
            and not self.method.keeps_everything
            and info.compress_all
        )

    def position_of(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s next position, a 0-dim int64 device tensor (the layer must be prefilled)."""
        counter = self.position[layer_idx]
        if counter is None:
            raise RuntimeError(f"layer {layer_idx} has not been prefilled")
        return counter

    def seen_tokens(self, layer_idx: int) -> int:
        """Tokens layer ``layer_idx`` has seen (its next position); in static mode a read of the device counter."""
        if self.static and self.position[layer_idx] is not None:
            return int(self.position[layer_idx])
        return self.seen[layer_idx]

    def prepare_static(self, decode_tokens: int) -> None:
        """Enter static (fixed-shape) decode mode after the prefill: every later step has the same shapes.

        A layer that evicts one token per step gets one free slot per row; an append-only layer (the full cache, a
        prompt within its budget, ``decode_eviction=False``) gets ``decode_tokens`` free slots, allocated now. From
        then on a decode step reads nothing back from the device and changes no host state, so it can be compiled
        as one graph (``docs/compile.md``); more than ``decode_tokens`` steps on an append-only layer are not
        supported (its last free slot would be overwritten), as with transformers' ``StaticCache``.
        """
        if self.chunked_prefill:
            raise RuntimeError("prepare_static is called after the chunked prefill ended")
        if decode_tokens < 1:
            raise ValueError(f"max_cache_len leaves no room to decode: the prompt has {self.seen[0]} tokens")
        if any(s is None for s in self.layers):
            raise RuntimeError("prepare_static needs every layer prefilled")
        for i, store in enumerate(self.layers):
            store.reserve(1 if self._evicts(i) else max(int(decode_tokens), 1))
            self._free[i] = None
            self.position[i] = torch.tensor(self.seen[i], dtype=torch.int64, device=store.keys.device)
            if store.linear is not None:
                store.linear.attention_parts()  # made now: a lazily cached view would change the first step's guards
        for name in ("real_len", "first_real", "budget"):
            self.info.device_copy(name, self.layers[0].keys.device)
        self.static = True
        if not torch.compiler.is_compiling():
            for t in self.static_tensors():
                if t.is_cuda:  # fixed addresses: a CUDA graph replays over them without copying the cache
                    torch._dynamo.mark_static_address(t)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a static decode step reads or updates in place (``torch._dynamo.mark_static_address``)."""
        out: list[torch.Tensor] = [t for t in self.position if t is not None]
        for s in self.layers:
            if s is None:
                continue
            out += [getattr(s, n) for n in s._slot_tensors() + ("positions", "valid", "scores")]
            if s.head_visible is not None:
                out.append(s.head_visible)
            if s.linear is not None:
                out.append(s.linear.aug)
        out += [t for t in self.targets if t is not None]
        if self.info is not None:
            out += list(self.info.on_device.values())
        return out

    def decode_attention(self, layer_idx: int, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the newest ``n_q`` queries over the compressed layer, with decode-time eviction.

        Returns ``(B, Hq, n_q, d)`` float32. Order of operations (``docs/methods/cake.md#decode-rule``,
        ``docs/methods/slake.md#decode-step``, ``docs/methods/README.md#decode-eviction``): logits once; if the layer is
        over its budget, score with the exact softmax, pick the lowest-scored unprotected slot(s); evict before the
        output (SLAKE, Algorithm 1) or after it (CAKE reference code, H2O, TOVA).

        During a chunked prefill (:meth:`begin_chunked_prefill`) the queries are a prompt chunk: the output is the
        chunk's attention over the compressed past (plus the linear term) and the chunk itself, causal by position,
        and the layer is then evicted back to its budget by :meth:`_chunk_evict`.

        Fast paths (same results up to float rounding): a layer that needs no scores and has no linear state or
        per-head visibility (the full cache, or a prompt that fit in the budget) is one SDPA call over the store;
        for one query the causal test is skipped (every stored token precedes the newest one); with eviction after
        the output and no linear state, the output reuses the softmax computed for scoring.
        """
        store = self.layers[layer_idx]
        B, Hq, nq, d = queries.shape
        target = self.targets[layer_idx]
        chunk = self.chunked_prefill
        scored = target is not None and self.method.decode_eviction and not self.method.keeps_everything
        if nq == 1 and not chunk:
            return self._decode_one(layer_idx, queries, scaling, scored)
        newest = self.seen[layer_idx] - 1
        qpos = None if nq == 1 else torch.arange(newest - nq + 1, newest + 1, device=queries.device)
        if chunk:
            # query blocks bound the transient logits to _CHUNK_QUERY_BLOCK x n, whatever the chunk size
            outs = []
            for b0 in range(0, nq, _CHUNK_QUERY_BLOCK):
                b1 = min(b0 + _CHUNK_QUERY_BLOCK, nq)
                qf, x = layer_logits(store, queries[:, :, b0:b1], qpos[b0:b1] if qpos is not None else None, scaling)
                out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
                outs.append(out.reshape(B, Hq, b1 - b0, d))
            if target is not None and not self.method.keeps_everything:
                w = max(min(self.method.window, nq), 1)
                qw, x = layer_logits(
                    store, queries[:, :, nq - w :], qpos[nq - w :] if qpos is not None else None, scaling
                )
                self._chunk_evict(layer_idx, x, newest, qw)
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        qf, x = layer_logits(store, queries, qpos, scaling)
        if not scored:
            out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
            return out.reshape(B, Hq, nq, d)
        probs = safe_softmax(x)  # (B, H, g, nq, n)
        evict = self._decode_evict(layer_idx, probs, target, newest, qf)
        if evict is None:
            if store.linear is None:
                return probs_values(probs, store.dense_values()).reshape(B, Hq, nq, d)
            out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
            return out.reshape(B, Hq, nq, d)
        slots, chosen, mask = evict
        return self._output_and_evict(store, qf, x, probs, slots, chosen, mask).reshape(B, Hq, nq, d)

    def _output_and_evict(self, store, qf, x, probs, slots, chosen, mask) -> torch.Tensor:
        """The step's attention output and its eviction, in the method's order: SLAKE evicts (and folds) first and
        attends without the evicted slot (``docs/methods/slake.md#decode-step``); the others attend, then evict."""
        if self.method.evict_before_output:
            store.free(mask, slots, chosen)
            x.masked_fill_(mask[:, :, None, None, :], float("-inf"))  # x is this step's own tensor
            return attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
        if store.linear is None:
            out = probs_values(probs, store.dense_values())
        else:
            out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
        store.free(mask, slots, chosen)
        return out

    def _decode_one(self, layer_idx: int, queries: torch.Tensor, scaling: float, scored: bool) -> torch.Tensor:
        """One decode step of one layer (one query per sequence): fixed shapes, no read-back to the host.

        Every choice here is made from host facts fixed at prefill (the method, whether the layer has a budget, a
        linear state, per-head visibility); per-sequence and per-head differences (a row within its budget, a
        head that is not over it) live in the ``targets`` tensor and the masks. The layer holds at most one token
        over its target (one is appended per step and one evicted), so eviction is one ``argmin`` per row, applied
        through a mask that is empty where the row is not over its target (``docs/compile.md``).
        """
        store = self.layers[layer_idx]
        m = self.method
        B, Hq, nq, d = queries.shape
        if not scored and store.linear is None and not m.linear_cache and store.head_visible is None:
            return _sdpa_decode(store, queries, scaling)
        qf, x = layer_logits(store, queries, None, scaling)
        if not scored:
            out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
            return out.reshape(B, Hq, nq, d)
        probs = safe_softmax(x)  # (B, H, g, 1, n)
        slots, chosen, mask = self._evict_one(layer_idx, probs, self.targets[layer_idx], qf)
        return self._output_and_evict(store, qf, x, probs, slots, chosen, mask).reshape(B, Hq, nq, d)

    def _evict_one(
        self, layer_idx: int, probs: torch.Tensor, target: torch.Tensor, queries: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score the slots with the method's decode rule and choose at most one slot per row to evict.

        Returns ``(slots, chosen, mask)``: ``(B, Hkv, 1)`` the lowest-scored unprotected slot, ``(B, Hkv, 1)`` bool
        (True where the row is over its target, so the slot is really evicted) and the dense ``(B, Hkv, n)`` mask.
        Equals :meth:`_decode_evict` when no row is more than one token over its target, which holds at every
        single-token step (prefill leaves each row at its target; each step adds one token and evicts one).
        """
        store = self.layers[layer_idx]
        B, H, g, nq, n = probs.shape
        info = self.info
        dev = probs.device
        # in place, so that the store's tensors keep their addresses from step to step (CUDA graphs)
        store.scores.copy_(
            self.method.decode_scores(
                DecodeInputs(
                    probs=probs.reshape(B, H * g, nq, n),
                    positions=store.positions,
                    valid=store.valid,
                    stored=store.scores,
                    prompt_len=info.device_copy("real_len", dev),
                    budget=info.device_copy("budget", dev),
                    **self._decode_extras(layer_idx, store, queries),
                )
            )
        )
        over = (store.counts() > target) & (target >= 0)  # (B, H)
        newest = self.position_of(layer_idx) - 1
        # protected (window, sinks) and empty slots are never chosen while an evictable slot remains
        scores = store.scores.masked_fill(
            self._protected_mask(store.positions, store.valid, newest) | ~store.valid, float("inf")
        )
        lowest = scores.argmin(-1, keepdim=True)  # the first minimum, like a stable ascending sort
        chosen = over[..., None] & store.valid.gather(-1, lowest)
        mask = torch.zeros_like(store.valid).scatter_(-1, lowest, chosen)
        return lowest, chosen, mask

    def attention(self, layer_idx: int, queries: torch.Tensor, positions: torch.Tensor, scaling: float) -> torch.Tensor:
        """Read-only attention of queries at ``positions`` over the layer as it is now (no eviction).

        Kept entries at or before each query's position are visible; the linear term (if any) is included. Used by
        ``slake fidelity`` to compare against full attention. Returns ``(B, Hq, n_q, d)`` float32.
        """
        store = self.layers[layer_idx]
        B, Hq, nq, d = queries.shape
        qf, x = layer_logits(store, queries, positions, scaling)
        out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
        return out.reshape(B, Hq, nq, d)

    def _decode_evict(
        self,
        layer_idx: int,
        probs: torch.Tensor,
        target: torch.Tensor,
        newest: int,
        queries: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Score the slots with the method's decode rule and choose the slots to evict.

        Returns None when no row is over its target, else ``(slots, chosen, mask)``: ``(B, Hkv, e)`` slot indices,
        ``(B, Hkv, e)`` bool (which of them are really evicted) and the dense ``(B, Hkv, n)`` bool mask.
        """
        store = self.layers[layer_idx]
        B, H, g, nq, n = probs.shape
        info = self.info
        store.scores = self.method.decode_scores(
            DecodeInputs(
                probs=probs.reshape(B, H * g, nq, n),
                positions=store.positions,
                valid=store.valid,
                stored=store.scores,
                prompt_len=info.device_copy("real_len", probs.device),
                budget=info.device_copy("budget", probs.device),
                **self._decode_extras(layer_idx, store, queries),
            )
        ).float()
        counts = store.counts()
        excess = torch.where(target >= 0, counts - target, torch.zeros_like(counts)).clamp_min(0)
        emax = int(excess.max())  # one host sync per layer and step (free on CPU)
        if emax == 0:
            return None
        # protected (window, sinks) and empty slots are never chosen while an evictable slot remains
        scores = store.scores.masked_fill(
            self._protected_mask(store.positions, store.valid, newest) | ~store.valid, float("inf")
        )
        if emax == 1:  # the usual decode step: argmin returns the first minimum, like a stable ascending sort
            lowest = scores.argmin(-1, keepdim=True)
        else:
            lowest = torch.sort(scores, dim=-1, stable=True).indices[..., :emax]
        chosen = (torch.arange(emax, device=probs.device) < excess[..., None]) & store.valid.gather(-1, lowest)
        mask = torch.zeros_like(store.valid).scatter_(-1, lowest, chosen)
        return lowest, chosen, mask

    # ================================================================== chunked prefill
    def begin_chunked_prefill(self, key_padding: torch.Tensor) -> None:
        """Start a chunked prefill of a prompt whose full ``(B, S)`` padding mask (True = padded) is known.

        The budget, the compress decision and the real lengths are those of the whole prompt. The first chunk goes
        through :meth:`prefill_layer` (exact attention inside the chunk, method scores, layer budgets / cascade
        from the chunk); every later chunk is appended, attends over the compressed past plus itself
        (:meth:`decode_attention`) and each layer is evicted back to its budget (:meth:`_chunk_evict`).
        """
        if self.info is not None or any(s is not None for s in self.layers):
            raise RuntimeError("begin_chunked_prefill must be called before the first prefill chunk")
        self._chunk_padding = key_padding.bool()
        self.chunked_prefill = True

    def end_chunked_prefill(self) -> None:
        """Leave chunked-prefill mode; later appends are decode steps with decode-time eviction."""
        self.chunked_prefill = False
        if self.max_cache_len is not None and all(s is not None for s in self.layers):
            self.prepare_static(self.max_cache_len - self.seen[0])

    def _chunk_evict(self, layer_idx: int, x: torch.Tensor, newest: int, queries: torch.Tensor | None = None) -> None:
        """Evict a layer back to its budget after a prompt chunk; ``x``: logits of the chunk's last queries.

        The method's decode rule scores the slots from the softmax of the chunk's last ``window`` queries (its
        observation window; all of them when the chunk is shorter); protected tokens are the last ``window``
        positions and the sinks; the layer's per-head budgets come from :meth:`Method.head_budgets` as at prefill.
        """
        store = self.layers[layer_idx]
        info = self.info
        B, H, g, w, n = x.shape  # logits of the chunk's last ``w`` queries
        probs = safe_softmax(x)
        store.scores = self.method.decode_scores(
            DecodeInputs(
                probs=probs.reshape(B, H * g, w, n),
                positions=store.positions,
                valid=store.valid,
                stored=store.scores,
                prompt_len=info.real_len.to(x.device),
                budget=info.budget.to(x.device),
                **self._decode_extras(layer_idx, store, queries),
            )
        ).float()
        store.scores = self._protect(store.scores, store.positions, store.valid, newest)
        self._evict_to(layer_idx, info.layer_budgets[:, layer_idx])

    # ================================================================== reporting
    def kept_tokens_per_layer(self) -> list[float]:
        """Mean kept tokens per KV head and sequence, per layer."""
        return [float(s.counts().float().mean()) if s is not None else 0.0 for s in self.layers]

    def byte_counts(self, sequence: int | None = None) -> dict[str, int]:
        """Bytes of the whole cache: kept entries, per-head padding, growth slack, metadata, linear state.

        ``padding`` is the dense layout's cost of uneven heads: the slots between each head's kept tokens and the
        longest head's. ``slack`` is allocated room beyond the longest head (free slots kept for the next decode
        tokens, so that decoding does not reallocate). ``linear_state`` is 0 when nothing was evicted (it is then
        not allocated). ``sequence``: one batch row's bytes, as a batch-1 run of it would hold them (see
        :meth:`LayerStore.byte_counts`; no slack).
        """
        total = {"kept": 0, "padding": 0, "slack": 0, "metadata": 0, "linear_state": 0}
        for s in self.layers:
            if s is None:
                continue
            counts = s.byte_counts(sequence)
            if sequence is None:  # split LayerStore's padding into per-head padding and growth slack
                B, H, n = s.valid.shape
                slots = B * H * n
                slack_slots = B * H * (n - int(s.counts().max()))
                kv = counts["kept"] + counts["padding"]  # every slot costs the same
                counts["slack"] = kv * slack_slots // slots if slots else 0
                counts["padding"] -= counts["slack"]
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / select sequences (beam search)."""
        for s in self.layers:
            if s is not None:
                s.select_batch(index)
        self._map_batch(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times."""
        for s in self.layers:
            if s is not None:
                s.repeat_batch(repeats)
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_batch(self, fn) -> None:
        self.targets = [fn(t) if t is not None else None for t in self.targets]
        if self.info is not None:
            i = self.info
            i.real_len, i.first_real, i.budget, i.compress = (
                fn(i.real_len),
                fn(i.first_real),
                fn(i.budget),
                fn(i.compress),
            )
            if i.layer_budgets is not None:
                i.layer_budgets = fn(i.layer_budgets)
            i.compress_any, i.compress_all = bool(i.compress.any()), bool(i.compress.all())
            i.on_device.clear()
        self._free = [None] * self.num_layers


def layer_logits(
    store: LayerStore, queries: torch.Tensor, positions: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled queries ``scaling * q`` in group layout ``(B, Hkv, g, n_q, d)`` fp32 and their logits over the store's
    slots (pass the queries to :func:`~slake.attention.ptaa.attend` with ``scaling=1.0``).

    Logits are ``(scaling * q) . k`` in fp32, ``-inf`` for empty slots and for keys after the query's position.
    ``positions=None`` means one query at the newest position, which sees every stored token (no causal test).
    The ``g * n_q`` query rows of a KV head share one matmul against its keys (no per-query-head expansion or
    copy of the cache); an fp32 cache is used as is, a low-precision one through :func:`matmul_f32`.
    """
    B, Hq, nq, d = queries.shape
    H = store.keys.shape[1]
    g = Hq // H
    qf = (queries.float() * scaling).reshape(B, H, g, nq, d)
    x = matmul_f32(qf.reshape(B, H, g * nq, d), store.dense_keys().transpose(-1, -2))  # (B, H, g*nq, n)
    x = x.view(B, H, g, nq, -1)
    if positions is None:
        visible = store.valid[:, :, None, None, :]
    else:
        visible = store.valid[:, :, None, None, :] & (
            store.positions[:, :, None, None, :] <= positions.view(1, 1, 1, nq, 1)
        )
    if store.head_visible is not None:  # per-query-head visibility (SAGE-KV)
        visible = visible & store.head_visible[:, :, :, None, :]
    return qf, x.masked_fill_(~visible, float("-inf"))


def _sdpa_decode(store: LayerStore, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """One new query per sequence over every valid slot: one SDPA call, no score, no copy of the cache.

    The ``g`` query heads of a KV head are the ``g`` query rows of one SDPA head, so nothing is expanded per query
    head. Returns ``(B, Hq, 1, d)`` float32.
    """
    B, Hq, _, d = queries.shape
    H = store.keys.shape[1]
    keys, values = store.dense_keys(), store.dense_values()
    q = queries.reshape(B, H, Hq // H, d).to(keys.dtype)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=store.valid[:, :, None, :], scale=scaling)
    return out.reshape(B, Hq, 1, d).float()


def linear_state_slots(head_dim: int, itemsize: int | float) -> int:
    """Token slots (K+V at ``itemsize`` bytes per number; fractional with 8-bit codes plus scales) that one fp32
    linear state ``(d^2 + 2d)`` occupies, rounded up."""
    state_bytes = (head_dim * head_dim + 2 * head_dim) * 4
    return int(math.ceil(state_bytes / (2 * head_dim * itemsize) - 1e-9))
