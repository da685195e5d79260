"""The keyword a model's forward (and ``generate``) takes its KV cache under, across transformers versions.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name is deprecated until 5.40 for forwards and
6.0 for ``generate``); earlier 5.x versions only know ``past_key_values``. slake passes its cache under whichever name
the model's own forward declares, and its input check reads either.
"""

from __future__ import annotations

import inspect

import torch

NEW_NAME = "cache"
OLD_NAME = "past_key_values"
_by_class: dict[type, str] = {}


def cache_kwarg(model: torch.nn.Module) -> str:
    """``"cache"`` when ``model.forward`` declares it (transformers >= 5.24), else ``"past_key_values"``."""
    cls = type(model)
    name = _by_class.get(cls)
    if name is None:
        try:
            params = set(inspect.signature(cls.forward).parameters)  # follows functools.wraps to the real signature
        except (TypeError, ValueError):
            params = set()
        name = _by_class[cls] = NEW_NAME if NEW_NAME in params and OLD_NAME not in params else OLD_NAME
    return name


def with_cache(model: torch.nn.Module, cache: object) -> dict:
    """Keyword arguments that hand ``cache`` to ``model``'s forward or ``generate``: ``{name: cache}``."""
    return {cache_kwarg(model): cache}


def cache_from_kwargs(kwargs: dict) -> object | None:
    """The cache a forward was called with, under either name (the new one first)."""
    found = kwargs.get(NEW_NAME)
    return found if found is not None else kwargs.get(OLD_NAME)
