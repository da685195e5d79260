"""How slake compiles a decode step: ``torch.compile``'s arguments, and which of dynamo's guards it keeps.

Every call of a compiled function first checks its guards: conditions on the inputs under which the compiled code is
valid. A transformers model passed to a compiled decode step is guarded attribute by attribute, module by module
(each module's hook dictionaries, its ``__dict__``, its parameters' dtypes, shapes and strides): on a random
Llama-3-8B shape of 32 layers (small widths) a compiled SLAKE step checked 4,308 guards in 1.83 ms on this project's
two-core CPU (``python -m benchmarks compile-guards``, ``docs/compile.md#guards``), host work in front of every
compiled step, before its CUDA graph is replayed (the H200 showed 1.4 ms of host work around a 9.5 ms step).

:func:`decode_guard_filter` (torch's ``guard_filter_fn``) keeps every guard on the cache, the input tokens and the
global state, and drops the guards on the model's modules except those on its tensors outside the repeated blocks
(embeddings, final norm, output head: their dtype, device and shape change with any ``model.to(...)``) and on the
model object itself: 1,777 guards in 0.25 ms on the model above. This is torch's
``skip_guard_on_all_nn_modules_unsafe`` with those tensors kept, and it has the same assumption, which the docs state
(``docs/compile.md#guards``): **a compiled step assumes the model's modules do not change while it is used** (hooks
added, submodules replaced, settings of the config the modules read, a block's parameters swapped for tensors of
another dtype or shape). Weights updated in
place are fine: parameters are inputs of the graph, read at every call. Each model gets its own compiled function
(transformers' ``model._compiled_call``, :func:`slake.engines.transformers.measure.compiled_step`), so another model
never runs a graph traced for this one; a cache of another shape, method or dtype still recompiles, since every guard
on the cache is kept.

``lean_guards=False`` keeps every guard (torch's default). Where this torch has no guard filter (before 2.7), or one
that stops on a guard it cannot evaluate (2.7 and 2.8, :data:`GUARD_FILTER_TORCH`), every guard is kept.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from slake.release import release

__all__ = [
    "GRAPHS_AT_LEAST",
    "GUARD_FILTER_TORCH",
    "compile_kwargs",
    "decode_guard_filter",
    "guard_filter_supported",
    "make_room_for_graphs",
    "recompile_limit_error",
    "uncompilable_reason",
]

#: the fewest graphs of one model's step that compiled decoding lets dynamo keep (its default limit is 8): slake
#: compiles one graph per cache shape, which changes with the batch, the method, its budget and layer budgets, the
#: storage, and for an uncompressed cache the padded prompt length and the new tokens
GRAPHS_AT_LEAST = 64

#: a module inside a ``ModuleList`` or ``Sequential`` (``_modules['12']``): the model's repeated blocks
_NUMBERED_MODULE = re.compile(r"\[\s*'\d+'\s*\]|\[\s*\"\d+\"\s*\]")
#: a bare local or closure name: the compiled function's argument itself (``model``, ``self``), not an attribute
_ROOT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


#: the first torch whose guard filter survives a guard it cannot evaluate: torch 2.7 and 2.8 take ``guard_filter_fn``
#: but evaluate every guard's expression for it, and a guard that an attribute is absent (transformers 5.24's config
#: raises AttributeError for ``config.decoder``) stopped the compilation (``InternalTorchDynamoError``); 2.9 catches it
GUARD_FILTER_TORCH = (2, 9)


def guard_filter_supported() -> bool:
    """Whether this torch takes ``guard_filter_fn`` in ``torch.compile``'s options and survives guards it cannot
    evaluate for the filter (torch 2.9 and later: :data:`GUARD_FILTER_TORCH`)."""
    return (
        hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")
        and release(torch.__version__) >= GUARD_FILTER_TORCH
    )


def decode_guard_filter(entries: Sequence[Any]) -> list[bool]:
    """Which of a compiled decode step's guards to keep (torch's ``guard_filter_fn``; ``entries`` are dynamo's
    ``GuardFilterEntry`` objects: ``name``, ``guard_type``, ``orig_guard.source``).

    Kept: every guard whose source is not an attribute of an ``nn.Module`` (the cache, its tensors and Python
    state, the tokens, globals, grad mode and the other global state); of the guards on modules, the tensor guards
    (``TENSOR_MATCH``) of tensors outside numbered submodules (a ``ModuleList``'s blocks), and the guards on the
    model argument itself. Dropped: the other guards on modules (hook dictionaries, module ``__dict__`` contents, the
    blocks' parameters). See the module's docstring for what that assumes.
    """
    keep = []
    for entry in entries:
        if not entry.orig_guard.source.is_unspecialized_nn_module():
            keep.append(True)
        elif entry.guard_type == "TENSOR_MATCH":
            keep.append(not _NUMBERED_MODULE.search(entry.name))
        else:
            keep.append(bool(_ROOT.match(entry.name)))
    return keep


def compile_kwargs(device: torch.device | str, *, lean_guards: bool = True) -> dict[str, Any]:
    """Keyword arguments of ``torch.compile`` for a decode step on ``device``: one graph (``fullgraph=True``), fixed
    shapes (``dynamic=False``), CUDA graphs on CUDA (``mode="reduce-overhead"``, given as its inductor options when a
    guard filter is given too, since ``torch.compile`` takes ``mode`` or ``options``, not both), and
    :func:`decode_guard_filter` when ``lean_guards`` and this torch has guard filters."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    kwargs: dict[str, Any] = {"fullgraph": True, "dynamic": False}
    if lean_guards and guard_filter_supported():
        from torch._inductor import list_mode_options

        kwargs["options"] = {**list_mode_options(mode), "guard_filter_fn": decode_guard_filter}
    else:
        kwargs["mode"] = mode
    return kwargs


def make_room_for_graphs(graphs: int = GRAPHS_AT_LEAST) -> None:
    """Raise dynamo's recompile limits (never lower them) so that one compiled function may keep ``graphs`` graphs
    (at least :data:`GRAPHS_AT_LEAST`): a compiled decode step has one per cache shape, and with ``fullgraph=True``
    the default limit of 8 turns the ninth shape of a process into a hard failure. Process-wide, as dynamo's
    configuration is."""
    graphs = max(int(graphs), GRAPHS_AT_LEAST)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * graphs)


def recompile_limit_error(exc: BaseException) -> ValueError | None:
    """A ValueError that says what to do when ``exc`` is dynamo's recompile limit (``FailOnRecompileLimitHit``, after
    a compiled step's graphs of one process reached ``torch._dynamo.config.recompile_limit``), else None."""
    if type(exc).__name__ not in ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded"):
        return None
    limit = torch._dynamo.config.recompile_limit
    return ValueError(
        f"torch.compile reached its limit of {limit} graphs for the model's step in this process: compiled decoding "
        f"makes one graph per cache shape (batch size, method, budget and layer budgets, kv_dtype, and for a prompt "
        f"within the budget its padded length and the new tokens); call torch._dynamo.reset() to start afresh, or "
        f"raise torch._dynamo.config.recompile_limit ({type(exc).__name__}: {str(exc)[:200]})"
    )


def uncompilable_reason(model: Any) -> str | None:
    """Why ``model``'s decode step cannot be compiled, or None: transformers' ``model.generate`` declines to compile
    (with a warning, and decodes eagerly) a model quantized by a method it does not compile
    (``model.hf_quantizer.is_compileable`` false) or one that accelerate offloads to the CPU or to disk
    (``model.hf_device_map``), since compiling those crashes. slake refuses them up front instead: before
    2026-12-02 ``slake.generate(compile=True)`` answered eagerly and reported the first eager step as ``compile_s``.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
        return f"it is quantized by a method that torch.compile does not take ({method or type(quantizer).__name__})"
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict):
        places = {str(v) for v in device_map.values()}
        if "disk" in places:
            return "accelerate offloads some of its weights to disk (device_map)"
        if "cpu" in places and len(places) > 1:
            return "accelerate offloads some of its weights to the CPU (device_map)"
    return None
