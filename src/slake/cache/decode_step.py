"""One decode step of one compressed layer, written once for every engine: append the new token into a free slot,
attend over the kept slots (with SLAKE's PTAA linear term), score the slots with the method's decode rule, choose
one victim per row and KV head, fold it into the linear state and evict it.

The transformers engine (:class:`slake.cache.compressed.CompressedKV`, one batch of sequences) and the vLLM plugin
(:class:`slake.engines.vllm.plugin.decode_pool.DecodePool`, the compressed requests of a step) both call
:func:`decode_step`; they differ only in how the slots' keys and values are stored, which a :class:`SlotKV` hides
(dense ``(B, Hkv, n, d)`` tensors of a :class:`~slake.cache.layer_store.LayerStore`, or vLLM's paged blocks).
The slots' metadata (positions, validity, scores, per-head visibility, targets, the linear state) is handed over as
tensors in a :class:`StepSlots`, updated in place.

Order of operations (``docs/methods/cake.md#decode-rule``, ``docs/methods/slake.md#decode-step``,
``docs/methods/README.md#decode-eviction``): the new token goes into each row's first free slot (score 0, visible to
every query head); logits of the scaled queries over every slot (``-inf`` where a slot is empty or hidden from the
query head); the exact softmax feeds the method's ``decode_scores``; the lowest-scored slot that is neither
protected (window, sinks) nor empty is the victim of its row and KV head, evicted where the row holds more than its
target; SLAKE (``evict_before_output``) folds the victim first and attends without it (Algorithm 1), the others
attend over the step's slots and evict after (CAKE's reference code, H2O, TOVA).

The step reads nothing back to the host and branches on no tensor value, so it runs under ``torch.compile`` / CUDA
graphs; every shape depends only on the batch and the slot count. On CUDA the same step runs as fused Triton
kernels (:mod:`slake.kernels`), tested against this function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from slake.attention.linear_state import LinearState
from slake.attention.ptaa import attend
from slake.attention.softmax import probs_values
from slake.methods.base import DecodeInputs, LayerContext, Method

__all__ = [
    "KVMemory",
    "SlotKV",
    "StepSlots",
    "decode_extras",
    "decode_step",
    "layer_victims",
    "protected_slots",
    "sdpa_step",
]


@dataclass
class StepSlots:
    """The slot metadata of one layer for the ``R`` rows of a decode step (updated in place by the step).

    Attributes
    ----------
    positions, valid, scores : torch.Tensor
        ``(R, Hkv, W)`` int64 absolute positions (-1 when empty), bool validity, float32 per-slot scores.
    target : torch.Tensor | None
        ``(R, Hkv)`` int64 slots each row keeps after the step (-1: no eviction), or None when the layer does not
        evict at all (the full cache, a prompt within its budget, ``decode_eviction=False``).
    newest : torch.Tensor
        The new token's position: a 0-dim int64 tensor (one position for the whole batch, transformers) or
        ``(R, 1, 1)`` (per row, vLLM).
    prompt_len, budget : torch.Tensor
        ``(R,)`` int64 real prompt length and average per-layer budget of each row (read by some decode rules).
    first_real : torch.Tensor | None
        ``(R,)`` int64 position of each row's first real token (sinks are counted from it); None: 0 (no padding).
    head_visible : torch.Tensor | None
        ``(R, Hkv, g, W)`` bool per-query-head visibility (SAGE-KV), or None.
    linear : LinearState | None
        The rows' PTAA linear state ``(R, Hkv, d + 1, d + 1)``, or None.
    rows : torch.Tensor | slice | None
        When set, every per-row tensor above (all but ``newest``) holds more rows than the step (a pool of
        requests), and the step's row ``i`` is their row ``rows[i]``: ``(R,)`` int64 indices, or a slice
        ``a:a+R`` (the usual case: the step's rows are contiguous and in order, so they are updated through views).
    layer : LayerContext | None
        The layer's model facts (rotary embedding, output projection) for methods whose ``layer_facts()`` name them.
    weights : torch.Tensor | None
        ``(R, Hkv, W)`` float32 per-slot weights of a method with ``slot_weighted`` (exact for every valid slot; the
        step writes the new token's), or None: the decode rule then computes them over every slot.
    order : torch.Tensor | None
        ``(R, Hkv, W)`` int32 with the strides of ``positions``: each row's valid slots in position order as the
        fused kernels' last step left them, which spares the positional pooling a sort when it still holds
        (:func:`slake.kernels.triton_pooling.listed_lanes` checks it; any content is safe), or None. Only the fused
        step reads and writes it (:func:`slake.cache.fused_step.keeps_order` says for which methods).
    """

    positions: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    target: torch.Tensor | None
    newest: torch.Tensor
    prompt_len: torch.Tensor
    budget: torch.Tensor
    first_real: torch.Tensor | None = None
    head_visible: torch.Tensor | None = None
    linear: LinearState | None = None
    rows: torch.Tensor | slice | None = None
    layer: LayerContext | None = None
    weights: torch.Tensor | None = None
    order: torch.Tensor | None = None

    def take_rows(self) -> StepSlots:
        """The step's own rows (views for a slice, copies for an index tensor; see :meth:`put_rows`)."""
        rows = self.rows
        if rows is None:
            return self

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)

        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else take(t)

        return StepSlots(
            positions=take(self.positions),
            valid=take(self.valid),
            scores=take(self.scores),
            target=maybe(self.target),
            newest=self.newest,
            prompt_len=take(self.prompt_len),
            budget=take(self.budget),
            first_real=maybe(self.first_real),
            head_visible=maybe(self.head_visible),
            linear=None if self.linear is None else LinearState(take(self.linear.aug)),
            layer=self.layer,
            weights=maybe(self.weights),
            order=maybe(self.order),
        )

    def put_rows(self, taken: StepSlots) -> None:
        """Write the rows of :meth:`take_rows` back (nothing to do for a slice: they were views)."""
        rows = self.rows
        if rows is None or isinstance(rows, slice):
            return
        for name in ("positions", "valid", "scores", "head_visible", "weights", "order"):
            t = getattr(self, name)
            if t is not None:
                t.index_copy_(0, rows, getattr(taken, name))
        if self.linear is not None and taken.linear is not None:
            self.linear.aug.index_copy_(0, rows, taken.linear.aug)


@dataclass
class KVMemory:
    """Where a layer's keys and values are, for the fused kernels: slot ``s`` of step row ``r`` lives in block
    ``table[r, s // block_size]`` at offset ``s % block_size``, and element ``i`` of its key at
    ``keys[blk * k_strides[0] + head * k_strides[1] + off * k_strides[2] + i * k_strides[3]]`` (values alike).

    Attributes
    ----------
    keys, values : torch.Tensor
        Tensors whose first element is element 0 of block 0, head 0, offset 0 (views of the engine's storage).
    k_strides, v_strides : tuple of int
        Element strides of (block, head, offset, dim).
    table : torch.Tensor
        ``(R, blocks)`` integer block ids of each step row.
    block_size : int
        Slots per block.
    width : int
        Slots per row the step reads and scores.
    quant : str | None
        ``"int8"``, ``"fp8_e4m3"`` (codes, with ``k_scale``/``v_scale``) or None.
    k_scale, v_scale : torch.Tensor | None
        Float32 scales of the 8-bit rows, addressed with ``scale_strides`` (block, head, offset).
    """

    keys: torch.Tensor
    values: torch.Tensor
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    table: torch.Tensor
    block_size: int
    width: int
    quant: str | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    scale_strides: tuple[int, int, int] = (0, 0, 0)


class SlotKV(Protocol):
    """How an engine stores the keys and values of a layer's slots (what :func:`decode_step` needs of it)."""

    def write_kv(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``(R, Hkv, 1, d)`` in ``slots`` ``(R, Hkv, 1)`` (each head its own slot)."""

    def read_kv(self) -> tuple[Any, torch.Tensor]:
        """The slots' keys, in the form :meth:`kv_logits` takes, and values ``(R, Hkv, W, d)`` (finite everywhere:
        empty slots hold zeros or old entries, never NaN)."""

    def kv_logits(self, queries: torch.Tensor, keys: Any) -> torch.Tensor:
        """``queries`` ``(R, Hkv, g, d)`` float32 times the keys: ``(R, Hkv, g, W)`` float32."""

    def slot_keys(self, keys: Any) -> torch.Tensor:
        """The keys of :meth:`read_kv` as ``(R, Hkv, W, d)`` in slot order, for decode rules that read them
        (:attr:`~slake.methods.base.Method.decode_reads_kv`)."""

    def fold_kv(
        self, linear: LinearState, keys: Any, values: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor
    ) -> None:
        """Fold the rows ``slots`` ``(R, Hkv, 1)`` where ``chosen`` (same shape, bool) into ``linear``."""

    def kernel_memory(self) -> KVMemory | None:
        """Where the keys and values are, for the fused kernels (None: a layout they do not address)."""


def protected_slots(
    method: Method,
    positions: torch.Tensor,
    valid: torch.Tensor,
    newest: int | torch.Tensor,
    first_real: torch.Tensor | None,
) -> torch.Tensor:
    """``(B, Hkv, n)`` bool: the slots holding a sink or one of the ``window`` most recent tokens.

    ``newest`` is the newest position (an int, a 0-dim tensor or ``(B, 1, 1)``); sinks are the ``sinks`` first real
    tokens of each row (``first_real`` ``(B,)``, None for rows without left padding)."""
    keep = None
    if method.window and not method.newest_evictable:
        keep = positions > newest - method.window
    if method.sinks:
        first = 0 if first_real is None else first_real.view(-1, 1, 1)
        sinks = (positions >= first) & (positions < first + method.sinks)
        keep = sinks if keep is None else keep | sinks
    return torch.zeros_like(valid) if keep is None else keep


def decode_step(
    method: Method,
    slots: StepSlots,
    kv: SlotKV,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One single-token decode step of one layer for ``R`` rows; returns the ``(R, Hq, d)`` float32 output.

    Parameters
    ----------
    method : Method
        The method (its ``decode_scores``, window, sinks, ``evict_before_output``).
    slots : StepSlots
        The rows' slot metadata; updated in place (the new token's slot, the new scores, the eviction).
    kv : SlotKV
        The rows' keys and values; the new token is written to it and the victims are folded from it.
    query : torch.Tensor
        ``(R, Hq, d)`` the new token's post-RoPE queries.
    key, value : torch.Tensor
        ``(R, Hkv, d)`` the new token's post-RoPE key and value.
    scaling : float
        The model's softmax scale.

    Notes
    -----
    Every row must have a free slot (the caller's bookkeeping: the slot evicted at the previous step, one extra slot
    after prefill, or room reserved for an append-only layer). A layer without targets (``slots.target`` None)
    appends and attends without scoring.
    """
    if slots.rows is not None:
        own = slots.take_rows()
        out = decode_step(method, own, kv, query, key, value, scaling)
        slots.put_rows(own)
        return out
    # On a CPU every torch operation here costs ~2-10 us whatever its size (the tensors are a few KB), so the step
    # costs its operation count: each value below is computed once and shared
    # (``tests/test_fused_decode_launches.py`` counts them).
    R, Hq, d = query.shape
    valid, positions, scores = slots.valid, slots.positions, slots.scores
    H = valid.shape[1]
    g = Hq // H
    newest = _newest(slots)
    # 1. append: the first free slot of every row and head: the first minimum of the validity read as bytes (one
    # operation), or in a compiled graph the first maximum of the cast emptiness (with the argmin of the validity
    # as uint8, viewed or cast, inductor's C++ step aborted, tests/test_compile.py; a graph fuses the cast anyway)
    if torch.compiler.is_compiling():
        free = (~valid).to(torch.uint8).argmax(-1, keepdim=True)
        # a compiled step counts nothing on the host (the engine's append does in eager ones): a row without a free
        # slot (an append-only row decoded past the room its static store was given) gets an index past the row,
        # which the write refuses (an index error; a device assert on CUDA), instead of overwriting its slot 0
        room = (~valid).any(-1, keepdim=True)
        free = torch.where(room, free, torch.full_like(free, valid.shape[-1]))
    else:
        free = valid.view(torch.uint8).argmin(-1, keepdim=True)  # (R, H, 1)
    kv.write_kv(free, key.view(R, H, 1, d), value.view(R, H, 1, d))
    valid.scatter_(-1, free, True)
    positions.scatter_(-1, free, newest.expand(R, H, 1))
    scores.scatter_(-1, free, 0.0)
    if slots.head_visible is not None:
        slots.head_visible.scatter_(-1, free[:, :, None, :].expand(-1, -1, g, -1), True)
    # 2. logits of the scaled queries in group layout, -inf where a slot is empty or hidden from the query head
    keys, values = kv.read_kv()
    W = values.shape[2]
    qf = (query.float() * scaling).reshape(R, H, g, 1, d)
    x = kv.kv_logits(qf.view(R, H, g, d), keys).reshape(R, H, g, 1, W)
    empty = ~valid
    hidden = empty[:, :, None, None, :]
    if slots.head_visible is not None:
        hidden = hidden | ~slots.head_visible[:, :, :, None, :]
    x.masked_fill_(hidden, float("-inf"))
    linear = slots.linear
    if slots.target is None:  # no eviction in this layer: attend only
        return attend(qf, x, values, linear, 1.0, overwrite_logits=True).view(R, Hq, d)
    weights = slots.weights if method.slot_weighted else None
    if weights is not None:  # the new slot's weight, from its value as stored (dequantised)
        new_value = values.gather(2, free[..., None].expand(-1, -1, -1, d))
        weights.scatter_(-1, free, method.slot_weights(new_value.float(), slots.layer))
    # 3. the method's scores and the victim of every row and KV head. Every row sees its new token, so no row of
    # the softmax is all -inf and it needs no NaN guard (``safe_softmax``).
    probs = torch.softmax(x, dim=-1)  # (R, H, g, 1, W)
    new_scores = method.decode_scores(
        DecodeInputs(
            probs=probs.view(R, H * g, 1, W),
            positions=positions,
            valid=valid,
            stored=scores,
            prompt_len=slots.prompt_len,
            budget=slots.budget,
            newest=newest,
            weights=weights,
            **decode_extras(
                method,
                slots.layer,
                kv.slot_keys(keys) if method.decode_reads_kv else keys,
                values,
                qf.view(R, Hq, 1, d),
            ),
        )
    )
    scores.copy_(new_scores)  # in place: the tensors keep their addresses from step to step (CUDA graphs)
    target = slots.target
    counts = valid.sum(-1)  # (R, H)
    # protected (window, sinks) and empty slots are never chosen while an evictable slot remains
    guard = _unselectable(method, positions, empty, newest, slots.first_real)
    ranked = scores.masked_fill(guard, float("inf"))
    lowest = ranked.argmin(-1, keepdim=True)  # the first minimum
    if method.evicts_across_heads:  # the layer keeps its size; a head over the widest prefill head gives its lowest
        assert linear is None  # DecodeScope refuses linear_cache: nothing is folded below
        forced = (counts > target.amax(-1, keepdim=True))[..., None] & valid.gather(-1, lowest)  # (R, H, 1)
        mask = layer_victims(ranked, valid, counts, target, torch.zeros_like(valid).scatter_(-1, lowest, forced), H)
        chosen = forced
    else:
        # rows over their target; a negative target (-1: no eviction) becomes the dtype's largest value, never exceeded
        over = counts > target.bitwise_and(torch.iinfo(target.dtype).max)  # (R, H)
        chosen = over[..., None] & valid.gather(-1, lowest)  # (R, H, 1)
        mask = torch.zeros_like(valid).scatter_(-1, lowest, chosen)
    # 4. output and eviction, in the method's order
    if method.evict_before_output:
        if linear is not None:
            kv.fold_kv(linear, keys, values, lowest, chosen)
        x.masked_fill_(mask[:, :, None, None, :], float("-inf"))  # x is this step's own tensor
        out = attend(qf, x, values, linear, 1.0, overwrite_logits=True)
    else:
        if linear is None:
            out = probs_values(probs, values)
        else:
            out = attend(qf, x, values, linear, 1.0, overwrite_logits=True)
            kv.fold_kv(linear, keys, values, lowest, chosen)
    valid.masked_fill_(mask, False)
    positions.masked_fill_(mask, -1)
    scores.masked_fill_(mask, float("-inf"))
    return out.view(R, Hq, d)


def layer_victims(
    ranked: torch.Tensor,
    valid: torch.Tensor,
    counts: torch.Tensor,
    target: torch.Tensor,
    forced: torch.Tensor,
    most: int,
) -> torch.Tensor:
    """The slots a layer evicts across its KV heads (:attr:`~slake.methods.base.Method.evicts_across_heads`):
    ``(R, Hkv, W)`` bool.

    Each row (``target[r, 0] >= 0``) evicts its slots beyond the layer's total target ``target[r].sum()``, at least
    the ``forced`` ones (slots whose head is over its cap), at most ``most``: the ``forced`` slots first, then the
    lowest ``ranked`` ones over all its heads (``ranked``: the scores with ``+inf`` on protected and empty slots, which
    go only when nothing else can; an empty slot never does). ``counts`` ``(R, Hkv)``: the slots each head holds
    (``valid.sum(-1)``). Equal scores go in the order of the layer's slots, head by head, as a stable sort would
    take them and the fused kernels do (:mod:`slake.kernels.triton_layer`): ``topk``, which leaves the order of ties
    to the device, gives only the threshold, the ``need``-th lowest score; the slots below it go, and of those equal
    to it the first in slot order (a sort of the layer's slots took 30-60 times ``topk``'s time on a CPU). Fixed
    shapes, no read-back."""
    R, H, W = ranked.shape
    need = (counts.sum(-1) - target.sum(-1)).clamp_min(0)  # (R,)
    need = torch.maximum(need, forced.sum((-1, -2))).masked_fill(target[:, 0] < 0, 0)
    flat = ranked.masked_fill(forced, float("-inf")).view(R, H * W)
    most = min(most, H * W)
    need = need.clamp(max=most)[:, None]  # (R, 1)
    threshold = flat.topk(most, dim=-1, largest=False).values.gather(-1, (need - 1).clamp_min(0))
    below = flat < threshold
    tied = flat == threshold
    ties_before = tied.cumsum(-1) - tied.long()
    chosen = (below | (tied & (ties_before < need - below.sum(-1, keepdim=True)))) & (need > 0)
    return (chosen & valid.view(R, H * W)).view(R, H, W)


def _unselectable(
    method: Method,
    positions: torch.Tensor,
    empty: torch.Tensor,
    newest: torch.Tensor,
    first_real: torch.Tensor | None,
) -> torch.Tensor:
    """``(R, Hkv, W)`` bool: :func:`protected_slots` or ``empty`` (``~valid``), in as few operations as the
    method's protection needs."""
    guard = empty
    if method.window and not method.newest_evictable:
        guard = guard | (positions > newest - method.window)
    if method.sinks:
        first = 0 if first_real is None else first_real.view(-1, 1, 1)
        guard = guard | ((positions >= first) & (positions < first + method.sinks))
    return guard


def decode_extras(
    method: Method,
    layer: LayerContext | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
) -> dict[str, Any]:
    """The :class:`~slake.methods.base.DecodeInputs` fields a method asks for beyond the probabilities: the layer's
    facts (``layer_facts()``) and, for ``decode_reads_kv``, the step's scaled queries ``(R, Hq, n_q, d)`` float32 and
    the slots' keys and values as ``(R, Hkv, W, d)`` float32 (dequantised). ``keys`` must then be dense
    (:meth:`SlotKV.slot_keys` makes the vLLM plugin's paged keys so)."""
    extras: dict[str, Any] = {}
    if method.layer_facts():
        extras["layer"] = layer
    if method.decode_reads_kv:
        if keys.dim() != 4 or keys.shape[:2] != values.shape[:2]:
            raise ValueError(f"{method.name} reads the slots' keys at decode: they must be dense (R, Hkv, W, d)")
        extras["keys"] = keys.float()
        extras["values"] = values.float()
        if queries is not None:
            extras["queries"] = queries
    return extras


def _newest(slots: StepSlots) -> torch.Tensor:
    """The new token's position in a shape that broadcasts against ``(R, Hkv, W)``."""
    return slots.newest.view(-1, 1, 1) if slots.newest.ndim else slots.newest


def sdpa_step(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """One new query per row over every valid slot of a dense layer: one SDPA call, no score, no copy of the cache.

    ``query`` ``(R, Hq, d)``, ``keys``/``values`` ``(R, Hkv, W, d)``, ``valid`` ``(R, Hkv, W)``, or None when every
    slot given is valid (no mask: the call a GPU runs with its decode kernel); the ``g`` query heads of a KV head
    are the ``g`` query rows of one SDPA head, so nothing is expanded per query head. Returns ``(R, Hq, d)`` in the
    keys' dtype, SDPA's own: a half-precision model's output is not cast to float32 and back (two kernels per layer
    and step on a GPU, and the round trip changes no value)."""
    R, Hq, d = query.shape
    H = keys.shape[1]
    q = query.reshape(R, H, Hq // H, d).to(keys.dtype)
    if valid is not None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, :, None, :], scale=scaling)
    elif query.device.type == "cuda":
        out = _sdpa_without_cudnn(q, keys, values, scaling)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, scale=scaling)
    return out.reshape(R, Hq, d)


def _sdpa_without_cudnn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """SDPA with no mask on CUDA, cuDNN's backend turned off for the call (flash attention, else the
    memory-efficient kernel, else the math one).

    On the H200 (torch 2.11) PyTorch picked cuDNN's flash forward for this call, which does not split the keys (a
    batch-1 layer at 128K took 1.7 ms, 0.3 TB/s) and builds a plan for each new key length, which this call has at
    every step (2 ms of host time per layer at 8K: the eager full cache took 104 ms per token where the masked call,
    one fixed length, took 44). Flash attention's forward splits the keys over the multiprocessors (the same call
    over a dense 128K cache read at 3.6 TB/s there). docs/gpu.md, "Measured on an H200, again"."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    if enabled:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(q, keys, values, scale=scaling)
    finally:
        if enabled:
            torch.backends.cuda.enable_cudnn_sdp(True)
