"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch

from tiny_models import tiny_model


@pytest.fixture(scope="session")
def llama_gqa():
    return tiny_model("llama-gqa")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset before and after the test (compiled-decoding tests: no graph carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
