"""Ada-SnapKV: SnapKV scoring with AdaKV's adaptive per-head budgets (one top-k across the heads of a layer).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
2024, applied to SnapKV (Li et al., NeurIPS 2024) as in the LAVa paper's baselines
(``docs/methods/lava.md#ada-snapkv-and-ada-pyramidkv``; kvpress ``AdaKVPress``).

Scoring is SnapKV's (:class:`~slake.methods.snapkv.SnapKV`: summed observation-window attention, pooled, group mean over
the query heads of a KV head, the mean being AdaKV's own GQA rule,
``docs/methods/lava.md#ada-snapkv-and-ada-pyramidkv``). The layer keeps ``Hkv * b`` selectable tokens (``b`` = the
layer's per-head selectable budget); how many each KV head keeps comes from one top-k over all heads' scores, with
AdaKV's **safeguard**: every head first keeps its own best ``int(alpha * b)`` tokens (``alpha_safeguard = 0.2``, the
AdaKV and kvpress default), the rest of the layer's budget goes to the best remaining tokens of any head
(:func:`slake.budgets.allocation.safeguarded_head_counts`).

Choices and deviations:

* The safeguard follows kvpress ``AdaKVPress`` (floor tokens reserved first, exact layer total ``Hkv * b``) rather
  than the AdaKV code's ``round((1-alpha) * count + int(alpha * b))``, whose rounding can miss the total by a few
  tokens; both guarantee every head ``int(alpha * b)`` tokens. ``safeguard="reference"`` selects the AdaKV code's.
* GQA: the query heads of a KV head are averaged *before* the max pooling (``group_first=True``), as the AdaKV
  code (``gqa_support``, ``gqa_func="mean"``) and KVCache-Factory's ``AdaKVCluster`` do; pooling each query head
  first (``group_first=False``) keeps a different 2-4% of the entries (docs/faithfulness.md).
* Defaults follow the LAVa paper's comparison ("all methods use max-pool 7"): ``kernel=7``, ``pooling="max"``,
  ``window=32``; plain ``snapkv`` keeps the SnapKV class defaults (avg-pool 5).
* Storage: dense, padded to the longest head of the layer (``docs/conventions.md#memory-and-byte-accounting``); the
  padding is reported separately by ``LayerStore.byte_counts``. Decode keeps each head at its post-prefill size
  (SnapKV's decode rule per head); ``decode_eviction=False`` gives the original append-only decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.budgets.allocation import cross_head_counts, safeguarded_head_counts
from slake.methods.base import register
from slake.methods.decode_scope import DecodeScope
from slake.methods.snapkv import SnapKV

__all__ = ["AdaKVHeads", "AdaSnapKV", "adakv_head_budgets"]


def adakv_head_budgets(
    scores: torch.Tensor, selectable: torch.Tensor, alpha: float, safeguard: str = "exact"
) -> torch.Tensor:
    """AdaKV per-head selectable counts ``(B, Hkv)`` for a layer budget of ``Hkv * selectable`` (see module doc).

    ``safeguard="exact"``: floor tokens reserved first, exact total (kvpress ``AdaKVPress``). ``"reference"``: the
    AdaKV code's ``round((1 - alpha) * count + int(alpha * b))`` with ``count`` a head's share of one plain top-k
    over the layer (``AdaptiveSnapKVCluster.update_kv``); its sum can miss ``Hkv * b`` by a few tokens.
    """
    if safeguard == "reference":
        count = cross_head_counts(scores, selectable.to(scores.device) * scores.shape[1])
        floor = torch.floor(selectable.to(scores.device).double() * alpha).view(-1, 1)
        return torch.round((1.0 - alpha) * count.double() + floor).to(torch.int64)
    return safeguarded_head_counts(scores, selectable, alpha)


@dataclass
class AdaKVHeads(DecodeScope):
    """Mixin giving a window-score method AdaKV's head budgets (cross-head top-k with a safeguard floor).

    Parameters
    ----------
    alpha_safeguard : float
        Fraction of each head's uniform share it keeps whatever the other heads score (0.2; 0 = pure cross-head
        top-k, 1 = the uniform split).
    safeguard : str
        ``"exact"`` (kvpress form, exact layer total, default) or ``"reference"`` (the AdaKV code's rounding).
    decode_scope : str
        ``"head"`` (one eviction per step and KV head) or ``"layer"`` (across the layer's heads;
        :class:`~slake.methods.decode_scope.DecodeScope`).
    """

    alpha_safeguard: float = 0.2
    safeguard: str = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"{self.name}: alpha_safeguard must lie in [0, 1], got {self.alpha_safeguard}")
        if self.safeguard not in ("exact", "reference"):
            raise ValueError(f"{self.name}: safeguard must be 'exact' or 'reference', got {self.safeguard!r}")

    def head_budgets(
        self, scores: torch.Tensor, selectable: torch.Tensor, *, budget: torch.Tensor | None = None, final: bool = True
    ) -> torch.Tensor:
        """AdaKV split of the layer's ``Hkv * selectable`` tokens across its KV heads."""
        return adakv_head_budgets(scores, selectable, self.alpha_safeguard, self.safeguard)


@register
@dataclass
class AdaSnapKV(AdaKVHeads, SnapKV):
    """SnapKV with AdaKV head budgets.

    Parameters
    ----------
    window : int
        Observation window (32).
    kernel, pooling : int, str
        Pooling of the SnapKV score (7, ``"max"``: the LAVa paper's setting for every baseline).
    group_first : bool
        Average a KV head's query heads before pooling (True, the AdaKV code) or after (False).
    alpha_safeguard : float
        Fraction of each head's uniform share it keeps whatever the other heads score (0.2; 0 = pure cross-head
        top-k, 1 = SnapKV's uniform split).
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    group_first: bool = True

    name: ClassVar[str] = "ada-snapkv"
    summary: ClassVar[str] = "SnapKV scoring with AdaKV adaptive head budgets (cross-head top-k, safeguard 0.2)"
    paper: ClassVar[str] = (
        "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for "
        "Efficient LLM Inference, 2024 (on SnapKV, NeurIPS 2024)"
    )
