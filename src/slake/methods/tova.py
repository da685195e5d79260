"""TOVA: token omission via attention (``docs/methods/baselines.md#tova``).

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024.

Score = attention of the current (last) query averaged over all query heads of the layer; one kept set shared by
all heads. At decode the cache is scored after the step's attention and the lowest token is dropped; the newest
token itself can be evicted (no protected window), as in the reference code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import window_attention


@register
@dataclass
class TOVA(Method):
    """Keep the tokens the last query attends to most (head-averaged)."""

    window: int = 1

    name: ClassVar[str] = "tova"
    summary: ClassVar[str] = "keeps the tokens the current query attends to most (head-averaged), one per step"
    paper: ClassVar[str] = "Oren et al., Transformers are Multi-State RNNs, EMNLP 2024"
    newest_evictable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window != 1:
            raise ValueError("tova scores with the last query only; its window must be 1")

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Last query's attention, mean over all query heads, shared by every KV head."""
        a = window_attention(inputs.queries, inputs.keys, 1, inputs.scaling, inputs.key_padding)  # (B,Hq,1,S)
        s = a[:, :, -1].mean(1, keepdim=True)  # (B,1,S)
        return PrefillScores(scores=s.expand(-1, inputs.keys.shape[1], -1).contiguous())

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule("layer_attention")

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Current (last) query's attention, mean over all heads of the layer."""
        s = inputs.probs[:, :, -1].mean(1, keepdim=True)
        return s.expand(-1, inputs.positions.shape[1], -1).contiguous()
