"""PyramidKV: SnapKV's indicator with budgets decreasing linearly with depth.

See ``docs/methods/baselines.md#pyramid-budgets``.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024.
Budgets follow the KVCache-Factory (October 2024) formula with ``beta = 20``: layer 0 gets the most; see
:func:`slake.budgets.allocation.pyramid_budgets`. Deviation (switchable): by default the linear step is not floored and
the budgets are rounded by largest remainder, so they sum exactly to ``L * C'`` (``docs/conventions.md#budgets``); the
reference formula floors the step and overshoots the total by up to ``L^2 / 2`` tokens (``exact=False``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.budgets.allocation import pyramid_budgets
from slake.methods.base import register
from slake.methods.snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV scoring with pyramid layer budgets.

    Parameters
    ----------
    beta : float
        The mean layer budget ``C'`` over the smallest: ``min = C' / beta`` and ``max = 2 C' - min``, so the largest
        is ``2 * beta - 1`` times the smallest (unless capped at the prompt less the window, which raises the
        smallest). Must be > 0.5, where the largest stays above 0 (1 gives uniform budgets; below 1 layer 0 gets the
        least).
    exact : bool
        Round so that the layer budgets sum exactly to the total (default); False reproduces the reference code.
    """

    beta: float = 20.0
    exact: bool = True

    name: ClassVar[str] = "pyramidkv"
    summary: ClassVar[str] = "SnapKV scoring with budgets decreasing linearly with depth"
    paper: ClassVar[str] = (
        "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, 2024"
    )
    layer_budgets: ClassVar[str] = "pyramid"

    def __post_init__(self) -> None:
        super().__post_init__()  # beta finite
        if not self.beta > 0.5:
            raise ValueError(
                f"{self.name}: beta must be > 0.5 (the smallest layer budget is C'/beta, the largest 2C' less it), "
                f"got {self.beta}"
            )

    #: every layer gets ``C'`` for prompts under ``2 C'`` (the reference's SnapKV fallback; AdaKV's form has none)
    snapkv_fallback: ClassVar[bool] = True

    def pyramid_schedule(self, num_layers: int, selectable: int, prompt_len: int) -> torch.Tensor:
        """Pyramid budgets (``docs/methods/baselines.md#pyramid-budgets``), layer 0 largest."""
        # a layer is never emptied: without protected tokens the deepest layers keep at least one. The cap is
        # S - protected, the candidates' count: S - window left the sinks' share of the top layer unspent
        return pyramid_budgets(
            num_layers,
            selectable,
            prompt_len,
            self.protected,
            self.beta,
            exact=self.exact,
            snapkv_fallback=self.snapkv_fallback,
            min_layer=0 if self.protected else 1,
        )
