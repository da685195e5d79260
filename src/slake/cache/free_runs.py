"""The free slots of a static append-only layer, tracked on the device from step to step.

In static (fixed-shape) mode a layer that appends without evicting (the full cache, a layer within its budget,
``decode_eviction=False``) writes each new token into the first free slot of every row and KV head. Searching for it
is a reduction over the whole row, at every step and layer: on an H200 the compiled full cache's search at 128K
tokens took 0.95 ms of its 13.4 ms of kernels per step (``docs/compile.md``). Yet such a layer's free slots are at
most two runs, known after the prefill: a left-padded row's padding ``[first, gap)`` in front of its prompt, and the
room ``[tail, W)`` after the prompt (one run without padding, or after a compaction that put the kept slots in front).
Each step takes the next slot of those runs in order, which is the first free one, with a few element-wise
operations on ``(B, Hkv, 1)`` tensors instead of a pass over the row: no read-back, fixed addresses (CUDA graphs).
"""

from __future__ import annotations

import torch

__all__ = ["FreeRuns"]


class FreeRuns:
    """The next free slot of every row and KV head of one static layer, and the jump from the end of the padding's
    run to the room after the prompt.

    Attributes
    ----------
    slot : torch.Tensor
        ``(B, Hkv, 1)`` int64: the first free slot of each row and KV head, ``W`` (the store's width) when none is
        left; advanced in place by :meth:`take`.
    gap, tail : torch.Tensor
        ``(B, Hkv, 1)`` int64: the end of the first run of free slots and the start of the second (``W`` when a run
        is missing); the slot after ``gap - 1`` is ``tail``.
    width : int
        ``W``, the store's slots per row (fixed in static mode).
    """

    __slots__ = ("gap", "slot", "tail", "width")

    def __init__(self, slot: torch.Tensor, gap: torch.Tensor, tail: torch.Tensor, width: int) -> None:
        self.slot, self.gap, self.tail, self.width = slot, gap, tail, int(width)

    @classmethod
    def of(cls, valid: torch.Tensor) -> FreeRuns | None:
        """The runs of a ``(B, Hkv, W)`` validity mask, or None when some row's free slots are not (at most) a run
        followed by a run that reaches the row's end (then the first free slot is searched at each step). Reads the
        device once (call it outside a compiled step: :meth:`slake.cache.decoding.Decoder.prepare_static`)."""
        free = ~valid
        W = free.shape[-1]
        idx = torch.arange(W, device=valid.device)
        past = torch.full((), W, dtype=torch.int64, device=valid.device)
        first = torch.where(free, idx, past).amin(-1, keepdim=True)
        gap = torch.where(valid & (idx >= first), idx, past).amin(-1, keepdim=True)
        tail = torch.where(free & (idx >= gap), idx, past).amin(-1, keepdim=True)
        runs = ((idx >= first) & (idx < gap)) | (idx >= tail)
        if W and not bool(torch.equal(runs, free)):
            return None
        return cls(first, gap, tail, W)

    def take(self) -> torch.Tensor:
        """The slots to write this step's token into, ``(B, Hkv, 1)`` (a new tensor), and :attr:`slot` advanced to
        the next free one: the slot after it, or the start of the tail after the padding's last slot; ``W`` once the
        row is full, which a write refuses (an index past the store) instead of overwriting a kept slot."""
        slots = self.slot.clone()
        after = (slots + 1).clamp_max(self.width)
        self.slot.copy_(torch.where(after == self.gap, self.tail, after))
        return slots

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a static step reads (``slot``, updated in place) or reads only (``gap``, ``tail``)."""
        return [self.slot, self.gap, self.tail]
