"""SAGE-KV: one-shot per-query-head top-k selection from the last prompt token, then a sliding recent window.

Wang et al., "LLMs Know What to Drop: Self-Attention Guided KV Cache Eviction for Efficient Long-Context
Inference", arXiv 2503.08879. Our reading: ``docs/methods/sagekv.md``.

After a layer's prefill its prompt is split into sink ``[0, S)``, evictable ``E`` and recent (the newest tokens, the
last prompt token included). Every **query head** ``h`` picks the top ``k`` tokens of ``E`` by its last-token logit
``q_{h,N-1} . k_j`` (softmax is monotone, ``docs/methods/sagekv.md#partition-and-selection``). The reduced cache is
sink + selections + recent; during decoding new tokens enter the recent region and its oldest token leaves, while the
sink and the selections never change.

Budget (per layer and KV head, the compressor's ``C = B``): ``S = floor(sink_fraction * B)`` (B/4), ``k = B // (2G)``
(or explicit ``k``), and the recent region, last prompt token included, takes the rest: ``B - S - G*k`` tokens.

Storage (``docs/methods/sagekv.md#storage``): the paper's block-per-query-head visibility, stored **without copies**.
Each KV head keeps the union of its ``G`` query heads' selections once, with a per-query-head visibility mask
(``head_visible``) so that query head ``h`` sees exactly sink + its own top-k + recent + generated tokens, as in the
block layout, and a token picked by several heads is neither duplicated nor double-counted. The kept length per KV head
is ``S + |union| + recent <= B`` (``= B`` when the heads' selections are disjoint); heads of a layer are padded to the
longest (``docs/conventions.md#memory-and-byte-accounting``; ``LayerStore.byte_counts`` reports padding and the mask
separately).

Choices and deviations (``docs/methods/sagekv.md#deviations-from-the-paper``):

* Recent region: between steps it holds the newest ``B - S - G*k`` tokens (the last prompt token included), so the
  stored cache is exactly the budget ``B``. A decode step appends its token, attends, then drops the oldest recent token
  (the compressor's evict-after-output order), so each step's attention sees the sink, the selections and the newest
  ``B - S - G*k + 1`` tokens: ``S + G*k + R + 1`` entries with ``R = B/4``.
* ``k`` defaults to ``B // (2G)`` for every model; the paper's Qwen2.5 setting rounds it down to a power of two:
  pass ``k`` explicitly for that.
* Prompts with ``N <= B`` are not compressed and never evict at decode (the compressor's rule), instead of sliding once
  the cache exceeds ``B + 1``.
* With ``linear_cache=True`` tokens evicted from a KV head are folded into its linear state; tokens kept only for
  another query head of the group are neither attended nor folded for this head.
* Positions stay absolute (``docs/conventions.md#positions``; the paper's choice).
* Chunked prefill is refused (``not_chunkable``, ``docs/methods/sagekv.md#chunked-prefill``): the selection is one-shot
  after the whole prompt, which a chunked prefill never shows the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register

__all__ = ["SageKV", "sagekv_partition"]

STATIC = 1e30  # score of sink and selected tokens: never evicted at decode
RECENT = 1.0  # score of the recent region at prefill (kept; slides at decode)


def sagekv_partition(
    budget: torch.Tensor, group: int, sink_fraction: float = 0.25, k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(S, k, recent)`` int64 per sequence for budgets ``B`` (``(B,)``): ``S + G*k + recent == B``.

    ``recent`` (the last prompt token included) must be >= 1 wherever the sequence is compressed; the caller checks.
    """
    b = budget.to(torch.int64)
    sink = torch.floor(b.double() * sink_fraction).to(torch.int64)
    # a given k above any budget leaves no room whatever it is: held at the largest budget + 1, so that ``G*k`` never
    # wraps around in int64 (2 * (2**63 - 1) is -2, which left room) and a k past int64 does not overflow
    kk = b // (2 * group) if k is None else torch.full_like(b, min(int(k), (int(b.max()) if b.numel() else 0) + 1))
    return sink, kk, b - sink - group * kk


