"""slake: KV-cache compression for Hugging Face transformers.

Quick start::

    import slake
    model, tokenizer = slake.load_model()            # SmolLM2-135M-Instruct, packaged GGUF, offline
    result = slake.generate(model, tokenizer, long_prompt, method="slake", budget=128)
    print(result.text, result.kv_bytes)

Public names: :func:`load_model`, :func:`generate`, :class:`SlakeCache`, :func:`prepare_model`,
:func:`available_methods`, :func:`make_method`, :class:`Budget`.
"""

from slake import methods  # noqa: F401  (registers every method)
from slake.budgets.budget import Budget
from slake.engines.result import GenerationResult
from slake.engines.transformers.attention import prepare_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import generate
from slake.engines.transformers.models import DEFAULT_MODEL, load_model
from slake.methods import Method, available_methods, make_method

__version__ = "0.1.0"

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
