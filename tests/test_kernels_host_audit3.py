"""The host side of the fused decode step: how ``kernels="auto"|"torch"|"triton"`` is resolved (third audit of
:mod:`slake.cache.fused_step`, :mod:`slake.kernels` and :func:`slake.cache.compressed.kernel_choice`; each test
failed before its fix).

1. ``kernels="auto"`` on an NVIDIA GPU read the installed Triton's version (which imports Triton) before loading the
   kernels, so a Triton that is installed but cannot be imported escaped as a raw ImportError, where the docstring
   and ``kernels="triton"`` give a ValueError that says what is wrong.
"""

from __future__ import annotations

import pytest
import torch

import slake.kernels
from slake.cache import compressed
from slake.cache.compressed import CompressedKV, resolve_kernels
from slake.methods import make_method

#: runs the same under any transformers (none is loaded here)
pytestmark = pytest.mark.transformers_free


def _unimportable() -> tuple[int, ...]:
    raise ImportError("libtriton.so: undefined symbol: _ZN4c10")


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_an_installed_triton_that_cannot_be_imported_is_a_value_error_under_auto(kernels, monkeypatch):
    """A Triton that is installed (found) but fails to import: ``"auto"`` on an NVIDIA GPU is refused with the
    ValueError ``"triton"`` gives (it raised the ImportError from reading Triton's version). Only the device's type is
    read, so ``"cuda"`` stands in on this CPU."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(slake.kernels, "triton_available", lambda: True)
    monkeypatch.setattr(slake.kernels, "triton_version", _unimportable)
    if kernels == "triton":  # "triton" loads the kernels first, which imports Triton too
        monkeypatch.setattr(slake.kernels, "load", _unimportable)
    with pytest.raises(ValueError, match="undefined symbol"):
        resolve_kernels(kernels, "cuda")
    with pytest.raises(ValueError, match="undefined symbol"):
        compressed.kernel_choice(kernels, "cuda:1")


def test_auto_on_the_cpu_does_not_import_triton(monkeypatch):
    """The CPU's ``"auto"`` is the torch step without reading Triton at all, so a broken Triton does not stop it (nor
    a cache made with the default choice)."""
    monkeypatch.setattr(slake.kernels, "triton_version", _unimportable)
    monkeypatch.setattr(slake.kernels, "load", _unimportable)
    assert compressed.kernel_choice("auto", "cpu") == ("torch", None)
    assert resolve_kernels("auto") == "torch"
    CompressedKV(make_method("snapkv", window=4), 16, 1)
