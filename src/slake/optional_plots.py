"""Plots drawn only where matplotlib is installed: it is an optional dependency (``pip install 'slake[eval]'``).

Every command that draws plots (``slake eval``, ``bench``, ``fidelity``, ``bench --serve``) has written its rows and
tables before it draws; without matplotlib the plots are skipped with one line on standard error, and the command
succeeds with what it measured.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

__all__ = ["INSTALL_HINT", "draw_if_possible"]

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
