"""StreamingLLM: attention sinks plus the most recent tokens (``docs/methods/baselines.md#streamingllm``).

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024.

Keeps the ``sinks`` first tokens and the most recent ``C - sinks`` tokens of every layer; at decode the oldest
non-sink token leaves. Deviation: positions are not re-rotated ("position rolling" is not used in the LongBench
comparisons of the papers we follow; ``docs/conventions.md#positions``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register


@register
@dataclass
class StreamingLLM(Method):
    """Sinks + recent window.

    Parameters
    ----------
    sinks : int
        Attention-sink tokens kept at the start (default 4, the original ``start_size``).
    window : int
        Recent tokens that are protected; the remaining budget also goes to the most recent tokens, so the kept
        set is always ``sinks`` + the ``C - sinks`` most recent tokens whatever ``window`` is.
    """

    sinks: int = 4
    window: int = 0

    name: ClassVar[str] = "streamingllm"
    summary: ClassVar[str] = "attention sinks + most recent tokens"
    paper: ClassVar[str] = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024"

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Recency score: the position itself (newer = higher)."""
        B, H, S, _ = inputs.keys.shape
        pos = torch.arange(S, device=inputs.keys.device, dtype=torch.float32)
        return PrefillScores(scores=pos.view(1, 1, S).expand(B, H, S).contiguous())

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule("recency")

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Recency score of every slot: the oldest non-sink token is evicted."""
        return inputs.positions.float()
