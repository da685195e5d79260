"""A hybrid model's sliding-window layer in a fixed-shape :class:`~slake.engines.transformers.cache.SlakeCache`
(``max_cache_len``): compiled decoding (``torch.compile``, CUDA graphs) of Gemma 3 and of Qwen 2 with
``use_sliding_window``, whose full-attention layers slake compresses and whose sliding-window layers it leaves to a
bounded cache (``docs/conventions.md#hybrid-models``).

transformers' own ``StaticSlidingWindowLayer`` cannot be used for a compiled step: it keeps the window's offset as a
Python int that the attention mask is built from, so ``torch.compile(dynamic=False)`` makes a new graph at every step
once the window is full (10 graphs for 10 steps of a tiny Gemma 3, transformers 5.24). :class:`WindowLayer` keeps
the window as a ring of ``window`` slots instead, written at ``position % window`` through a device counter, with
each slot's position (-1: empty, or a padding token of the prompt); at decode the registered attention function
attends over the ring with that validity as its mask (:meth:`WindowLayer.attend`; softmax attention does not depend
on the order of its keys) and ignores transformers' mask, whose size the layer keeps fixed. Nothing in a step reads a
host value or changes a shape.

The window is the same as transformers' dynamic layer holds: after the new token's write the ring holds the last
``window`` positions, the new one included, exactly what a query at that position sees through the sliding mask
(``kv_idx > q_idx - window``). The prompt is attended with transformers' own sliding mask (the layer returns the whole
prompt, as the dynamic layer does), and only its last ``window`` tokens are kept.
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import CacheLayerMixin

from slake.cache.decode_step import sdpa_step
from slake.engines.transformers.forward_checks import check_same_heads

__all__ = ["WindowLayer", "current_window"]

_current = threading.local()


def current_window() -> WindowLayer | None:
    """The window layer whose ``update`` ran last in this thread (consumed by the attention function)."""
    return getattr(_current, "layer", None)


def _set_current(layer: WindowLayer | None) -> None:
    _current.layer = layer


class WindowLayer(CacheLayerMixin):
    """A sliding-window layer's keys and values as a ring of ``window`` slots (see the module's docstring).

    Parameters
    ----------
    sliding_window : int
        The layer's window (transformers' ``sliding_window``): a query sees the keys of the last ``sliding_window``
        positions, its own included.
    max_cache_len : int
        Positions the cache serves (prompt + new tokens); the ring holds ``min(sliding_window, max_cache_len)`` slots.
        A ring shorter than the window refuses a token past ``max_cache_len`` (``_slot_within_capacity``).
    layer_idx : int
        The model's layer, named when keys of other heads than the ring holds (another model's) are refused.
    """

    is_compileable = True
    is_sliding = True
    is_croppable = False
    supports_early_init = False  # the ring's dtype and head count come from the prompt's keys
    keys: torch.Tensor  # (B, Hkv, window, d) once initialised, as ``values``
    values: torch.Tensor

    def __init__(self, sliding_window: int, max_cache_len: int, layer_idx: int = -1, **kwargs) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # the model's layer, named by the refusal of another model's keys
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.window = min(int(sliding_window), int(max_cache_len))
        #: the positions the ring serves when it is shorter than the window (``max_cache_len``), else None: past
        #: them a ring of ``max_cache_len`` slots would overwrite a position its window still sees
        self.capacity = int(max_cache_len) if self.window < int(sliding_window) else None
        self.prompt_keys: torch.Tensor | None = None  # the prompt's keys until its attention has run
        self.prompt_len = 0
        self._host_len = 0  # the positions written, counted in eager steps only (a compiled step counts nothing)

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Make the ring of ``window`` slots per row and KV head, at the dtype and device of the first keys."""
        B, H, _, d = key_states.shape
        dev = key_states.device
        self.device = dev
        self.keys = torch.zeros(B, H, self.window, d, dtype=key_states.dtype, device=dev)
        self.values = torch.zeros(B, H, self.window, value_states.shape[-1], dtype=value_states.dtype, device=dev)
        #: each slot's absolute position, the same for every row (left padding aligns the rows' ends); -1: empty
        self.positions = torch.full((B, self.window), -1, dtype=torch.int64, device=dev)
        #: the next token's position, a 0-dim device tensor (read by the step, never by the host)
        self.counter = torch.zeros((), dtype=torch.int64, device=dev)
        if not torch.compiler.is_compiling():  # fixed addresses for CUDA graphs, as transformers' static layers
            for t in (self.keys, self.values, self.positions, self.counter):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The prompt: kept (its last ``window`` tokens) and returned whole for its attention. After it, one token
        per step: written into the ring, which is returned."""
        n = key_states.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            keep = min(n, self.window)
            pos = torch.arange(n - keep, n, device=self.device)
            slots = pos % self.window
            self.keys.index_copy_(2, slots, key_states[:, :, n - keep :])
            self.values.index_copy_(2, slots, value_states[:, :, n - keep :])
            self.positions.index_copy_(1, slots, pos.expand(self.positions.shape[0], keep))
            self.counter.fill_(n)
            self.prompt_len = self._host_len = n
            self.prompt_keys = key_states
            _set_current(self)
            return key_states, value_states
        if n != 1:
            raise ValueError(
                f"a fixed-shape SlakeCache's sliding-window layer takes the prompt once and then one token per step, "
                f"got {n} tokens (build the cache without max_cache_len for this use)"
            )
        check_same_heads(self.layer_idx, self.keys, self.values, key_states, value_states)
        slot = torch.remainder(self.counter, self.window).view(1)
        if self.capacity is not None:
            slot = self._slot_within_capacity(slot, self.capacity)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.positions.index_copy_(1, slot, self.counter.view(1, 1).expand(self.positions.shape[0], 1))
        self.counter.add_(1)
        _set_current(self)
        return self.keys, self.values

    def _slot_within_capacity(self, slot: torch.Tensor, capacity: int) -> torch.Tensor:
        """``slot``, or for a token past :attr:`capacity` (a ring shorter than the window, decoded past the
        ``max_cache_len`` it was built for) a refusal: eagerly a ValueError (counted on the host), in a compiled step
        an index past the ring, which the write refuses (an index error; a device assert on CUDA), instead of
        overwriting the oldest slot, which the window still sees (the step answered silently from a cache that had
        lost a token). A compiled step counts nothing on the host, so an eager one is also checked on the device
        (``torch._assert_async``): eager steps after compiled ones on one cache count only themselves on the host."""
        if torch.compiler.is_compiling():
            return torch.where(self.counter < capacity, slot, torch.full_like(slot, self.window))
        if self._host_len >= capacity:
            raise ValueError(_capacity_message(capacity, str(self._host_len)))
        self._host_len += 1
        torch._assert_async(self.counter < capacity, _capacity_message(capacity, "past it"))
        return slot

    def finish_prompt(self, attention_mask: torch.Tensor | None) -> None:
        """Mark the kept prompt slots that hold padding tokens empty (called by the attention function with the
        prompt's 4D sliding mask). The mask's last query row sees exactly the kept positions but the padded ones."""
        if attention_mask is None:  # no padding (transformers leaves the mask out where causality is enough)
            self.prompt_keys = None
            return
        if attention_mask.dim() != 4:
            raise ValueError(f"expected a 4D attention mask, got shape {tuple(attention_mask.shape)}")
        last = attention_mask[:, 0, -1, -min(self.prompt_len, self.window) :]
        self._keep_visible(last if last.dtype == torch.bool else ~(last < -1.0))  # as key_padding_from_mask reads it

    def mark_padding(self, padding: torch.Tensor | None) -> None:
        """Mark the kept prompt slots that hold padding tokens empty, from the prompt's ``(B, S)`` padding (True: a
        padding token): a prompt stored by ``update`` without its attention (a recorded prefill replayed,
        :meth:`slake.engines.transformers.prefill_once.PrefillCapture.replay_into`)."""
        if padding is None:
            self.prompt_keys = None
            return
        if padding.shape[-1] != self.prompt_len:
            raise ValueError(f"padding of {padding.shape[-1]} tokens for a prompt of {self.prompt_len}")
        self._keep_visible(~padding[:, -min(self.prompt_len, self.window) :].bool())

    def _keep_visible(self, visible: torch.Tensor) -> None:
        self.prompt_keys = None
        keep = visible.shape[-1]
        slots = torch.arange(self.prompt_len - keep, self.prompt_len, device=self.device) % self.window
        kept = self.positions.index_select(1, slots)
        self.positions.index_copy_(1, slots, torch.where(visible.expand_as(kept).to(self.device), kept, -1))

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode step's attention of ``query`` ``(B, Hq, 1, d)`` over the ring: ``(B, 1, Hq, d)`` in the keys'
        dtype, as transformers' attention functions return."""
        B, Hq, nq, d = query.shape
        H = self.keys.shape[1]
        valid = (self.positions >= 0)[:, None, :].expand(B, H, self.window)
        out = sdpa_step(query.reshape(B, Hq, d), self.keys, self.values, valid, scaling)
        return out.reshape(B, 1, Hq, d)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(query_length, 0)``: the mask transformers builds covers the new tokens only."""
        # the prompt's mask covers the prompt (the ring is empty before it); at decode the attention function does
        # not read the mask, so a fixed size keeps transformers' mask, built every step, fixed-shape
        return query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:  # type: ignore[override]
        """Every token seen so far, as a 0-dim device tensor (the compressed layers' ``get_seq_length`` in static
        mode): transformers asks the first layer, which is a sliding-window one in Gemma 3."""
        return self.counter if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.window

    def reset(self) -> None:
        raise RuntimeError("a SlakeCache serves one generation; create a new one instead of resetting it")

    def _select(self, fn) -> None:
        self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row of the ring ``repeats`` times (``num_return_sequences``)."""
        if self.is_initialized:
            self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the ring's batch rows ``indices`` (in that order)."""
        if self.is_initialized:
            self._select(lambda t: t[indices])


def _capacity_message(capacity: int, position: str) -> str:
    """Why a token past a short ring's ``max_cache_len`` is refused."""
    return (
        f"this SlakeCache was built with max_cache_len={capacity}: its sliding-window layers keep {capacity} "
        f"positions (fewer than the model's window), and position {position} was decoded; build it with "
        f"max_cache_len >= prompt + new tokens"
    )
