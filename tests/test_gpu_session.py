"""``benchmarks/gpu_session.sh``, the prepared calls of a GPU session (``docs/gpu.md``): what it names exists and is
valid, so that a rare, short session does not lose a measurement to a typo found only on the GPU machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from benchmarks.__main__ import parse_variants
from slake.kernels import launch_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_test_the_smoke_step_names_exists():
    """The smoke step runs named tests (``tests/x.py::name``): each file and test function exists."""
    text = SCRIPT.read_text()
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(named) >= 4
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} is not a test there"


def test_every_kernel_tune_variant_is_a_valid_launch_constant():
    """The ``--variants`` of ``kernel-tune`` parse, and ``launch_config.tuned`` accepts each (which it checks)."""
    text = SCRIPT.read_text()
    chunks = re.findall(r'--variants "([^"]+)"', text)
    assert chunks
    for chunk in chunks:
        for variant in parse_variants(chunk):
            with launch_config.tuned(**variant):
                assert all(int(getattr(launch_config, k)) == v for k, v in variant.items())
