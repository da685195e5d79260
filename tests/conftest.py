"""Shared fixtures; Triton's interpreter on machines without a GPU (the fused decode kernels' tests run their
kernels on CPU tensors through it; it must be switched on before Triton is imported); and the tests' CPU threads.

Threads: torch's OpenMP threads spin while they wait for work. On the two-core CI machine beside another job, that
spinning made the unit tests 8.7x slower (three test files: 13.6 minutes instead of 1.6; ``make test`` once took
25 minutes), so waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``, read when torch loads OpenMP, hence set before
``import torch``; subprocesses inherit it), and the unit tests, on tiny tensors where a second thread gains nothing
(1.5 minutes idle with one thread or two), run on one: 2.8 minutes beside the same job. The tests on real weights
(marker ``integration``) keep torch's default, where two threads pay (140 s against 187 s for the heaviest one)."""

from __future__ import annotations

import os
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidiactl").exists():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

#: torch's own thread count in this process, before any test changes it
DEFAULT_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _threads(request):
    """One torch thread for a unit test; torch's default for a test on real weights (module docstring). Set for every
    test, so that one that changes the count (``slake bench --threads``) leaves nothing behind."""
    torch.set_num_threads(DEFAULT_THREADS if request.node.get_closest_marker("integration") else 1)


@pytest.fixture(scope="session")
def llama_gqa():
    return tiny_model("llama-gqa")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset before and after the test (compiled-decoding tests: no graph carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
