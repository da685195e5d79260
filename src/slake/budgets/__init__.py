"""Budgets: the :class:`Budget` value a user gives (:mod:`slake.budgets.budget`) and the rules that split a total
budget across layers and KV heads (:mod:`slake.budgets.allocation`). Pure tensor math; imports nothing else of slake."""

from slake.budgets.allocation import (
    cross_head_counts,
    largest_remainder,
    preference_budgets,
    pyramid_budgets,
    safeguarded_head_counts,
    uniform_budgets,
    waterfill,
)
from slake.budgets.budget import Budget

__all__ = [
    "Budget",
    "cross_head_counts",
    "largest_remainder",
    "preference_budgets",
    "pyramid_budgets",
    "safeguarded_head_counts",
    "uniform_budgets",
    "waterfill",
]
