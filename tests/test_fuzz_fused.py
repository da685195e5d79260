"""``tests/fuzz_fused.py`` keeps working: a few random cases of each part pass, the cases are reproducible from their
seed, and a kernel that differs from its reference is reported as a failed case with its configuration."""

from __future__ import annotations

import io

import pytest
import torch

import fuzz_fused

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free


@pytest.mark.parametrize(("part", "cases"), [("step", 3), ("pool", 2), ("dense", 4)])
def test_random_cases_of_each_part_pass(part, cases):
    out = io.StringIO()
    assert fuzz_fused.fuzz(part, cases, seed=7, out=out) == []
    assert out.getvalue().count("\nok ") + out.getvalue().startswith("ok ") == cases


def test_a_case_is_drawn_again_from_its_number():
    import random

    for draw, _ in fuzz_fused.PARTS.values():
        assert draw(random.Random(41), 41) == draw(random.Random(41), 41)


def test_a_kernel_that_differs_from_its_reference_is_a_failed_case(monkeypatch):
    reference = fuzz_fused.dense_tests._reference
    monkeypatch.setattr(fuzz_fused.dense_tests, "_reference", lambda *a: reference(*a) + 0.1)
    out = io.StringIO()
    assert fuzz_fused.fuzz("dense", 2, seed=7, out=out) == [0, 1]
    assert out.getvalue().startswith("FAIL 0 dense {'R'") and "Tensor-likes are not close" in out.getvalue()
    assert fuzz_fused.main(["dense", "--cases", "1", "--seed", "7"]) == 1
    assert torch.cuda.is_available() or fuzz_fused.os.environ.get("TRITON_INTERPRET") == "1"
