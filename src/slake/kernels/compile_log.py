"""A log of the fused kernels' compilations in this process: one JSON line per kernel specialization Triton compiled.

With ``SLAKE_TRITON_COMPILE_LOG=PATH`` in the environment, :func:`slake.kernels.load` sets Triton's
``jit_post_compile_hook`` to :func:`record`, which appends to ``PATH`` each compilation of a kernel of slake's (and
of the tests' probe kernels): the kernel's module and name and Triton's own serialization of the launch's
specialization (signature, constants, attributes, options; ``triton.runtime.jit.serialize_specialization_data``),
which ``JITFunction.preload`` compiles again. A GPU session logs what it compiled (``benchmarks/gpu_session.sh``), and
the next build of Triton's cache without a GPU (``benchmarks/warm_cache.py``, its ``recorded`` part) compiles the
same specializations of the kernels as they are then, so that they load on the next GPU instead of compiling.
Appends are one ``write`` of one line each, so processes running side by side may share the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ENV", "MODULES", "install", "read", "record"]

#: the environment variable naming the log file
ENV = "SLAKE_TRITON_COMPILE_LOG"
#: the modules whose kernels are logged (slake's, and the tests' probe kernels)
MODULES = ("slake.", "kernel_probes")

_path: Path | None = None


def record(*, fn: Any, compile: dict, **_: Any) -> None:
    """Triton's ``jit_post_compile_hook``: append the compiled specialization of one of :data:`MODULES`' kernels to
    the log (``fn``: Triton's ``JitFunctionInfo``; ``compile``: the compilation's facts, ``specialization_data``
    among them). Returns None (Triton reads nothing from a post-compile hook)."""
    if _path is None or not str(fn.module).startswith(MODULES):
        return
    line = json.dumps({"module": fn.module, "name": fn.name, "specialization": compile["specialization_data"]})
    with open(_path, "a") as f:
        f.write(line + "\n")


def install(path: str | os.PathLike[str]) -> None:
    """Log every later compilation of this process's kernels to ``path`` (:func:`record`), in place of any
    post-compile hook set before."""
    global _path
    from triton import knobs

    _path = Path(path)
    _path.parent.mkdir(parents=True, exist_ok=True)
    knobs.runtime.jit_post_compile_hook = record


def read(path: str | os.PathLike[str]) -> list[dict]:
    """The entries of a log, each distinct once, in the order first logged: ``{"module", "name",
    "specialization"}``."""
    seen: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
    return list(seen.values())
