"""Plots drawn only where matplotlib is installed: it is an optional dependency (``pip install 'slake[eval]'``).

Every command that draws plots (``slake eval``, ``bench``, ``fidelity``, ``bench --serve``) has written its rows and
tables before it draws; without matplotlib the plots are skipped with one line on standard error, and the command
succeeds with what it measured.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["INSTALL_HINT", "draw_if_possible", "set_log_y"]

#: how to get the plots
INSTALL_HINT = "install matplotlib: pip install 'slake[eval]'"

T = TypeVar("T")


def draw_if_possible(command: str, draw: Callable[[], T]) -> T | None:
    """``draw()``'s result, or None (with a line on standard error naming ``command``) when matplotlib is missing.

    Parameters
    ----------
    command : str
        The command drawing, as the line names it (``"slake bench"``).
    draw : callable
        Draws the plots; imports matplotlib itself.

    Returns
    -------
    object or None
        What ``draw`` returned, or None when it could not import matplotlib. Any other ``ImportError`` is raised.
    """
    try:
        return draw()
    except ImportError as e:
        if not (e.name or "").startswith("matplotlib"):
            raise
        print(f"{command}: no plots ({e}); {INSTALL_HINT}", file=sys.stderr)
        return None


def set_log_y(ax: Any, values: Iterable[float]) -> None:
    """Give the matplotlib axes ``ax`` a log y axis for the non-negative ``values`` it draws, or, where one of them is
    0, a symmetric-log one that is linear below the smallest positive value (``1e-6`` where none is positive), so that
    0 is drawn at 0: a log axis has no place for it and would clip it to an edge. NaN values are not looked at."""
    finite = [v for v in values if not math.isnan(v)]
    if any(v == 0 for v in finite):
        ax.set_yscale("symlog", linthresh=min((v for v in finite if v > 0), default=1e-6))
    else:
        ax.set_yscale("log")
