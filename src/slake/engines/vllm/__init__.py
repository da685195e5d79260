"""The vLLM engine (:class:`VllmEngine`): the driver that starts vLLM with the slake plugin in this process and
reads back its results. The plugin vLLM loads in its own processes is :mod:`slake.engines.vllm.plugin`."""

from slake.engines.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]
