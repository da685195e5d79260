"""KeyDiff: keep the keys least similar to the mean key (``docs/methods/keydiff.md``).

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments", 2025 (arXiv 2504.15364). Query-agnostic: a KV pair's score is the negative cosine similarity of its
key to the *anchor*, the mean of the cache's normalised keys (Sec. 3):

    anchor_h = mean_j k_{h,j} / ||k_{h,j}||          s_{h,j} = -cos(k_{h,j}, anchor_h)

Distinctive keys are kept, keys that look like the average one are evicted. The score needs no query and no
attention weights, so it runs with any attention kernel.

Choices and deviations (``docs/methods/keydiff.md#deviations``):

* Prefill: the whole prompt is scored at once (kvpress ``KeyDiffPress``, which kvpress's leaderboard runs). The paper
  processes the prompt block by block, evicting after each block (kvpress ``BlockPress``); with eviction after every
  token that is this library's decode rule, so the block-wise prefill is not reproduced.
* Decode (one eviction per step and KV head, the paper's per-token eviction): the anchor is the mean normalised key
  of the slots the head holds now, the new token included; the least distinctive slot is evicted.
* No window and no sinks by default, as the paper and kvpress; both can be set (``keydiff[window=32,sinks=4]``).
* Anchor over the real tokens of each sequence (left padding excluded); kvpress averages over every position it
  holds (batch 1, no padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from slake.methods.base import DecodeInputs, Method, PrefillInputs, PrefillScores, register
from slake.methods.decode_rule import FusedDecodeRule

__all__ = ["KeyDiff", "keydiff_scores"]


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``-cos(k_j, anchor)`` ``(B, H, n)`` float32, the anchor being the mean of the valid slots' normalised keys.

    ``keys``: ``(B, H, n, d)``; ``valid``: ``(B, H, n)`` bool (invalid slots are left out of the anchor and score 0).
    """
    k = keys.float()
    unit = F.normalize(k, p=2, dim=-1)
    weight = valid.to(unit.dtype)[..., None]
    anchor = (unit * weight).sum(-2, keepdim=True) / weight.sum(-2, keepdim=True).clamp_min(1.0)
    cos = F.cosine_similarity(k, anchor, dim=-1)
    return (-cos).masked_fill(~valid, 0.0)


@register
@dataclass
class KeyDiff(Method):
    """Key diversity: negative cosine similarity to the mean normalised key.

    Parameters
    ----------
    window : int
        Recent tokens always kept (0: the paper and kvpress protect none).
    sinks : int
        First tokens always kept (0).
    """

    window: int = 0
    sinks: int = 0

    name: ClassVar[str] = "keydiff"
    summary: ClassVar[str] = "query-agnostic key diversity: evict keys most similar to the mean key"
    paper: ClassVar[str] = (
        "Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in "
        "Resource-Constrained Environments, 2025"
    )
    decode_reads_kv: ClassVar[bool] = True
    prefill_scores_use_budget: ClassVar[bool] = False

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Scores of every prompt token against the anchor of the sequence's real tokens."""
        B, H, S, _ = inputs.keys.shape
        valid = (~inputs.key_padding)[:, None, :].expand(B, H, S)
        return PrefillScores(scores=keydiff_scores(inputs.keys, valid))

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels (they read the kept keys themselves)."""
        return FusedDecodeRule("key_diversity")

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Scores of the held slots against the anchor of the slots held now (the new token included)."""
        if inputs.keys is None:
            raise ValueError("keydiff: the decode step needs the slots' keys (decode_reads_kv)")
        return keydiff_scores(inputs.keys, inputs.valid)
