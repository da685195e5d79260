"""Which classes, functions and public methods of slake's modules have no docstring (a docstring inherited from a
base class counts): the check of ``tests/test_cli_docs_audit.py`` and, for the vLLM plugin, which imports vLLM,
``tests_vllm/test_plugin_docs.py``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import slake


def undocumented(prefix: str, leave_out: tuple[str, ...] = ()) -> list[str]:
    """Qualified names without a docstring among the classes and functions exported (``__all__``) by each module of
    slake whose name starts with ``prefix`` and contains none of ``leave_out``, and the public methods of those
    classes."""
    exported = {}
    for info in pkgutil.walk_packages(slake.__path__, "slake."):
        if not info.name.startswith(prefix) or any(part in info.name for part in leave_out):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__.startswith("slake."):
                exported[f"{value.__module__}.{value.__qualname__}"] = value
    missing = [where for where, value in exported.items() if not inspect.getdoc(value)]
    missing += [
        f"{where}.{attr}"
        for where, cls in exported.items()
        if inspect.isclass(cls)
        for attr, value in vars(cls).items()
        if not attr.startswith("_") and callable(value) and not inspect.getdoc(getattr(cls, attr))
    ]
    return missing
