"""Shared fixtures."""

from __future__ import annotations

import pytest

from tiny_models import tiny_model


@pytest.fixture(scope="session")
def llama_gqa():
    return tiny_model("llama-gqa")
