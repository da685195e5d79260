"""slake: KV-cache compression for Hugging Face transformers.

Quick start::

    import slake
    model, tokenizer = slake.load_model()            # SmolLM2-135M-Instruct, packaged GGUF, offline
    result = slake.generate(model, tokenizer, long_prompt, method="slake", budget=128)
    print(result.text, result.kv_bytes)

Public names: :func:`load_model`, :func:`generate`, :class:`SlakeCache`, :func:`prepare_model`,
:func:`available_methods`, :func:`make_method`, :class:`Method`, :class:`Budget`, :class:`GenerationResult`,
:data:`DEFAULT_MODEL`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from slake import methods  # noqa: F401  (registers every method)
from slake.budgets.budget import Budget
from slake.engines.result import GenerationResult
from slake.methods import Method, available_methods, make_method

if TYPE_CHECKING:
    from slake.engines.transformers.attention import prepare_model
    from slake.engines.transformers.cache import SlakeCache
    from slake.engines.transformers.generate import generate
    from slake.engines.transformers.models import DEFAULT_MODEL, load_model

__version__ = "0.1.0"

#: the public names that need transformers, imported when first asked for (``import slake`` alone does not import
#: transformers: the ``slake`` command parses and checks its arguments, and switches on Triton's interpreter for
#: ``--kernels triton`` on a machine without CUDA, before transformers imports Triton)
_LAZY = {
    "prepare_model": "slake.engines.transformers.attention",
    "SlakeCache": "slake.engines.transformers.cache",
    "generate": "slake.engines.transformers.generate",
    "DEFAULT_MODEL": "slake.engines.transformers.models",
    "load_model": "slake.engines.transformers.models",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slake' has no attribute {name!r}")


__all__ = [
    "Budget",
    "DEFAULT_MODEL",
    "GenerationResult",
    "Method",
    "SlakeCache",
    "available_methods",
    "generate",
    "load_model",
    "make_method",
    "prepare_model",
]
