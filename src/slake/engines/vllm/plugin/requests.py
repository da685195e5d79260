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


#: why beam search is refused on an engine configured for slake
BEAM_SEARCH_REFUSAL = (
    "slake: beam search is not compressed on an engine with slake: vLLM runs it as one-token requests over the "
    "prompt plus each beam, and a request's only token comes from its exact prefill, so the beams would be plain "
    "vLLM's, each step re-prefilling (and compressing) the whole sequence; use greedy decoding or sampling (n, "
    "temperature) on this engine, or beam search on an engine without slake"
)


def slake_configured(vllm_config: Any) -> bool:
    """Whether the engine of ``vllm_config`` runs with slake (its ``additional_config`` or ``SLAKE_VLLM``)."""
    from slake.engines.vllm.plugin.config import _raw_from

    return vllm_config is not None and _raw_from(getattr(vllm_config, "additional_config", None)) is not None


def _wrap_offline_beam_search(original):
    def beam_search(self, *args, **kwargs):
        if slake_configured(getattr(getattr(self, "llm_engine", None), "vllm_config", None)):
            raise ValueError(BEAM_SEARCH_REFUSAL)
        return original(self, *args, **kwargs)

    beam_search._slake = True
    beam_search.__wrapped__ = original
    beam_search.__doc__ = original.__doc__
    return beam_search


def _wrap_online_beam_search(original):
    async def beam_search(self, *args, **kwargs):
        if slake_configured(getattr(getattr(self, "engine_client", None), "vllm_config", None)):
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(BEAM_SEARCH_REFUSAL, parameter="use_beam_search")
        async for output in original(self, *args, **kwargs):
            yield output

    beam_search._slake = True
    beam_search.__wrapped__ = original
    beam_search.__doc__ = original.__doc__
    return beam_search


def install() -> None:
    """Wrap ``InputProcessor._validate_params`` and vLLM's beam search, offline (``LLM.beam_search``) and online
    (the OpenAI server's ``use_beam_search``), idempotently: vLLM may load the plugin several times per process.

    The request check holds for every engine of the process, configured for slake or not: a request naming slake
    options on a plain engine would otherwise be answered uncompressed without a word. Beam search is refused on an
    engine configured for slake only (:data:`BEAM_SEARCH_REFUSAL`)."""
    from vllm.v1.engine.input_processor import InputProcessor

    if not getattr(InputProcessor._validate_params, "_slake", False):
        InputProcessor._validate_params = _wrap_validate(InputProcessor._validate_params)
    try:
        from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
        from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    except ImportError:  # another layout of vLLM's entry points: the refusal cannot be installed
        return
    for mixin, wrap in ((BeamSearchOfflineMixin, _wrap_offline_beam_search),
                        (BeamSearchOnlineMixin, _wrap_online_beam_search)):  # fmt: skip
        if not getattr(mixin.beam_search, "_slake", False):
            mixin.beam_search = wrap(mixin.beam_search)
