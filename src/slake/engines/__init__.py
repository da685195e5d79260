"""Engines: one interface (:class:`slake.engines.base.Engine`) over the backends that run a compressed cache.

``transformers`` (:class:`slake.engines.transformers.TransformersEngine`, the reference) and ``vllm``
(:class:`slake.engines.vllm.VllmEngine`, vLLM with the slake plugin). :func:`make_engine` builds one by name.
"""

from __future__ import annotations

from slake.engines.base import Engine, ModelSpec

__all__ = ["ENGINES", "Engine", "ModelSpec", "make_engine"]

#: the ``--engine`` names, the default first
ENGINES = ("transformers", "vllm")


def make_engine(name: str = "transformers", model: ModelSpec | None = None) -> Engine:
    """The engine called ``name`` (one of :data:`ENGINES`) for ``model``; nothing is loaded yet.

    Parameters
    ----------
    name : str
        ``"transformers"`` (default) or ``"vllm"``.
    model : ModelSpec, optional
        The model the engine loads on first use; the packaged default model when None.

    Returns
    -------
    Engine

    Raises
    ------
    ValueError
        For an unknown engine name.
    """
    if name == "transformers":
        from slake.engines.transformers import TransformersEngine

        return TransformersEngine(model)
    if name == "vllm":
        from slake.engines.vllm import VllmEngine

        return VllmEngine(model)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
