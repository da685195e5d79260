"""Ada-PyramidKV: PyramidKV's layer budgets and SnapKV scoring with AdaKV's adaptive per-head budgets.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024, on
PyramidKV (Cai et al., 2024): one of the LAVa paper's baselines (``docs/methods/lava.md#ada-snapkv-and-ada-pyramidkv``).
Each layer's selectable budget ``b_l`` follows PyramidKV's schedule (:class:`~slake.methods.pyramidkv.PyramidKV`,
``beta = 20``) as AdaKV's code computes it (``pyram_mode``): without KVCache-Factory's fallback to uniform budgets
for prompts shorter than twice the selectable budget (:func:`slake.budgets.allocation.pyramid_budgets`,
``snapkv_fallback=False``; before 2026-11-29 those prompts got uniform budgets here too); inside the layer the
``Hkv * b_l`` tokens are split across KV heads by one top-k over all heads with AdaKV's safeguard floor
``int(alpha * b_l)`` per head (see :mod:`slake.methods.ada_snapkv` for the exact rule and its deviation from the
AdaKV code's rounding).

Defaults follow the LAVa paper's comparison: window 32, max-pool 7. Storage is dense and padded to the longest head
(``docs/conventions.md#memory-and-byte-accounting``). Decode keeps every head at its post-prefill size
(``decode_eviction=False``: append-only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from slake.methods.ada_snapkv import AdaKVHeads
from slake.methods.base import register
from slake.methods.pyramidkv import PyramidKV

__all__ = ["AdaPyramidKV"]


@register
@dataclass
class AdaPyramidKV(AdaKVHeads, PyramidKV):
    """PyramidKV with AdaKV head budgets.

    Parameters
    ----------
    window, kernel, pooling : int, int, str
        Observation window and SnapKV pooling (32, 7, ``"max"``).
    beta, exact : float, bool
        PyramidKV's schedule (see :class:`~slake.methods.pyramidkv.PyramidKV`).
    alpha_safeguard : float
        AdaKV's per-head floor fraction (0.2; 0 = pure cross-head top-k, 1 = PyramidKV's uniform head split).
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    group_first: bool = True

    name: ClassVar[str] = "ada-pyramidkv"

    #: AdaKV's Ada-PyramidKV schedule: PyramidKV's pyramid at every prompt the engine compresses, without the
    #: uniform fallback below ``2 C'`` (``docs/methods/baselines.md#pyramid-budgets``)
    snapkv_fallback: ClassVar[bool] = False

    summary: ClassVar[str] = "PyramidKV layer budgets with AdaKV adaptive head budgets (cross-head top-k)"
    paper: ClassVar[str] = (
        "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for "
        "Efficient LLM Inference, 2024 (on PyramidKV, Cai et al., 2024)"
    )
