"""What a compressed cache holds, reported honestly (``docs/conventions.md#memory-and-byte-accounting``), and the
batch manipulations of ``generate`` (beam search, ``num_return_sequences``) applied to every layer."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from slake.cache.state import CacheState

__all__ = ["byte_counts", "kept_tokens_per_layer", "map_batch"]


def kept_tokens_per_layer(state: CacheState) -> list[float]:
    """Mean kept tokens per KV head and sequence, per layer."""
    return [float(s.counts().float().mean()) if s is not None else 0.0 for s in state.layers]


def byte_counts(state: CacheState, sequence: int | None = None) -> dict[str, int]:
    """Bytes of the whole cache: kept entries, per-head padding, growth slack, metadata, linear state.

    ``padding`` is the dense layout's cost of uneven heads: the slots between each head's kept tokens and the
    longest head's. ``slack`` is allocated room beyond the longest head (free slots kept for the next decode
    tokens, so that decoding does not reallocate). ``linear_state`` is the state SLAKE's layers allocate once any row
    of the batch is compressed (0 for a method without one, or when no row is compressed; a row within its budget,
    counted alone with ``sequence``, holds none). ``sequence``: one batch row's bytes, as a batch-1 run of it would
    hold them (see :meth:`slake.cache.layer_store.LayerStore.byte_counts`; no slack).
    """
    total = {"kept": 0, "padding": 0, "slack": 0, "metadata": 0, "linear_state": 0}
    # a row within the budget, counted alone, holds none of what the batch's compressed rows need
    compressed = sequence is None or state.info is None or bool(state.info.compress[sequence])
    for i, s in enumerate(state.layers):
        if s is None:
            continue
        weighted = state.method.slot_weighted and state.scored(i) and compressed
        counts = s.byte_counts(sequence, weighted=weighted, compressed=compressed)
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


def map_batch(state: CacheState, index: torch.Tensor | None = None, repeats: int | None = None) -> None:
    """Select / reorder the sequences ``index`` (beam search), or repeat every sequence ``repeats`` times
    (``num_return_sequences``), in every layer, target and prefill fact."""
    fn: Callable[[torch.Tensor], torch.Tensor]
    # refused before any layer changes: an empty batch was accepted and failed later in statistics() (max() of an
    # empty tensor); an index past the batch fails in index_select, before anything is selected
    if index is not None:
        index = torch.as_tensor(index)
    if index is not None and (index.dim() != 1 or index.numel() == 0 or index.is_floating_point()):
        raise ValueError(f"a batch selection needs a non-empty 1-D integer index, got shape {tuple(index.shape)}")
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1):
        raise ValueError(f"a batch repeat needs an integer count >= 1, got {repeats!r}")
    if index is not None:
        for s in state.layers:
            if s is not None:
                s.select_batch(index)
        fn = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
    elif repeats is not None:
        for s in state.layers:
            if s is not None:
                s.repeat_batch(repeats)
        fn = lambda t: t.repeat_interleave(repeats, dim=0)  # noqa: E731
    else:
        raise ValueError("map_batch needs an index or a repeat count")
    state.targets = [fn(t) if t is not None else None for t in state.targets]
    if state.info is not None:
        state.info.map_batch(fn)
