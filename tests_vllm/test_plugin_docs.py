"""Every class and function the vLLM plugin's modules export, and each public method of those classes, has a
docstring (inherited from vLLM's own classes counts): ``tests/test_cli_docs_audit.py`` checks the rest of slake, in
an environment without vLLM."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_every_exported_name_and_public_method_of_the_plugin_has_a_docstring():
    # the pool's paged slots and three of the backend's overrides had none
    spec = importlib.util.spec_from_file_location(
        "public_docs", Path(__file__).resolve().parents[1] / "tests" / "public_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.undocumented("slake.engines.vllm")
