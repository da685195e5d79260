"""Chunked prefill: a prompt fed in chunks, each layer evicted back to its budget after every chunk, so that the
cache never holds more than the budget plus one chunk (``docs/conventions.md#chunked-prefill``).

This trades the exactness of the prefill for bounded memory: the first chunk is prefilled exactly and compressed
(:class:`slake.cache.prefill.PrefillCompressor`, budgets and cascade computed from it, with the whole prompt's
lengths); every later chunk attends over the compressed past plus itself, causally by position, and the method's
decode rule, fed the chunk's last ``window`` queries (every query for a rule that accumulates each query's attention,
``Method.decode_accumulates``), scores the slots for the eviction. A method that needs the whole
prompt before it selects (a second pass, KVzip; a one-shot selection, SAGE-KV) is refused (:func:`check_chunkable`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from slake.attention.ptaa import attend
from slake.attention.softmax import safe_softmax
from slake.budgets import Budget
from slake.cache.block_logits import grouped_queries, layer_logits
from slake.cache.decode_step import decode_extras
from slake.cache.decoding import Decoder
from slake.cache.layer_store import _GROWTH, LayerStore
from slake.cache.prefill import PrefillCompressor, check_left_padding, check_real_tokens
from slake.cache.state import CacheState
from slake.methods.base import DecodeInputs, Method

__all__ = ["ChunkedPrefill", "check_chunkable", "first_chunk_end"]

_CHUNK_QUERY_BLOCK = 128  # chunk queries attended at once during a chunked prefill (bounds the logits' memory)

#: the methods whose uniform split of a chunked prefill's layer budgets was told (once each per process)
_told_uniform: set[str] = set()


class ChunkedPrefill:
    """The chunked-prefill phase (between :meth:`begin` and :meth:`end`).

    Attributes
    ----------
    padding : torch.Tensor | None
        ``(B, S)`` padding of the whole prompt while a chunked prefill is under way, else None.
    """

    def __init__(self, state: CacheState, prefill: PrefillCompressor, decoder: Decoder) -> None:
        self.state = state
        self.prefill = prefill
        self.decoder = decoder
        self.padding: torch.Tensor | None = None
        #: positions ``0 .. padded_until - 1`` hold some row's left padding (the longest row's padding), read once
        #: at :meth:`begin` so that a chunk past it needs no look at the mask
        self.padded_until = 0

    @property
    def active(self) -> bool:
        """True between :meth:`begin` and :meth:`end`."""
        return self.padding is not None

    def begin(self, key_padding: torch.Tensor) -> None:
        """Start a chunked prefill of a prompt whose full ``(B, S)`` padding mask (True = padded) is known.

        Refuses (ValueError, before anything is stored) a method that cannot prefill in chunks
        (:func:`check_chunkable`)."""
        check_chunkable(self.state.method)
        if self.state.info is not None or any(s is not None for s in self.state.layers):
            raise RuntimeError("begin_chunked_prefill must be called before the first prefill chunk")
        padding = key_padding.bool()
        check_left_padding(padding)
        check_real_tokens(padding)
        self.padding = padding
        self.padded_until = int(padding.sum(-1).max()) if padding.numel() else 0

    def end(self, *, check: bool = True) -> None:
        """Leave chunked-prefill mode; later appends are decode steps with decode-time eviction.

        With ``check`` (the default), refuses (RuntimeError, after leaving the mode) a prefill that stopped before
        the prompt given to :meth:`begin` was fed: its budget and compress decision were the whole prompt's, so the
        layers would be held at fewer entries than their budget, or left uncompressed, without a word. ``check=False``
        leaves the mode after a chunk that failed (the caller is raising that error already)."""
        padding, self.padding = self.padding, None
        if not check or padding is None:
            return
        prompt = padding.shape[1]
        fed = min(self.state.seen, default=prompt)
        if fed != prompt:
            raise RuntimeError(
                f"the chunked prefill ended after {fed} of the {prompt} prompt tokens given to begin_chunked_prefill "
                "(the budget and the compress decision are the whole prompt's): feed every chunk before "
                "end_chunked_prefill"
            )

    def tell_uniform_split(self) -> None:
        """Warn (once per method and process) when the first chunk's prefill split a layer-preference method's budget
        uniformly: the layers' budgets are set by the first chunk's preferences alone, and a chunk within the budget
        (SLAKE, LAVa) or the window (CAKE) shows none, so every layer gets the same budget and the method's layer
        allocation is lost for the whole generation, not just for its first chunk. ``slake.generate`` and
        ``prefill`` make such a first chunk longer (:func:`first_chunk_end`); a chunked prefill driven by hand can
        still have one. Called after the first chunk's last layer; reads the preferences back from the device once."""
        state = self.state
        method, info = state.method, state.prefill_info()
        if method.layer_budgets != "preference" or method.name in _told_uniform or state.num_layers < 2:
            return
        prefs = [p for p in info.preferences if p is not None]
        if len(prefs) < 2 or len(prefs) != len(info.preferences):
            return
        stacked = torch.stack([p.to(prefs[0].device, torch.float64) for p in prefs])  # (L, B)
        if not bool((stacked == stacked[:1]).all()):
            return
        _told_uniform.add(method.name)
        logging.getLogger("slake").warning(
            "slake: %s splits its budget across layers by the first prefill chunk's layer preferences, and this "
            "first chunk (%d tokens) shows none (it fits within the budget, or the method's window): every layer "
            "gets the same budget for the whole generation; a prefill chunk longer than the budget lets the method "
            "split it (docs/conventions.md#chunked-prefill)",
            method.name,
            state.seen[0],
        )

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a later chunk's keys/values into the layer (growing it by what is missing).

        The chunk's positions that are a row's left padding are written as empty slots (:meth:`_empty_padding`), as
        the first chunk's are (:meth:`PrefillCompressor.prefill_layer`): never attended, kept or folded. A chunk that
        reaches past the prompt given to :meth:`begin` is refused (RuntimeError), padded or not: its budget and
        compress decision were the declared prompt's."""
        state = self.state
        store = state.store(layer_idx)
        start, n_new = state.seen[layer_idx], keys.shape[2]
        if self.padding is not None and start + n_new > self.padding.shape[1]:  # with padding or without
            raise RuntimeError(
                f"a prefill chunk reaches position {start + n_new}, past the {self.padding.shape[1]}-token prompt "
                f"given to begin_chunked_prefill"
            )
        pos = torch.arange(start, start + n_new, device=keys.device)
        padded = self._chunk_padding(start, n_new, keys.device)
        if padded is not None:  # no padding token's content enters the store, not even in a slot left empty
            keys = keys.masked_fill(padded[:, None, :, None], 0)
            values = values.masked_fill(padded[:, None, :, None], 0)
        slots = store.append(keys, values, pos, growth=1 if state.evicts(layer_idx) else _GROWTH)
        if padded is not None:
            _empty_padding(store, slots, padded)
        state.seen[layer_idx] = start + n_new
        self.decoder.position_of(layer_idx).add_(n_new)
        self.decoder.reset_layer(layer_idx)

    def _chunk_padding(self, start: int, n_new: int, device: torch.device) -> torch.Tensor | None:
        """``(B, n_new)`` bool: which of the chunk's positions ``start .. start + n_new - 1`` are padding, or None
        when none is (the chunk starts past every row's left padding)."""
        if self.padding is None or start >= self.padded_until:
            return None
        return self.padding[:, start : start + n_new].to(device)  # within the prompt (checked by append)

    def attention(self, layer_idx: int, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """The chunk's attention over the compressed past (plus the linear term) and the chunk itself, causal by
        position, in query blocks that bound the transient logits to ``_CHUNK_QUERY_BLOCK x n``; then the layer is
        scored and evicted back to its budget (:meth:`evict`). Returns ``(B, Hq, n_q, d)`` float32.

        The decode rule scores the slots from the chunk's last ``window`` queries (its observation window), or from
        every query for a rule that adds each query's attention into a running score (``Method.decode_accumulates``:
        H2O and AhaKV, whose prefill sums every prompt query), block by block as the attention goes. A rule that reads
        the queries as a distribution (``Method.reads_block_queries``: Expected Attention, whose prefill takes the
        statistics of every prompt query) gets every query of the chunk but a row's padding and first ``sinks``
        tokens, which its prefill leaves out too (:meth:`_score_block`), beside its window's probabilities."""
        state = self.state
        store = state.store(layer_idx)
        B, Hq, nq, d = queries.shape
        newest = state.seen[layer_idx] - 1
        qpos = torch.arange(newest - nq + 1, newest + 1, device=queries.device)
        evicting = state.targets[layer_idx] is not None and not state.method.keeps_everything
        every_query = evicting and state.method.decode_accumulates
        outs = []
        for b0 in range(0, nq, _CHUNK_QUERY_BLOCK):
            b1 = min(b0 + _CHUNK_QUERY_BLOCK, nq)
            qf, x = layer_logits(store, queries[:, :, b0:b1], qpos[b0:b1], scaling)
            if every_query:  # before attend overwrites the logits; the rule's sum over the blocks is its sum over all
                self.score(layer_idx, x, qf)
            out = attend(qf, x, store.dense_values(), store.linear, 1.0, overwrite_logits=True)
            outs.append(out.reshape(B, Hq, b1 - b0, d))
        if evicting:
            if not every_query:
                w = max(min(state.method.window, nq), 1)
                qw, x = layer_logits(store, queries[:, :, nq - w :], qpos[nq - w :], scaling)
                if state.method.reads_block_queries:  # the rule's statistics over the chunk's queries
                    self._score_block(layer_idx, x, grouped_queries(queries, qw.shape[1], scaling), newest - nq + 1)
                else:
                    self.score(layer_idx, x, qw)
            self.evict(layer_idx, newest)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _score_block(self, layer_idx: int, x: torch.Tensor, queries: torch.Tensor, start: int) -> None:
        """:meth:`score` for a rule that reads the chunk's queries as a distribution (``Method.reads_block_queries``:
        Expected Attention), from ``queries`` ``(B, Hkv, g, n_q, d)``, the chunk's starting at position ``start``.

        As the prefill's statistics (:func:`slake.methods.expected_attention.query_statistics`), each row's take
        neither its left padding nor its first ``sinks`` real tokens: a chunk that holds the end of a row's padding
        would otherwise score the row with its padding tokens' queries, and its kept set would depend on what the
        padding holds. Those queries are a prefix of the chunk in every row; rows are scored in groups by its
        length. A row with nothing else in the chunk holds only padding and sinks so far (empty or protected slots),
        so its scores are not read, and are left as they are."""
        nq = queries.shape[-2]
        first = self.state.prefill_info().first_real
        skip = (first + self.state.method.sinks - start).clamp(0, nq)  # (B,) on the host: the prefix to leave out
        if not bool(skip.any()):
            self.score(layer_idx, x, queries)
            return
        for n_skip in sorted(set(skip.tolist())):
            if n_skip < nq:
                rows = (skip == n_skip).nonzero().flatten().to(x.device)
                self.score(layer_idx, x, queries[..., n_skip:, :], rows)

    def score(
        self, layer_idx: int, x: torch.Tensor, queries: torch.Tensor | None = None, rows: torch.Tensor | None = None
    ) -> None:
        """Update a layer's slot scores with the method's decode rule from ``x``, the ``(B, Hkv, g, n_q, n)`` logits
        of some of the chunk's queries (``queries``: those queries, for rules that read them); ``rows``: only these
        batch rows (the others' scores are left as they are)."""
        state = self.state
        store = state.store(layer_idx)
        info = state.prefill_info()
        B, H, g, w, n = x.shape
        probs = safe_softmax(x)
        inputs = DecodeInputs(
            probs=probs.reshape(B, H * g, w, n),
            positions=store.positions,
            valid=store.valid,
            stored=store.scores,
            prompt_len=info.real_len.to(x.device),
            budget=info.budget.to(x.device),
            **decode_extras(
                state.method,
                state.layer_context[layer_idx],
                store.dense_keys(),
                store.dense_values(),
                None if queries is None else queries.reshape(B, H * g, queries.shape[-2], -1),
            ),
            target=state.targets[layer_idx],
        )
        if rows is None:
            store.scores = state.method.decode_scores(inputs).float()
            return
        picked: dict[str, Any] = {
            f.name: value[rows]
            for f in dataclasses.fields(inputs)
            if isinstance(value := getattr(inputs, f.name), torch.Tensor) and value.dim() and value.shape[0] == B
        }
        scores = store.scores.clone()
        scores[rows] = state.method.decode_scores(dataclasses.replace(inputs, **picked)).float()
        store.scores = scores

    def evict(self, layer_idx: int, newest: int) -> None:
        """Evict a layer back to its budget after a prompt chunk has been scored (:meth:`score`).

        Protected tokens are the last ``window`` positions and the sinks; the layer's per-head budgets come from
        :meth:`Method.head_budgets` as at prefill. A method that carries the protected tokens' own scores
        (``Method.carry_protected_scores``: H2O, AhaKV) keeps them after the eviction, as its prefill does, so that a
        window token's running score is not lost when the next chunk or the decode reads it.
        """
        state = self.state
        store = state.store(layer_idx)
        info = state.prefill_info()
        raw = store.scores
        store.scores = self.prefill.protect(raw, store.positions, store.valid, newest)
        if info.layer_budgets is None:
            raise RuntimeError("the first chunk's prefill did not set the layer budgets")
        carry = state.method.carry_protected_scores
        if carry:  # each valid slot's own score by position (positions are unique in a row); empty slots aside
            by_position = torch.zeros(*raw.shape[:2], newest + 2, dtype=raw.dtype, device=raw.device)
            at = torch.where(store.valid, store.positions, newest + 1)
            by_position.scatter_(-1, at, raw)
        self.prefill.evict_to(layer_idx, info.layer_budgets[:, layer_idx])
        if carry:
            carried = by_position.gather(-1, torch.where(store.valid, store.positions, newest + 1))
            store.scores = torch.where(store.valid & torch.isposinf(store.scores), carried, store.scores)


def check_chunkable(method: Method) -> None:
    """Refuse (ValueError) a chunked prefill for a method that cannot take one: a method with a second pass over the
    whole prompt (KVzip, :attr:`Method.second_pass`) or one whose prefill selection is one-shot over the whole prompt
    (:attr:`Method.not_chunkable`, SAGE-KV). A chunked prefill shows the method's prefill scores the first chunk only
    and leaves the rest of the prompt to its decode rule: such a method would silently become another one."""
    m = method
    if m.keeps_everything:
        return
    reason = m.not_chunkable
    if reason is None and m.second_pass is not None:
        reason = f"it scores the whole prompt in a second pass ({m.second_pass})"
    if reason is not None:
        raise ValueError(
            f"{m.name} cannot prefill in chunks: {reason}; prefill it exactly (prefill_chunk=None, no --prefill-chunk)"
        )


def first_chunk_end(
    method: Method, budget: Budget, key_padding: torch.Tensor, chunk: int, trailing_tokens: int = 0
) -> int:
    """Where the first chunk of a chunked prefill of ``chunk``-token chunks ends (its length, positions from 0).

    A layer-preference method (CAKE, SLAKE, LAVa: ``layer_budgets == "preference"``) splits its budget across
    layers once, by the first chunk's preferences (:meth:`ChunkedPrefill.tell_uniform_split`). SLAKE's measures what a
    layer loses at its budget, which a first chunk within the budget does not show: every layer would get the same
    budget for the whole generation. For such a method, when some row that is compressed would see no more than its
    budget in the first chunk, the first chunk takes every such row to its budget plus one chunk of real tokens, so
    that the split is made from evictions of a chunk's size, as every later chunk makes. The cache then holds at most
    its budget plus one chunk per layer, as it does after every later chunk; the first forward runs over that many
    positions. Any other method, or a chunk that already takes every compressed row past its budget: ``chunk``.
    The budget is the one given, before ``charge_linear_state`` takes the linear state's slots from it (their size
    is known at the first layer only): a row compressed only because of that charge is not counted.

    Parameters
    ----------
    method : Method
        The cache's method.
    budget : Budget
        The cache's budget (its tokens for each row's whole prompt, :meth:`Budget.tokens`).
    key_padding : torch.Tensor
        ``(B, S)`` bool left padding of the whole prompt (True = padding).
    chunk : int
        The chunk size, ``>= 1``.
    trailing_tokens : int
        Prompt tokens fed after the prefill, counted in the whole prompt (as :meth:`PrefillCompressor._start` does).

    Returns
    -------
    int
        The first chunk's end, in ``[min(chunk, S), S]``.
    """
    S = key_padding.shape[-1]
    if method.layer_budgets != "preference" or method.keeps_everything or chunk >= S:
        return min(chunk, S)
    real = (~key_padding.bool()).sum(-1).tolist()
    reach = 0  # the position where the last compressed row's real tokens reach its budget
    for n in real:
        tokens = budget.tokens(n + trailing_tokens)
        if n + trailing_tokens > tokens:
            reach = max(reach, S - n + tokens)
    if reach < chunk:  # every compressed row is past its budget within the first chunk already
        return chunk
    return min(S, reach + chunk)


def _empty_padding(store: LayerStore, slots: torch.Tensor, padded: torch.Tensor) -> None:
    """Turn the ``slots`` ``(B, Hkv, n)`` just written with a chunk's tokens into empty slots where the token is
    padding (``padded`` ``(B, n)``): not valid, position -1 and score ``-inf``, what an empty slot holds in a
    :class:`LayerStore` (its keys and values were written as zeros)."""
    B, H, n = slots.shape
    empty = torch.zeros_like(store.valid).scatter_(-1, slots, padded[:, None, :].expand(B, H, n))
    store.valid &= ~empty
    store.positions.masked_fill_(empty, -1)
    store.scores.masked_fill_(empty, float("-inf"))
