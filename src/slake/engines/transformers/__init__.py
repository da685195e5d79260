"""The transformers engine (:class:`TransformersEngine`): generation, prefill-once evaluation and the latency and
memory benchmark of a transformers model with slake's compressed cache.

:class:`TransformersEngine` is imported when first asked for, so that the light modules of this package (model names
and devices, ``models.check_device``) can be read without importing transformers (the ``slake`` command checks its
arguments with them before anything heavy loads)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slake.engines.transformers.engine import TransformersEngine

__all__ = ["TransformersEngine"]


def __getattr__(name: str) -> Any:
    if name == "TransformersEngine":
        return import_module("slake.engines.transformers.engine").TransformersEngine
    raise AttributeError(f"module 'slake.engines.transformers' has no attribute {name!r}")
