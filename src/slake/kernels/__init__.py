"""Fused Triton kernels for the single-token decode step (:mod:`slake.kernels.triton_decode`).

Nothing here imports Triton until the kernels are asked for (:func:`load`), so slake runs without it. On a machine
without CUDA the kernels run through Triton's interpreter: :func:`load` sets ``TRITON_INTERPRET=1`` before it
imports them (unless the variable is already set), which is how ``make test`` checks them against the torch step on
the CPU. The adapter from a layer's slots to the kernels' arguments, and the choice between them and the torch step,
is :mod:`slake.cache.fused_step`. With ``SLAKE_TRITON_COMPILE_LOG=PATH`` set, :func:`load` logs each compilation of
the kernels to ``PATH`` (:mod:`slake.kernels.compile_log`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["MIN_TRITON", "host_layer", "interpreted", "launch_mode", "load", "triton_available", "triton_version"]

#: the oldest Triton the fused kernels run on: from 3.4 (torch 2.8's) to 3.9 they compile for sm_90 and 3.4 to 3.7
#: run them in the interpreter (``docs/gpu.md``, "On other versions of Triton"); 3.3 (torch 2.7's) has neither the
#: run-time knobs the launches read nor an interpreter that takes the kernels
MIN_TRITON = (3, 4)


def triton_available() -> bool:
    """True when Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def triton_version() -> tuple[int, ...]:
    """The installed Triton's release as integers (``"3.6.0"``, ``"3.4.0+rocm6.4"`` -> ``(3, 6, 0)``, ``(3, 4, 0)``).
    Imports Triton: on a machine without CUDA, only after :func:`load` has switched the interpreter on."""
    import triton

    from slake.release import release

    return release(triton.__version__)


def interpreted() -> bool:
    """True when Triton kernels run through its interpreter (``TRITON_INTERPRET=1``), i.e. on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def host_layer(tensor: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``tensor`` (None when they can): it is not on a CUDA device and Triton's
    interpreter is off. ``kernels="auto"`` chooses the fused kernels at a generation's first layer on a GPU
    (:meth:`slake.cache.compressed.CompressedKV.kernel_choice_due`), so a model that keeps some layers' caches on the
    CPU and others on a GPU reaches a step with host tensors, which Triton refuses; such a layer takes the torch step.
    On a GPU layer, one attribute read."""
    if tensor.is_cuda:
        return None
    return None if interpreted() else f"a layer on the {tensor.device.type} (the kernels launch on GPUs)"


def launch_mode() -> str:
    """How the fused kernels are launched now: ``"interpreter"`` (Triton's interpreter, CPU tensors), ``"cached"``
    (:class:`slake.kernels.launch_cache.CachedLaunch` on an NVIDIA GPU) or ``"triton"`` (``kernel[grid](...)`` at
    every launch: with :data:`slake.kernels.launch_config.CACHED_LAUNCH` off, and on AMD GPUs,
    :func:`slake.kernels.launch_cache.cached`). ``slake bench`` records it in its rows.

    Before :func:`load` has run, the mode it will set: ``"interpreter"`` on a machine where torch sees no CUDA device
    (:func:`load` switches the interpreter on there), with one exception: a ROCm build of torch (``torch.version.hip``)
    answers ``"triton"``, the mode of its GPUs, even where it sees none.

    Returns
    -------
    str
        ``"interpreter"``, ``"cached"`` or ``"triton"``.
    """
    import torch

    from slake.kernels import launch_config

    if interpreted():
        return "interpreter"
    if torch.version.hip is not None:
        return "triton"
    if not torch.cuda.is_available():
        return "interpreter"
    return "cached" if launch_config.CACHED_LAUNCH else "triton"


def load() -> ModuleType:
    """The kernel module, imported on first use (ImportError without Triton).

    Without CUDA the interpreter is switched on first (``TRITON_INTERPRET=1``): Triton decides when a function is
    defined whether it is compiled or interpreted, its own library functions included, so this works only before
    ``triton.language`` is imported (``torch._dynamo`` imports it); otherwise RuntimeError says to set the variable
    before Python starts."""
    import torch

    if not interpreted() and not torch.cuda.is_available():
        if "triton.language" in sys.modules:
            raise RuntimeError(
                "Triton kernels on the CPU run through Triton's interpreter, which must be switched on before Triton "
                "is imported: set TRITON_INTERPRET=1 in the environment before starting Python"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    from slake.kernels import triton_decode

    log = os.environ.get("SLAKE_TRITON_COMPILE_LOG")
    if log and not interpreted():  # the compilations of this process, logged (slake.kernels.compile_log)
        from slake.kernels import compile_log

        if compile_log._path is None:
            compile_log.install(log)
    return triton_decode