@register
@dataclass
class SageKV(Method):
    """SAGE-KV (``docs/methods/sagekv.md``).

    Parameters
    ----------
    sink_fraction : float
        Sink size as a fraction of the per-layer budget ``B`` (0.25, paper: ``S = B/4``).
    k : int | None
        Tokens selected per query head; None (default) means ``B // (2G)`` (paper).
    window : int
        Must stay 1: the last prompt token, the selection query, protected by the compressor.
    """

    sink_fraction: float = 0.25
    k: int | None = None
    window: int = 1

    name: ClassVar[str] = "sagekv"
    summary: ClassVar[str] = "SAGE-KV: sinks + per-query-head top-k of the last token's attention + sliding recent"
    paper: ClassVar[str] = (
        "Wang et al., LLMs Know What to Drop: Self-Attention Guided KV Cache Eviction for "
        "Efficient Long-Context Inference, arXiv 2503.08879, 2025"
    )
    not_chunkable: ClassVar[str | None] = (
        "its top-k selection is one-shot, by the last token of the whole prompt; a chunked prefill would select by "
        "the first chunk's last token (nothing when the chunk is within the budget) and then only slide the recent "
        "region, as StreamingLLM does"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window != 1 or self.sinks != 0:
            raise ValueError(
                "sagekv: window must be 1 and sinks 0 (the sink and recent sizes follow the budget: "
                "use sink_fraction and k)"
            )
        if not 0.0 <= self.sink_fraction < 1.0 or (self.k is not None and self.k < 0):
            raise ValueError(f"sagekv: need 0 <= sink_fraction < 1 and k >= 0 (got {self.sink_fraction}, {self.k})")

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Tiered scores (sink and selections > recent > rest) and the per-query-head visibility of the tokens."""
        q, keys = inputs.queries, inputs.keys
        B, Hq, S, d = q.shape
        Hkv, G = keys.shape[1], inputs.group_size
        dev = keys.device
        real = (~inputs.key_padding).sum(-1)
        budget = inputs.budget.to(dev) if inputs.budget is not None else real
        compress = real > budget
        sink, kk, recent = (t.to(dev) for t in sagekv_partition(budget, G, self.sink_fraction, self.k))
        if bool((compress & (recent < 1)).any()):
            gk = (G * kk).tolist() if self.k is None else [G * int(self.k)] * len(kk)  # the k given, unclamped
            raise ValueError(
                f"sagekv: sink {sink.tolist()} + G*k {gk} leave no room for the last "
                f"token within the budget {budget.tolist()}; lower k or sink_fraction"
            )
        pos = torch.arange(S, device=dev).view(1, S)
        first = (S - real).view(-1, 1)
        is_sink = (pos >= first) & (pos < first + sink.view(-1, 1))
        is_recent = pos >= S - recent.view(-1, 1)
        evictable = ~inputs.key_padding & ~is_sink & ~is_recent  # (B, S)
        # last-token logits per query head over the evictable region (fp32), top-k per query head
        logit = torch.matmul(q[:, :, -1:].float().reshape(B, Hkv, G, d), keys.float().transpose(-1, -2))
        logit = logit.reshape(B, Hq, S).masked_fill(~evictable[:, None, :], float("-inf"))
        selected = torch.zeros(B, Hq, S, dtype=torch.bool, device=dev)
        kmax = min(int(kk.max()), S) if B else 0
        if kmax > 0:
            top = torch.sort(logit, dim=-1, descending=True, stable=True)  # deterministic ties: lower position
            ok = (torch.arange(kmax, device=dev).view(1, 1, -1) < kk.view(-1, 1, 1)) & torch.isfinite(
                top.values[..., :kmax]
            )
            selected.scatter_(-1, top.indices[..., :kmax], ok)
        selected &= compress.view(-1, 1, 1)
        per_head = selected.reshape(B, Hkv, G, S)
        static = is_sink[:, None, :] | per_head.any(2)
        scores = torch.where(static, STATIC, torch.where(is_recent[:, None, :], RECENT, 0.0)).float()
        visible = ~evictable[:, None, None, :] | per_head | ~compress.view(-1, 1, 1, 1)
        return PrefillScores(scores=scores.expand(B, Hkv, S).contiguous(), head_visible=visible)

    def head_budgets(
        self, scores: torch.Tensor, selectable: torch.Tensor, *, budget: torch.Tensor | None = None, final: bool = True
    ) -> torch.Tensor:
        """Per KV head: the sink, the union of its query heads' selections and the recent region (<= budget)."""
        cand = (scores >= RECENT) & (scores < float("inf"))
        return torch.minimum(cand.sum(-1), selectable.to(scores.device).view(-1, 1))

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule("pinned_recency", pinned=STATIC)

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Sink and selections never leave; among the rest (the recent region) the oldest position is evicted."""
        stored = inputs.stored
        static = torch.isfinite(stored) & (stored >= STATIC / 2)
        return torch.where(static, torch.full_like(stored, STATIC), inputs.positions.float())
