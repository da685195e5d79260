"""The two changes ``tests/conftest.py`` makes to Triton's interpreter for speed, and nothing else.

* It computes a check of every int32 operation for overflow and drops it unread while its ``debug`` option is off
  (as a GPU launch's is); ``_no_discarded_overflow_checks`` has it not computed. These tests hold the premise: with
  the interpreter's own options an int32 product past 2**31 wraps, as on a GPU, without a word, so leaving the
  check out changes nothing; should a Triton make the check count without ``debug``, the first test fails.
* ``_numpy_types_looked_up_once`` keeps each Triton type's numpy type after its first lookup: the same answers as
  the interpreter's own lookup for scalars, blocks and pointers."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or triton.__version__ != "3.6.0",
    reason="the patch is for Triton 3.6.0's interpreter",
)

WRAPPED = (70_000**2 + 2**31) % 2**32 - 2**31


@triton.jit
def _product(x_ptr, y_ptr, B: tl.constexpr):
    o = tl.arange(0, B)
    v = tl.load(x_ptr + o)
    tl.store(y_ptr + o, v * v)


def _square(values: list[int]) -> list[int]:
    x = torch.tensor(values, dtype=torch.int32)
    y = torch.empty_like(x)
    _product[(1,)](x, y, B=x.numel())
    return y.tolist()


def _options(monkeypatch: pytest.MonkeyPatch, **changes) -> None:
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, **changes))


def test_the_interpreters_own_check_is_dropped_without_debug(monkeypatch):
    _options(monkeypatch, sanitize_overflow=True)
    assert _square([3, 70_000]) == [9, WRAPPED]


def test_the_check_counts_only_with_debug(monkeypatch):
    _options(monkeypatch, sanitize_overflow=True, debug=True)
    assert _square([3, 40_000]) == [9, 1_600_000_000]
    with pytest.raises(Exception, match="overflow"):
        _square([3, 70_000])


def test_the_unit_tests_leave_the_check_out_and_keep_debug_off():
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert options.sanitize_overflow is False and options.debug is False
    assert _square([3, 70_000]) == [9, WRAPPED]


def test_numpy_types_looked_up_once_are_the_interpreters_answers():
    from triton.runtime import interpreter

    lookup = interpreter._get_np_dtype
    own = lookup.own
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64, tl.float8e4nv, tl.float8e5]  # fmt: skip
    types = scalars + [tl.pointer_type(t) for t in scalars]
    types += [tl.block_type(t, shape) for t in types for shape in ([4], [2, 8])]
    for _ in range(2):  # the first lookup and the kept answer
        for t in types:
            assert lookup(t) == own(t), t
    assert lookup(tl.block_type(tl.float32, [4])) != lookup(tl.block_type(tl.bfloat16, [4]))
    assert lookup(tl.block_type(tl.pointer_type(tl.float16), [4])) == lookup(tl.pointer_type(tl.int8))
