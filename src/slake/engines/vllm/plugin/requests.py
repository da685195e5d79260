"""Front-end side of the plugin: a request that asks for slake options of its own is refused, not served silently.

The method, the budget and ``set`` are per engine (``--additional-config '{"slake": {...}}'``). A request can carry
``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI server's request body), which vLLM passes along to
custom extensions; before this check, an ``extra_args`` entry named ``slake`` was read by nothing: the request got
an answer at the engine's method and budget (or uncompressed, on an engine without slake), and nothing said so.
:func:`install` wraps ``InputProcessor._validate_params``, which vLLM runs on every request at admission in the
process that receives it (the OpenAI server answers HTTP 400, ``LLM.generate`` raises), so such a request is refused
with one line that says what to do instead (docs/vllm.md, "Configuration").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ``extra_args`` keys slake claims: ``slake`` itself and any ``slake_...`` / ``slake.`` variant
_PREFIXES = ("slake_", "slake.", "slake-")


def slake_keys(extra_args: Any) -> list[str]:
    """The keys of a request's ``extra_args`` that name slake options (``slake``, ``slake_*``), sorted; [] when the
    request carries none (or no ``extra_args``)."""
    if not isinstance(extra_args, Mapping):
        return []
    return sorted(
        str(k) for k in extra_args if isinstance(k, str) and (k.lower() == "slake" or k.lower().startswith(_PREFIXES))
    )


def refusal(keys: list[str]) -> str:
    """The message of a request refused for carrying the slake options ``keys``."""
    return (
        f"slake: a request cannot choose its own slake options (extra_args / vllm_xargs {keys}): the method, the "
        "budget and 'set' are per engine, given when it starts (--additional-config '{\"slake\": {...}}' or "
        "SLAKE_VLLM); drop them from the request, or start another engine for another configuration"
    )


def _wrap_validate(original):
    def _validate_params(self, params, *args, **kwargs):
        keys = slake_keys(getattr(params, "extra_args", None))
        if keys:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(refusal(keys), parameter="extra_args")
        return original(self, params, *args, **kwargs)

    _validate_params._slake = True
    _validate_params.__wrapped__ = original
    _validate_params.__doc__ = original.__doc__
    return _validate_params


def install() -> None:
    """Wrap ``InputProcessor._validate_params`` (idempotent: vLLM may load the plugin several times per process).

    The check holds for every engine of the process, configured for slake or not: a request naming slake options on
    a plain engine would otherwise be answered uncompressed without a word."""
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor._validate_params, "_slake", False):
        return
    InputProcessor._validate_params = _wrap_validate(InputProcessor._validate_params)
