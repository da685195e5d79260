"""Prefill compression: per-layer scores, layer budgets (uniform, pyramid or CAKE's cascade of preferences), the
per-head split and the eviction of each layer right after its exact attention.

Conventions (``docs/conventions.md``; ``docs/methods/README.md#observation-window-attention``):

* Positions index the (left-padded) input sequence.
* Every layer keeps its ``protected`` tokens (sinks + observation window). The rest of the per-layer budget is the
  *selectable* budget; the total selectable budget is ``L * (C - protected)``.
* A sequence whose real prompt length is ``<= C`` is not compressed at all (no eviction at prefill or decode), so its
  results equal the full cache.
* Budgets and evictions are per sequence; padding is never kept.

Cascading (``docs/methods/cake.md#cascading-prefill``): a layer-preference method (CAKE, SLAKE, LAVa) re-splits the
total budget over layers ``0..l`` when layer ``l`` reports its preference, and re-evicts the earlier layers to their
new (never larger) budgets, so the cache holds at most the budget plus one layer; the kept sets equal one-shot
eviction with the final budgets.
"""

from __future__ import annotations

import math

import torch

from slake.attention.linear_state import LinearState
from slake.budgets import allocation as budget_rules
from slake.cache.decode_step import protected_slots
from slake.cache.layer_store import LayerStore
from slake.cache.quant import scale_bytes_per_row
from slake.cache.state import CacheState, PrefillInfo
from slake.methods.base import Method, PrefillInputs, PrefillScores

__all__ = ["PrefillCompressor", "check_left_padding", "check_prefill_inputs", "linear_state_slots"]


