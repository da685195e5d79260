"""Whether a (method, budget) pair can run at all, checked before any model work (``docs/conventions.md``)."""

from __future__ import annotations

from slake.budgets.budget import Budget
from slake.methods.base import Method, make_method

__all__ = ["check_method_budget"]


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
