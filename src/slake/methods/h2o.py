"""H2O: heavy hitters by accumulated attention plus a recent window (``docs/methods/baselines.md#h2o``).

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023.

Score of a key = total attention it has received from every query so far (prefill: column sums of the causal
attention, computed in query chunks so memory stays O(chunk x S); decode: ``acc += A_t``). Group-mean over the query
heads of a KV head; no pooling. The ``window`` most recent tokens are protected (default r = 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import group_mean


def accumulated_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    key_padding: torch.Tensor | None,
    chunk: int = 512,
    max_elements: int = 1 << 26,
) -> torch.Tensor:
    """Column sums of the full causal attention ``sum_i A[i, j]`` per query head: ``(B, Hq, S)`` float32.

    Queries are processed in row blocks (``docs/methods/baselines.md#h2o``) of at most ``chunk`` rows, fewer when a
    block's logits ``(B, Hq, rows, S)`` would exceed ``max_elements`` (large batches), and each block only meets the
    keys it can see causally (``0 .. last row``), which halves the work. Padded keys get no attention; padded queries
    contribute nothing.
    """
    B, Hq, S, d = queries.shape
    Hkv = keys.shape[1]
    g = Hq // Hkv
    kf = keys.float().unsqueeze(2)  # (B,Hkv,1,S,d)
    acc = torch.zeros(B, Hq, S, dtype=torch.float32, device=queries.device)
    rows_per_block = max(1, min(int(chunk), int(max_elements) // max(1, B * Hq * S)))
    for start in range(0, S, rows_per_block):
        stop = min(S, start + rows_per_block)
        q = queries[:, :, start:stop].float().reshape(B, Hkv, g, stop - start, d)
        x = torch.matmul(q, kf[..., :stop, :].transpose(-1, -2)).reshape(B, Hq, stop - start, stop)
        x.mul_(scaling)
        rows = torch.arange(start, stop, device=queries.device)
        x.masked_fill_(torch.arange(stop, device=queries.device).view(1, -1) > rows.view(-1, 1), float("-inf"))
        if key_padding is not None:
            x.masked_fill_(key_padding[:, None, None, :stop], float("-inf"))
        a = torch.softmax(x, dim=-1).nan_to_num_(0.0)
        del x
        if key_padding is not None:
            a.masked_fill_(key_padding[:, None, start:stop, None], 0.0)
        acc[..., :stop] += a.sum(2)
    return acc


@register
@dataclass
class H2O(Method):
    """Heavy-hitter oracle.

    Parameters
    ----------
    window : int
        Recent tokens always kept (``r``; default 32, as in CAKE's comparisons; KVCache-Factory uses 8).
    chunk : int
        Query chunk size for the prefill column sums.
    """

    window: int = 32
    chunk: int = 512

    name: ClassVar[str] = "h2o"
    summary: ClassVar[str] = "heavy hitters by accumulated attention + recent window, evicts during decoding"
    paper: ClassVar[str] = (
        "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023"
    )
    #: window tokens keep their accumulated prefill attention when they leave the window
    carry_protected_scores: ClassVar[bool] = True
    decode_accumulates: ClassVar[bool] = True
    #: the column sums ignore the budget: prefill-once replays compute them once for every budget
    prefill_scores_use_budget: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 1:
            raise ValueError(f"{self.name}: chunk must be >= 1, got {self.chunk}")

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Accumulated attention of every prompt query, group-mean per KV head."""
        acc = accumulated_attention(inputs.queries, inputs.keys, inputs.scaling, inputs.key_padding, self.chunk)
        return PrefillScores(scores=group_mean(acc, inputs.keys.shape[1]))

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule("accumulated_attention", group="mean")

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """``acc += A_t`` (group-mean over the KV head's query heads, summed over the step's queries)."""
        add = group_mean(inputs.probs.sum(2), inputs.positions.shape[1])
        stored = inputs.stored.masked_fill(~torch.isfinite(inputs.stored), 0.0)
        return stored + add