class PrefillCompressor:
    """The prefill phase of a :class:`~slake.cache.compressed.CompressedKV`: compress each layer after its exact
    attention (and, for layer-preference methods, re-evict earlier layers in the cascade).

    Parameters
    ----------
    state : CacheState
        The cache's shared state (layers, targets, prefill facts).
    charge_linear_state : bool
        Charge the PTAA linear state against the budget (each layer's budget shrinks by
        :func:`linear_state_slots` token slots).
    defer_cascade : bool
        Evict each layer at its own cascade stage and at the final one only (the same kept sets; see
        :class:`~slake.cache.compressed.CompressedKV`).
    """

    def __init__(self, state: CacheState, charge_linear_state: bool = False, defer_cascade: bool = False) -> None:
        self.state = state
        self.charge_linear_state = charge_linear_state
        self.defer_cascade = defer_cascade
        #: prefill scores kept until the final stage (``carry_protected_scores``)
        self._raw_scores: dict[int, torch.Tensor] = {}
        #: layers left in score order by an intermediate cascade stage (:meth:`evict_to`), until the final stage
        #: re-packs them in position order: their valid, protected and (uniform head split) finite-score counts per row
        self._ranked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        #: prompt tokens that follow the prefilled part as decode steps (``slake.generate`` feeds a prompt's last
        #: token after a chunked or second-pass prefill of the rest): they count in the budget and the compress
        #: decision, as in an exact prefill of the whole prompt; consumed by the next prefill (:meth:`_start`)
        self.trailing_tokens = 0
        #: optional layer -> PrefillScores memo shared by replays of one recorded prefill with the same method
        #: configuration (see :meth:`slake.engines.transformers.prefill_once.PrefillCapture.replay`); used only when
        #: the method's scores do not depend on the budget
        self.score_memo: dict[int, PrefillScores] | None = None

    def _scores(self, layer_idx: int, chunked: bool, inputs: PrefillInputs) -> PrefillScores:
        """The method's prefill scores, from :attr:`score_memo` when it may be reused (budget-independent scores,
        whole-prompt prefill). Memo entries are cloned on the way out: the compressor edits scores in place."""
        memo = self.score_memo
        if memo is None or self.state.method.prefill_scores_use_budget or chunked:
            return self.state.method.prefill_scores(inputs)
        if layer_idx not in memo:
            memo[layer_idx] = self.state.method.prefill_scores(inputs)
        hit = memo[layer_idx]
        return PrefillScores(
            scores=hit.scores.clone(),
            preference=None if hit.preference is None else hit.preference.clone(),
            head_visible=None if hit.head_visible is None else hit.head_visible.clone(),
        )

    def _start(self, key_padding: torch.Tensor, head_dim: int, itemsize: int | float) -> PrefillInfo:
        check_left_padding(key_padding)  # first_real below is where a row's left padding ends
        B, S = key_padding.shape
        real = (~key_padding).sum(-1).to(torch.int64)
        whole = real.cpu() + self.trailing_tokens  # the whole prompt's lengths
        self.trailing_tokens = 0
        budget = torch.tensor([self.state.budget.tokens(int(r)) for r in whole.tolist()], dtype=torch.int64)
        charged = ""
        if self.charge_linear_state and self.state.method.linear_cache:
            slots = linear_state_slots(head_dim, itemsize)
            budget = budget - slots
            charged = f" (the budget less the {slots} slots of the linear state, charged by charge_linear_state)"
        compress = whole > budget
        if self.state.method.keeps_everything:
            compress[:] = False
        if bool(compress.any()) and int(budget[compress].max()) > self._layer_cap():
            raise ValueError(
                f"{self.state.method.name}: max_layer_budget={self._layer_cap()} is below the average budget "
                f"{int(budget[compress].max())}; the layers could not hold the total budget"
            )
        least = max(1, self.state.method.protected)  # a row keeps its window and sinks, and at least one token
        if bool(compress.any()) and int(budget[compress].min()) < least:
            raise ValueError(
                f"{self.state.method.name}: a budget of {int(budget[compress].min())} tokens{charged} is smaller "
                f"than {least} (the protected window + sinks, {self.state.method.protected}, and at least one "
                f"token); use a larger budget or a smaller window"
            )
        return PrefillInfo(
            prompt_len=S,
            real_len=real.cpu(),
            first_real=(S - real).cpu(),
            budget=budget,
            compress=compress,
            preferences=[None] * self.state.num_layers,
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
        chunk_padding: torch.Tensor | None = None,
    ) -> None:
        """Store layer ``layer_idx``'s prompt keys/values and compress them (called after its exact attention).

        ``chunk_padding``: during a chunked prefill (:mod:`slake.cache.chunked`), the ``(B, S)`` padding of the whole
        prompt, of which these are the first chunk's entries; its budget, compress decision and real lengths are the
        whole prompt's.

        Raises
        ------
        RuntimeError
            For a layer prefilled already (a cache holds one prompt; a later chunk is appended), or a first chunk
            longer than the prompt given to ``begin_chunked_prefill``.
        ValueError
            For inputs whose shapes disagree or a padding mask that is not bool (:func:`check_prefill_inputs`), and
            budgets the method cannot keep (:meth:`_start`)."""
        chunked = chunk_padding is not None
        if self.state.layers[layer_idx] is not None:  # before anything changes (the facts below are the prompt's)
            raise RuntimeError(
                f"layer {layer_idx} is prefilled already: a compressed cache holds one prompt (a later prompt chunk "
                f"is appended, not prefilled); build a new cache for another prompt"
            )
        check_prefill_inputs(queries, keys, values, key_padding)
        B, H, S, d = keys.shape
        if chunk_padding is not None and S > chunk_padding.shape[-1]:
            raise RuntimeError(
                f"a prefill chunk reaches position {S}, past the {chunk_padding.shape[-1]}-token prompt given to "
                f"begin_chunked_prefill"
            )
        dev = keys.device
        if key_padding is None:
            key_padding = torch.zeros(B, S, dtype=torch.bool, device=dev)
        if self.state.info is None:
            # bytes per stored number: the model dtype's, or 8-bit codes plus the per-row scale (spread over d)
            itemsize = keys.element_size() if self.state.kv_dtype is None else (d + scale_bytes_per_row()) / d
            full = key_padding if chunk_padding is None else chunk_padding.to(dev)
            self.state.info = self._start(full, d, itemsize)
        info = self.state.info
        if info.prompt_len != S and not chunked:
            raise RuntimeError(f"layer {layer_idx} prefilled with {S} tokens, layer 0 with {info.prompt_len}")
        if info.compress_any:  # before the layer's state changes
            self.state.check_engine_inputs(layer_idx)
        self.state.seen[layer_idx] = S
        self.state.position[layer_idx] = torch.tensor(S, dtype=torch.int64, device=dev)
        positions = torch.arange(S, device=dev).view(1, 1, S).expand(B, H, S).contiguous()
        valid = (~key_padding)[:, None, :].expand(B, H, S).contiguous()
        scores = torch.zeros(B, H, S, dtype=torch.float32, device=dev)
        # the linear state exists only when something will be evicted (an uncompressed cache never folds a token);
        # a cache without it takes the same attention path as with an empty one (see decode_attention)
        linear = LinearState.empty(B, H, d, dev) if self.state.method.linear_cache and info.compress_any else None
        store = LayerStore(keys, values, positions, valid, scores, linear, kv_dtype=self.state.kv_dtype)
        self.state.layers[layer_idx] = store
        if not info.compress_any:
            self.state.targets[layer_idx] = None
            return
        result = self._scores(
            layer_idx,
            chunked,
            PrefillInputs(
                queries=queries,
                keys=keys,
                values=values,
                key_padding=key_padding,
                scaling=scaling,
                window=self.state.method.window,
                layer_idx=layer_idx,
                num_layers=self.state.num_layers,
                budget=info.budget.to(dev),
                layer=self.state.layer_context[layer_idx],
                pass_scores=self.state.pass_scores,
                prompt_len=info.device_copy("real_len", dev),  # the whole prompt's, in a chunked prefill too
            ),
        )
        store.scores = self.protect(result.scores.float(), positions, valid, newest=S - 1)
        if result.head_visible is not None:  # uncompressed sequences keep everything visible to every head
            store.head_visible = result.head_visible.bool() | ~info.compress.to(dev).view(B, 1, 1, 1)
        if self.state.method.carry_protected_scores:
            self._raw_scores[layer_idx] = result.scores.float()
        info.preferences[layer_idx] = result.preference
        policy = self.state.method.layer_budgets
        if policy == "preference":
            last = layer_idx == self.state.num_layers - 1
            stage = self._preference_stage(layer_idx, final=last)
            if self.defer_cascade and not last and not chunked:  # the new layer's own stage only
                self.evict_to(layer_idx, stage[:, layer_idx], final=False)
                return
            batched = [i for i in range(layer_idx) if i in self._ranked and self._ranked[i][2] is not None]
            if batched:  # earlier layers left in score order, with the uniform head split: their keep counts at once
                self._evict_ranked(batched, stage, final=last)
            for layer in range(layer_idx + 1):
                if layer not in batched:
                    self.evict_to(layer, stage[:, layer], final=last)
            if last:
                info.layer_budgets = stage
                for layer in range(self.state.num_layers):
                    self._carry_protected(layer)
        else:
            sel = self._static_budgets(policy)
            self.evict_to(layer_idx, sel[:, layer_idx])
            self._carry_protected(layer_idx)
            if info.layer_budgets is None:
                info.layer_budgets = sel

    def _selectable_total(self) -> torch.Tensor:
        """(B,) average selectable budget C - protected."""
        return (self.state.prefill_info().budget - self.state.method.protected).clamp_min(0)

    def _static_budgets(self, policy: str) -> torch.Tensor:
        info = self.state.prefill_info()
        rows = []
        for b in range(len(info.real_len)):
            sel = int(self._selectable_total()[b])
            if policy == "pyramid":
                rows.append(self.state.method.pyramid_schedule(self.state.num_layers, sel, int(info.real_len[b])))
            else:
                rows.append(budget_rules.uniform_budgets(self.state.num_layers, sel))
        return torch.stack([r.to(torch.int64) for r in rows])

    def _preference_stage(self, m: int, final: bool) -> torch.Tensor:
        """(B, m+1) selectable budgets of layers 0..m at cascade stage m.

        See ``docs/methods/cake.md#cascading-prefill``.
        """
        info = self.state.prefill_info()
        rows = []
        prefs_l = [p for p in info.preferences[: m + 1] if p is not None]
        if len(prefs_l) != m + 1:
            raise RuntimeError(f"{self.state.method.name} reported no layer preference for a layer below {m + 1}")
        if len({p.device for p in prefs_l}) > 1:  # layers spread over devices (a model split over GPUs)
            prefs_l = [p.cpu() for p in prefs_l]
        # (B, m + 1) in float64 (CAKE's powers are; a float32 copy would underflow them), one copy to the host per stage
        every = torch.stack([p.double() for p in prefs_l], -1).cpu()
        if not bool(torch.isfinite(every).all()):
            m_ = self.state.method
            exponents = {f: getattr(m_, f) for f in ("alpha", "beta", "tau1", "tau2") if hasattr(m_, f)}
            raise ValueError(
                f"{m_.name}: a layer's preference overflowed ({every[:, -1].tolist()} at layer {m}) with the "
                f"exponents {exponents}; give smaller exponents (the papers' and calibrated values are below 3)"
            )
        for b in range(len(info.real_len)):
            prefs = every[b]
            total = int(self._selectable_total()[b]) * self.state.num_layers
            cap = max(min(int(info.real_len[b]), self._layer_cap()) - self.state.method.protected, 0)
            rows.append(budget_rules.preference_budgets(prefs, total, cap, final=final))
        return torch.stack([r.to(torch.int64) for r in rows])

    def _layer_cap(self) -> int:
        """The method's ``max_layer_budget`` (tokens per layer, window included), or a bound no prompt reaches."""
        cap = getattr(self.state.method, "max_layer_budget", None)
        return int(cap) if cap is not None else 1 << 62

    def _carry_protected(self, layer_idx: int) -> None:
        """Replace the ``+inf`` of kept protected prompt slots by the method's own score (carry_protected_scores)."""
        raw = self._raw_scores.pop(layer_idx, None)
        store = self.state.layers[layer_idx]
        if raw is None or store is None:
            return
        carried = raw.to(store.scores.device).gather(-1, store.positions.clamp_min(0))  # prompt slot = position
        store.scores = torch.where(store.valid & torch.isposinf(store.scores), carried, store.scores)

    def protect(self, scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, newest: int) -> torch.Tensor:
        """+inf for the window (most recent tokens) and sinks, -inf for empty slots / padding. A method's score
        that overflowed to +inf is first brought back to float32's largest: +inf marks the protected slots, which the
        eviction keeps beyond the budget (an overflowed score kept every token of the layer)."""
        m = self.state.method
        first = self.state.prefill_info().device_copy("first_real", positions.device) if m.sinks else None
        scores = scores.clamp(max=torch.finfo(torch.float32).max)
        scores = scores.masked_fill(protected_slots(m, positions, valid, newest, first), float("inf"))
        return scores.masked_fill(~valid, float("-inf"))

    def evict_to(self, layer_idx: int, selectable: torch.Tensor, final: bool = True) -> None:
        """Shrink a layer to its protected tokens plus the method's per-head split (:meth:`Method.head_budgets`,
        uniform by default) of ``selectable * Hkv`` selectable tokens, for compressing sequences (top scores).

        ``final=False`` (an intermediate stage of the cascade) leaves the kept slots in score order (best first), so
        that the next stage, whose budgets are never larger (``docs/methods/cake.md#cascading-prefill``), drops a
        suffix of each row without sorting again (:meth:`_evict_ranked`); ``final=True`` re-packs them in position
        order. The kept sets are the same either way (the top-scored slots, ties to the earlier position)."""
        store = self.state.store(layer_idx)
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
            per_head = self.state.method.head_budgets(
                store.scores, selectable.to(dev), budget=self.state.prefill_info().budget.to(dev), final=final
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
        """:meth:`evict_to` for layers left in score order by an earlier stage, with the uniform head split: their
        keep counts are computed at once, then each drops the suffix of its rows (folded into the linear state).

        In score order the protected slots (``+inf``) come first, then the finite candidates, then empty or ``-inf``
        ones, so after keeping ``keep`` slots a row has ``min(finite, keep - protected)`` finite candidates left: the
        next stage's split needs no pass over the scores. ``stage``: ``(B, >= max(layers) + 1)`` selectable budgets.
        """
        states = [self._ranked.pop(i) for i in layers]
        finites = [st[2] for st in states if st[2] is not None]
        if len(finites) != len(states):
            raise RuntimeError("a layer without its candidate counts was left in score order")
        counts = torch.stack([st[0] for st in states])  # (n, B, H)
        protected = torch.stack([st[1] for st in states])
        finite = torch.stack(finites)
        dev = counts.device
        per_head = torch.minimum(stage[:, layers].to(dev).T[:, :, None], finite)
        keep = self._keep_counts(None, per_head, counts, protected)
        targets = torch.where(self.state.prefill_info().compress.to(dev).view(1, -1, 1), keep, -1).unbind(0)
        remaining = torch.minimum(finite, keep - protected).unbind(0)
        host = torch.stack([keep, counts]).view(2, len(layers), -1).tolist()
        for i, layer in enumerate(layers):
            self.state.targets[layer] = targets[i]
            kl, cl = host[0][i], host[1][i]
            if not final and all(k >= c for k, c in zip(kl, cl)):
                self._ranked[layer] = states[i]
                continue
            self.state.store(layer).keep(None, keep[i], positional=final, host=(kl, cl))
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
        compress = self.state.prefill_info().compress.to(dev).view(*([1] * (counts.ndim - 2)), -1, 1)
        keep = torch.where(compress, torch.minimum(per_head + protected, counts), counts)
        if layer_idx is not None:
            self.state.targets[layer_idx] = torch.where(compress, keep, -1)
        return keep

    def _uniform_head_split(self) -> bool:
        """True when the method splits a layer's budget evenly over its KV heads (:meth:`Method.head_budgets` not
        overridden), so the compressor may apply that rule itself."""
        return type(self.state.method).head_budgets is Method.head_budgets


def linear_state_slots(head_dim: int, itemsize: int | float) -> int:
    """Token slots (K+V at ``itemsize`` bytes per number; fractional with 8-bit codes plus scales) that one fp32
    linear state occupies, rounded up: ``(d + 1)^2`` float32 numbers (:class:`slake.attention.linear_state.
    LinearState`'s augmented matrix, ``L``, the two sums and the count), 16,900 bytes at ``d = 64``: 34 fp32 slots,
    67 bf16 ones."""
    state_bytes = (head_dim + 1) * (head_dim + 1) * 4
    return int(math.ceil(state_bytes / (2 * head_dim * itemsize) - 1e-9))


def check_prefill_inputs(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_padding: torch.Tensor | None
) -> None:
    """Refuse a layer's prefill inputs whose shapes disagree, or a padding mask that is not a ``(B, S)`` bool tensor.

    Parameters
    ----------
    queries : torch.Tensor
        ``(B, Hq, n, d)`` post-RoPE queries, ``Hq`` a multiple of ``Hkv`` (``n``: the prompt's ``S``, or fewer for a
        method that reads none, see below).
    keys, values : torch.Tensor
        ``(B, Hkv, S, d)`` each.
    key_padding : torch.Tensor | None
        ``(B, S)`` bool, True at padded positions (``attention_mask == 0``), or None for no padding. An integer mask
        is refused: read with ``~`` it gave negative real lengths, and it cannot tell an attention mask (1 = real)
        from a padding mask (1 = padded).

    Raises
    ------
    ValueError
        Naming the input and its shape or dtype.
    """
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(
            f"keys and values must both be (B, Hkv, S, d), got keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)}"
        )
    B, H, S, d = keys.shape
    # the queries' length is not checked: a method that reads no query (KVzip's second pass scores) may be given
    # the last one only (slake.engines.transformers.prefill_once, keep_queries=False)
    hq = queries.shape[1] if queries.dim() == 4 else 0
    if queries.dim() != 4 or (queries.shape[0], queries.shape[3]) != (B, d) or not hq or hq % H:
        raise ValueError(
            f"queries must be (B, Hq, n, d) with Hq a multiple of the {H} KV heads, matching keys "
            f"{tuple(keys.shape)}; got queries {tuple(queries.shape)}"
        )
    if key_padding is None:
        return
    if key_padding.dtype != torch.bool:
        raise ValueError(
            f"key_padding must be a bool mask, True at padded positions (attention_mask == 0), got dtype "
            f"{key_padding.dtype}"
        )
    if tuple(key_padding.shape) != (B, S):
        raise ValueError(f"key_padding must be (B, S) = {(B, S)} for these keys, got {tuple(key_padding.shape)}")


def check_real_tokens(key_padding: torch.Tensor) -> None:
    """Refuse a whole prompt's ``(B, S)`` padding mask (True = padded) with a row of padding only: an empty prompt,
    which the prefill would take and whose first decode step would then be refused as not continuing the cache. (A
    chunk of a chunked prefill may be all padding in a row; the whole prompt may not.)"""
    pad = key_padding.bool()
    if pad.dim() != 2:
        return
    empty = pad.all(-1)
    if bool(empty.any()):
        row = int(empty.nonzero()[0, 0])
        raise ValueError(
            f"row {row} of the batch is all padding (an empty prompt): its attention mask has no real token; give "
            f"every row at least one token"
        )


def check_left_padding(key_padding: torch.Tensor) -> None:
    """Refuse a ``(B, S)`` padding mask (True = padded) that is not left padding: in every row the padded positions
    must all come before the real ones (the mask never turns from real back to padded along the sequence).

    Positions, sinks and the observation window are counted from where a row's left padding ends
    (``docs/conventions.md#batches-and-padding``); right or inner padding would silently keep the wrong tokens.

    Raises
    ------
    ValueError
        Naming the first row with a padded position after a real token.
    """
    pad = key_padding.bool()
    if pad.dim() != 2 or pad.shape[-1] < 2:
        return
    late = pad[:, 1:] & ~pad[:, :-1]  # a padded position right after a real one
    if not bool(late.any()):
        return
    row = int(late.any(-1).nonzero()[0, 0])
    at = int(late[row].nonzero()[0, 0]) + 1
    raise ValueError(
        f"slake supports left padding only, and row {row} of the batch has padding at position {at}, after a real "
        f"token (right or inner padding); pad prompts on the left (tokenizer.padding_side = 'left'), as "
        f"model.generate expects for a decoder-only model"
    )
