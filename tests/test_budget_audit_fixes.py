"""Budget handling and method construction: fixes from the 2026-12 audit of ``slake.budgets`` and method specs.

* A method built directly (``Cake(gamma=10**40)``) refused nothing of what ``make_method`` refuses for a float
  hyperparameter given as an integer: the value stayed an int, so the float32-range check never saw it, and the
  method differed from ``make_method``'s (``beta=20`` against ``beta=20.0``).
* An integer too large for a float, given to a float hyperparameter, raised ``OverflowError`` (naming no
  hyperparameter) instead of ``ValueError``.
* :func:`slake.budgets.preference_budgets` raised ``OverflowError`` for an infinite total and took ``True`` as 1.
* :func:`slake.methods.budget_check.check_budget_at_length` let a ratio resolving above ``max_layer_budget`` through,
  which the prefill then refused mid-run.
"""

from __future__ import annotations

import pytest
import torch

from slake.budgets import preference_budgets
from slake.methods import make_method
from slake.methods.budget_check import check_budget_at_length, check_method_budget
from slake.methods.cake import Cake
from slake.methods.pyramidkv import PyramidKV


def test_direct_construction_refuses_an_integer_beyond_float32() -> None:
    """An int for a float hyperparameter is range-checked as ``make_method`` checks it.

    Returns
    -------
    None
    """
    with pytest.raises(ValueError, match="within float32's range"):
        make_method("cake", gamma=10**40)
    with pytest.raises(ValueError, match="within float32's range"):
        Cake(gamma=10**40)


def test_direct_construction_equals_make_method() -> None:
    """``PyramidKV(beta=20)`` holds the float ``20.0``, as ``make_method`` builds it.

    Returns
    -------
    None
    """
    direct, named = PyramidKV(beta=20), make_method("pyramidkv", beta=20)
    assert type(direct.beta) is float and repr(direct) == repr(named)
    assert direct.hyperparameters() == named.hyperparameters()


@pytest.mark.parametrize("spec", ["pyramidkv[beta=" + "1" * 400 + "]", "cake[gamma=" + "9" * 320 + "]"])
def test_an_integer_too_large_for_a_float_is_a_value_error(spec: str) -> None:
    """A spec's huge integer for a float hyperparameter is refused with ValueError naming it.

    Parameters
    ----------
    spec : str
        A method spec with an integer beyond a float's range.

    Returns
    -------
    None
    """
    name = spec[spec.index("[") + 1 : spec.index("=")]
    with pytest.raises(ValueError, match=name):
        make_method(spec)


@pytest.mark.parametrize("total", [float("inf"), float("nan"), True])
def test_preference_budgets_refuses_a_non_integer_total(total: float) -> None:
    """An infinite, NaN or boolean total is refused (ValueError / TypeError), never an OverflowError or 1.

    Parameters
    ----------
    total : float
        The bad total.

    Returns
    -------
    None
    """
    with pytest.raises((ValueError, TypeError), match="total"):
        preference_budgets(torch.tensor([1.0, 2.0]), total, 4, final=True)
    with pytest.raises((ValueError, TypeError), match="cap"):
        preference_budgets(torch.tensor([1.0, 2.0]), 4, total, final=True)


def test_a_ratio_budget_above_max_layer_budget_is_refused_before_the_model() -> None:
    """A ratio resolving above ``max_layer_budget`` is refused by :func:`check_budget_at_length`, as
    :func:`check_method_budget` refuses the same absolute budget (the prefill refused it only mid-run).

    Returns
    -------
    None
    """
    with pytest.raises(ValueError, match="max_layer_budget=64"):
        check_method_budget("cake[max_layer_budget=64]", 500)
    with pytest.raises(ValueError, match="max_layer_budget=64"):
        check_budget_at_length("cake[max_layer_budget=64]", 0.5, 1000)
    check_budget_at_length("cake[max_layer_budget=64]", 0.5, 100)  # 50 tokens: within the cap
    check_budget_at_length("cake[max_layer_budget=64]", 0.999, 100)  # 100 tokens, the whole prompt: not compressed
    check_budget_at_length("slake[max_layer_budget=64]", 0.5, 1000)  # a linear cache's charge is left to the prefill
