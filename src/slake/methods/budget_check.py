"""Whether a (method, budget) pair can run at all, checked before any model work (``docs/conventions.md``)."""

from __future__ import annotations

from slake.budgets.budget import Budget
from slake.methods.base import Method, make_method

__all__ = ["check_budget_at_length", "check_method_budget"]


def check_method_budget(method: Method | str, budget: Budget | int | float | str) -> tuple[Method, Budget]:
    """The method and budget a compressor would run, or ValueError for a pair it would refuse.

    Parameters
    ----------
    method : Method or str
        A method object or spec (``"slake[vabs=false]"``).
    budget : Budget, int, float or str
        Average cached tokens per layer and KV head (window included), or a ratio of the prompt in (0, 1).

    Raises
    ------
    ValueError
        For an unknown method or hyperparameter, a bad budget, protected tokens (window + sinks) that exceed an
        absolute budget (a layer could not keep its window), or a ``max_layer_budget`` below an absolute budget
        (methods without a linear cache; with one, the prefill refuses it, after the charge of the linear state).
    """
    m = make_method(method)
    b = budget if isinstance(budget, Budget) else Budget(budget)
    if not b.is_ratio and not m.keeps_everything and m.protected > b.value:
        raise ValueError(
            f"{m.name}: the protected tokens (window {m.window} + sinks {m.sinks}) exceed the "
            f"budget {b.value}; use a larger budget or a smaller window"
        )
    cap = getattr(m, "max_layer_budget", None)
    if not b.is_ratio and cap is not None and cap < b.value and not getattr(m, "linear_cache", False):
        # as the prefill refuses it; with a linear cache the budget may be charged for the linear state
        # (charge_linear_state), which lowers it by a head-size-dependent amount: left to the prefill
        raise ValueError(
            f"{m.name}: max_layer_budget={cap} is below the average budget {b.value}; the layers could not hold "
            f"the total budget"
        )
    return m, b


def check_budget_at_length(method: Method | str, budget: Budget | int | float | str, length: int) -> None:
    """Raise ValueError where a ratio ``budget`` of a ``length``-token prompt leaves fewer tokens than the method
    protects (window + sinks, and at least one), or more than its ``max_layer_budget`` (as
    :func:`check_method_budget` refuses an absolute budget): the prefill refuses either, but only once the model has
    loaded and, in a sweep, after the configurations before it ran. An absolute budget is
    :func:`check_method_budget`'s; a prompt within its budget is not compressed and is not refused.

    Parameters
    ----------
    method : Method or str
        A method object or spec.
    budget : Budget, int, float or str
        The budget; only a ratio is checked here.
    length : int
        The prompt's length in tokens, where a command knows it before loading (``bench --lengths``,
        ``calibrate --length``) or before running (``eval``'s encoded prompts).
    """
    m = make_method(method)
    b = budget if isinstance(budget, Budget) else Budget(budget)
    if not b.is_ratio or m.keeps_everything:
        return
    tokens = b.tokens(length)
    if length > tokens and tokens < max(1, m.protected):
        raise ValueError(
            f"{m.name}: budget {b.value} of a {length}-token prompt is {tokens} tokens, fewer than the protected "
            f"window + sinks ({m.protected}); use a larger ratio, longer prompts or a smaller window"
        )
    cap = getattr(m, "max_layer_budget", None)
    if length > tokens and cap is not None and cap < tokens and not getattr(m, "linear_cache", False):
        # as check_method_budget refuses an absolute budget above the cap (a linear cache's charge is the prefill's)
        raise ValueError(
            f"{m.name}: budget {b.value} of a {length}-token prompt is {tokens} tokens, above max_layer_budget={cap}; "
            f"the layers could not hold the total budget"
        )
