"""PyramidKV: SnapKV's indicator with budgets decreasing linearly with depth (spec ``slake-cake.md`` section 6).

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024.
Budgets follow the KVCache-Factory (October 2024) formula with ``beta = 20``: layer 0 gets the most; see
:func:`slake.budgets.pyramid_budgets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import register
from .snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV scoring with pyramid layer budgets.

    Parameters
    ----------
    beta : float
        Ratio between the largest and smallest layer budget (``min = C' / beta``).
    """

    beta: float = 20.0

    name: ClassVar[str] = "pyramidkv"
    summary: ClassVar[str] = "SnapKV scoring with budgets decreasing linearly with depth"
    paper: ClassVar[str] = "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, 2024"
    layer_budgets: ClassVar[str] = "pyramid"

    def pyramid_beta(self) -> float:
        """The pyramid's ``beta``."""
        return self.beta
