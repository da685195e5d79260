"""A hybrid model's bounded layers (sliding-window and chunked attention) in a dynamic
:class:`~slake.engines.transformers.cache.SlakeCache`: transformers' own layers, made to hold only what they keep.

transformers' dynamic sliding-window layer keeps the last ``window - 1`` tokens as a *view* of the whole prompt's
keys and values (``full_key_states[:, :, -window + 1:]``, transformers 5.24): after the prefill each such layer holds
the prompt's keys and values alive until its first decode step replaces the view, and a bounded layer's memory is
the prompt's, not the window's (on Gemma 3 270M at 8K, about 239 MiB for 15 layers instead of 15 MiB). The layers
made here copy what they keep when it is a small part of a larger storage, so a hybrid model's prefill memory is
bounded as the docs say (``docs/conventions.md#hybrid-models``). A decode step's view (the concatenation of the window
and the new token) is left as it is: its storage is one token more than it keeps.

:func:`held_bytes` counts what a layer's tensors hold in memory, their storage, not the elements of the view.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

from slake.engines.transformers.forward_checks import check_same_heads

__all__ = ["bounded_layer", "held_bytes"]

#: a view is copied when its storage holds more than this many times its own bytes
_COPY_ABOVE = 2

_CLASSES: dict[Any, type] = {}


def _compact(layer: Any) -> None:
    """Replace ``layer.keys``/``layer.values`` by copies where each is a small view of a larger storage."""
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and t.numel() and _storage_bytes(t) > _COPY_ABOVE * t.numel() * t.element_size():
            setattr(layer, name, t.clone())


def _compacting(cls: Any) -> type:
    """``cls`` (a transformers cache layer) whose ``update`` compacts what the layer keeps (:func:`_compact`)."""
    made = _CLASSES.get(cls)
    if made is None:

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            keys, values = getattr(self, "keys", None), getattr(self, "values", None)
            if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4:
                check_same_heads(getattr(self, "_slake_layer_idx", -1), keys, values, key_states, value_states)
            out = cls.update(self, key_states, value_states, *args, **kwargs)
            _compact(self)
            return out

        update.__doc__ = (
            f"{cls.__name__}.update (refused for keys of other heads than the layer holds), then a copy of what the "
            f"layer keeps where it is a view of a larger storage (the whole prompt after a prefill)."
        )
        made = type(cls.__name__, (cls,), {"update": update, "__module__": __name__})
        made.__doc__ = f"transformers' {cls.__name__} holding only what it keeps (:mod:`{__name__}`)."
        _CLASSES[cls] = made
    return made


def bounded_layer(kind: str, kwargs: dict[str, Any], layer_idx: int = -1) -> Any:
    """A new dynamic bounded layer of transformers' ``kind`` (``"sliding_attention"``, ``"chunked_attention"``, as in
    ``DYNAMIC_LAYER_TYPE_MAPPING``) built with ``kwargs``, that holds only what it keeps (see the module) and refuses
    keys of other heads than it holds (another model's, :func:`~slake.engines.transformers.forward_checks.
    check_same_heads`), naming the model's ``layer_idx``."""
    layer = _compacting(DYNAMIC_LAYER_TYPE_MAPPING[kind])(**kwargs)
    layer._slake_layer_idx = layer_idx  # not transformers' own attribute: a name of ours
    return layer


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def held_bytes(tensors: list[torch.Tensor], sequence: int | None = None) -> int:
    """Bytes the ``tensors`` ``(B, ...)`` hold in memory: each distinct storage once, whole (a view keeps its whole
    storage alive); ``sequence``: one row's share, the storage over the batch size."""
    seen: set[int] = set()
    held = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        size = max(_storage_bytes(t), t.numel() * t.element_size())
        held += size if sequence is None else size // max(t.shape[0], 1)
    return held
