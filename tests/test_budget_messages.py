"""A budget that is neither a token count nor a ratio says so (a fractional token count such as 128.5 was refused
as a ratio out of range, which pointed a user who meant tokens the wrong way)."""

from __future__ import annotations

import pytest

from slake.budgets.budget import Budget


@pytest.mark.parametrize("value", [128.5, "128.5", 1.5])
def test_a_fractional_count_is_refused_as_neither_a_count_nor_a_ratio(value):
    with pytest.raises(ValueError, match=r"neither a token count \(an integer >= 1.*nor a ratio"):
        Budget(value)


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_values_at_or_below_zero_and_not_finite_keep_the_ratio_message(value):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        Budget(value)


@pytest.mark.parametrize(("value", "tokens"), [(128.0, 128), (128, 128), ("64", 64)])
def test_whole_counts_are_still_token_counts(value, tokens):
    assert Budget(value).value == tokens
