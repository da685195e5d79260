"""The transformers engine (:class:`TransformersEngine`): generation, prefill-once evaluation and the latency and
memory benchmark of a transformers model with slake's compressed cache."""

from slake.engines.transformers.engine import TransformersEngine

__all__ = ["TransformersEngine"]
