"""Shared fixtures, and Triton's interpreter on machines without a GPU (the fused decode kernels' tests run their
kernels on CPU tensors through it; it must be switched on before Triton is imported)."""

from __future__ import annotations

import os
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidiactl").exists():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny_models import tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def llama_gqa():
    return tiny_model("llama-gqa")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset before and after the test (compiled-decoding tests: no graph carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
