"""SnapKV: observation-window attention, pooled (``docs/methods/baselines.md#snapkv``).

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024.

Indicator ``I = G(pool(sum_i Abar[..., i, :]))`` over the non-window keys, ``Abar`` = attention of the last ``w``
prompt queries (rows not renormalised after removing the window columns). GQA: group-mean per KV head, so the cache
stays at KV-head granularity (our default GQA rule, ``docs/methods/README.md#gqa-reduction``; the original code
expanded the cache per query head).

Deviation from the original (documented, switchable): by default tokens are also evicted during decoding with
CAKE's rule (pooled attention of the current query), as CAKE and SLAKE did for every baseline; set
``decode_eviction=False`` for the original append-only decode. The decode rule group-averages, then pools; the
prefill with ``group_first=False`` pools each query head first: equal for ``pooling="avg"``, not for ``"max"``
(as CAKE's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import group_mean, pool1d, pooled_outside_window, window_attention


@register
@dataclass
class SnapKV(Method):
    """Observation-window voting with pooling.

    Parameters
    ----------
    window : int
        Observation window (default 32, as CAKE's comparisons): the queries that score and the recent tokens kept.
        0 keeps no recent token; the last query still scores (as at decode).
    kernel : int
        Pooling kernel (default 5, the SnapKV class default; the SnapKV LongBench configs use max-pool 7).
    pooling : str
        ``"avg"`` (default) or ``"max"``.
    group_first : bool
        GQA: average a KV head's query heads before pooling (AdaKV's and KVCache-Factory's code) instead of after
        (False, kvpress and the CAKE code). The two are equal for ``"avg"`` pooling (it is linear); they differ for
        ``"max"`` (docs/faithfulness.md).
    """

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    group_first: bool = False

    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "observation-window attention, pooled; uniform layer budgets"
    paper: ClassVar[str] = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024"

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Summed window attention over the non-window keys, pooled, group-mean."""
        # at least the last query observes, as at decode: with window=0 no query scored, every score was 0 and the
        # prompt's first tokens were kept
        a = window_attention(inputs.queries, inputs.keys, max(self.window, 1), inputs.scaling, inputs.key_padding)
        s = a.sum(2)  # (B,Hq,S)
        S = s.shape[-1]
        w = min(self.window, S)
        s[..., S - w :] = 0.0  # window columns are protected; keep them out of the neighbours' pooling
        Hkv = inputs.keys.shape[1]
        if self.group_first:
            return PrefillScores(scores=pool1d(group_mean(s, Hkv), self.kernel, self.pooling))
        return PrefillScores(scores=group_mean(pool1d(s, self.kernel, self.pooling), Hkv))

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule(
            "pooled_attention", group="mean", kernel=self.kernel, pooling=self.pooling, zero_window=True
        )

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """CAKE's decode rule: the current queries' attention, group-mean, pooled over positional neighbours with the
        protected window's slots left out of the pooling, as at prefill."""
        probs, H = inputs.probs, inputs.positions.shape[1]
        # mean over query rows; one row (a decode step) with a group to reduce: the row itself (to the bit), as the
        # group mean makes a new tensor anyway
        one = probs.shape[2] == 1 and probs.shape[1] > H
        p = group_mean(probs[:, :, 0] if one else probs.mean(2), H)
        return pooled_outside_window(
            p, inputs.positions, inputs.valid, inputs.newest, self.window, self.kernel, self.pooling
        )
