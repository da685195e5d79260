"""KVzip: query-agnostic scores from a context-reconstruction pass (``docs/methods/kvzip.md``).

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", NeurIPS 2025
(arXiv 2505.23416). After the prompt is prefilled, the model is asked to repeat it ("Repeat the previous context
exactly.", teacher-forced: the repeat input holds the context itself). Each KV pair of the context scores the largest
attention it receives from the repeat input's queries, over the query heads of its KV head (Sec. 3.2):

    S[l, h, j] = max_{g in group(h), i} softmax_i(q_{g,i} . [k_sink, k_chunk, k_repeat] * s)[j]

The softmax runs over the attention sinks, the chunk being reconstructed and the repeat input itself (causal), not
over the whole cache, so that long contexts are scored chunk by chunk (Sec. 3.3: chunks of 2K tokens, each later
chunk's prompt ending with the last 8 tokens of the previous chunk). The pairs with the lowest scores across **all
layers and KV heads** are evicted (non-uniform head budgets, Sec. 3.1). The pass itself runs in the engine
(:mod:`slake.engines.transformers.reconstruction`); this module holds the scoring and the budget rule.

Choices and deviations (``docs/methods/kvzip.md#deviations``):

* Budgets: the global top-k over layers and heads gives layer ``l`` ``n_l`` pairs. A layer keeps a multiple of its
  ``Hkv`` heads here (``C_l`` tokens per head on average): the layers' preferences are ``n_l / Hkv`` and the
  compressor's cascade rounds them by largest remainder (total exact; at most ``Hkv - 1`` pairs per layer move).
  Inside a layer the heads split by one top-k over the layer (no safeguard, as the paper and kvpress).
* Sinks and template prefix: kvpress keeps ``n_sink = 4`` first tokens and scores the chat template's prefix tokens
  after them 0 (evicted first); the authors' code keeps the whole prefix and puts it in the softmax
  (``keep_prefix=True``). Default: kvpress's, which its leaderboard numbers use.
* Decode (the paper never evicts while decoding): one eviction per step and KV head by the same idea, a slot's score
  being the largest attention it has received, from the reconstruction or from any later query (running max).
  With KVzip's skewed budgets this costs much (a new token's attention is on another scale than the reconstruction's
  maxima, and heads of a few slots stop seeing the answer being written; ``docs/methods/kvzip.md#decode-rule``):
  ``keep_generated=True`` ranks generated tokens above the context, ``decode_scope="layer"`` evicts across a layer's
  heads, and ``decode_eviction=False`` is the paper's setting.
* Scores in float32 (the authors' code and kvpress keep the model's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.budgets.allocation import cross_head_counts
from slake.methods.base import DecodeInputs, Method, PrefillInputs, PrefillScores, register
from slake.methods.decode_rule import FusedDecodeRule
from slake.methods.decode_scope import DecodeScope

__all__ = ["GENERATED", "KVzip", "global_layer_counts", "reconstruction_attention"]

GENERATED = 2.0
"""With ``keep_generated``: what a generated token's decode score carries above its running maximum of attention.
Context pairs score attention probabilities, at most 1 (exactly 1 when a query attended to the pair alone), so a
stored score of at least 2 marks a generated token and nothing else; the fused kernels' rule 6
(:func:`slake.kernels.triton_rules.rule_score`) uses the same value."""


def reconstruction_attention(
    queries: torch.Tensor, keys: torch.Tensor, sink: int, start: int, end: int, scaling: float
) -> torch.Tensor:
    """KVzip's chunk scores: ``(B, Hkv, end - start)`` float32 max attention each context key of ``[start, end)``
    receives from the repeat input.

    Parameters
    ----------
    queries : torch.Tensor
        ``(B, Hq, q, d)`` post-RoPE queries of the repeat input (its ``q`` tokens).
    keys : torch.Tensor
        ``(B, Hkv, n + q, d)`` post-RoPE keys: the ``n`` cached prompt tokens, then the repeat input's ``q``.
    sink : int
        The first ``sink`` keys join the softmax (attention sinks / template prefix) but are not scored.
    start, end : int
        The chunk of context keys being reconstructed.
    scaling : float
        The model's softmax scale.
    """
    B, Hq, q, d = queries.shape
    Hkv = keys.shape[1]
    sub = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, keys.shape[2] - q :]], dim=2).float()
    x = torch.matmul(queries.float().reshape(B, Hkv, (Hq // Hkv) * q, d), sub.transpose(-1, -2)) * scaling
    x = x.view(B, Hkv, Hq // Hkv, q, -1)
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).triu(1)
    x[..., -q:].masked_fill_(causal, float("-inf"))
    p = torch.softmax(x, dim=-1)[..., sink : sink + end - start]
    return p.amax(dim=(2, 3))


def global_layer_counts(scores: torch.Tensor, candidates: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Pairs of each layer among the ``keep`` best candidates of all layers and heads (KVzip's global top-k).

    ``scores``: ``(L, B, H, S)``; ``candidates``: ``(B, S)`` bool (selectable positions); ``keep``: ``(B,)`` int64.
    Returns ``(B, L)`` int64 summing to ``min(keep, L * H * candidates)``; ties at the threshold go to the lower
    (layer, head, position) first, as a stable sort would.
    """
    L, B, H, S = scores.shape
    out = torch.zeros(B, L, dtype=torch.int64)
    candidates = candidates.to(scores.device)  # on a GPU the scores are there (a mask left on the CPU failed)
    for b in range(B):
        s = scores[:, b].float().masked_fill(~candidates[b].view(1, 1, S), float("-inf")).reshape(L, -1)
        n = int(candidates[b].sum()) * L * H
        k = min(int(keep[b]), n)
        if k <= 0:
            continue
        flat = s.reshape(-1)
        tau = -torch.kthvalue(-flat, k).values  # the k-th largest score
        above = (s > tau).sum(-1)
        ties = (s == tau).sum(-1)
        need = k - int(above.sum())
        before = torch.cumsum(ties, 0) - ties  # ties of the lower layers, taken first
        out[b] = (above + torch.clamp(need - before, min=0).minimum(ties)).cpu()
    return out


@register
@dataclass
class KVzip(DecodeScope, Method):
    """Context-reconstruction scores, global (cross-layer, cross-head) budgets.

    Parameters
    ----------
    window : int
        Recent tokens always kept (0: KVzip scores every context token by reconstruction).
    sinks : int
        First tokens always kept and put in every chunk's softmax (4, kvpress's ``n_sink``).
    chunk_size : int
        Context tokens reconstructed per pass (2048, kvpress; the paper's 2K).
    keep_prefix : bool
        Keep the chat template's prefix (system prompt) and put it in the softmax, as the authors' code does; False
        (default, kvpress): only the ``sinks`` first tokens, the rest of the prefix scores 0.
    keep_generated : bool
        Generated tokens rank above every context pair at decode (they carry :data:`GENERATED` ``+`` their running
        max; context pairs carry attention probabilities, at most 1), so a decode step evicts the context's lowest
        pairs while any is evictable, as the paper, which keeps every generated token, would have it within a fixed
        size. False: one scale for both, and a new token, whose attention is spread over the whole cache, usually
        scores below the reconstruction's peaked maxima and goes at once (``docs/methods/kvzip.md#decode-rule``).
    decode_scope : str
        ``"head"``: one eviction per step and KV head; ``"layer"``: the layer keeps its size and evicts across its
        heads (:class:`~slake.methods.decode_scope.DecodeScope`), so that heads the global budget left with their
        sinks alone can take in the answer being written.
    """

    window: int = 0
    sinks: int = 4
    chunk_size: int = 2048
    keep_prefix: bool = False
    keep_generated: bool = False

    name: ClassVar[str] = "kvzip"
    summary: ClassVar[str] = "max attention from a context-reconstruction pass; global top-k over layers and heads"
    paper: ClassVar[str] = (
        "Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, NeurIPS 2025"
    )
    layer_budgets: ClassVar[str] = "preference"
    second_pass: ClassVar[str | None] = "reconstruction"
    decode_accumulates: ClassVar[bool] = True  # the running max over every step's attention
    # the window's prompt tokens carry their reconstruction score into decoding: with the default +inf, a running
    # max kept them for good once they left the window, and a head whose unprotected slots all scored +inf lost
    # its sinks and then each new token
    carry_protected_scores: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ValueError(f"{self.name}: chunk_size must be >= 1, got {self.chunk_size}")

    def second_pass_key(self) -> str:
        """The reconstruction depends on the sinks, the chunk size and the template prefix only."""
        return f"kvzip[chunk_size={self.chunk_size},keep_prefix={self.keep_prefix},sinks={self.sinks}]"

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """The layer's reconstruction scores; the preference is the layer's share of the global top-k, per KV head."""
        scores = inputs.pass_scores
        if scores is None:
            raise ValueError("kvzip: no reconstruction scores (the engine runs the second pass before the prefill)")
        L, B, H, S = scores.shape
        pad = inputs.key_padding.to(scores.device)
        first = pad.sum(-1, keepdim=True)  # left padding: the first real position
        pos = torch.arange(S, device=scores.device).view(1, -1)
        candidates = ~pad & ((pos >= first + self.sinks) & (pos < S - self.window))
        assert inputs.budget is not None
        keep = (inputs.budget.cpu() - self.protected).clamp_min(0) * L * H
        counts = global_layer_counts(scores, candidates, keep)
        pref = counts[:, inputs.layer_idx].double() / H
        return PrefillScores(scores=scores[inputs.layer_idx].float().clone(), preference=pref.to(scores.device))

    def head_budgets(
        self, scores: torch.Tensor, selectable: torch.Tensor, *, budget: torch.Tensor | None = None, final: bool = True
    ) -> torch.Tensor:
        """One top-``Hkv * selectable`` over the layer's heads (KVzip's non-uniform head budgets, no safeguard)."""
        return cross_head_counts(scores, selectable.to(scores.device) * scores.shape[1])

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule("running_max", group="max", generated_first=self.keep_generated)

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Running max of the attention a slot receives (max over the KV head's query heads and the step's
        queries); with ``keep_generated``, :data:`GENERATED` ``+`` it for generated tokens: the newest token of a
        single-token step (its position is ``inputs.newest``) and every slot whose stored score is already at least
        :data:`GENERATED` (a context pair's is at most 1, also when a query attended to it alone). Tokens appended
        several at once (a continuation prompt, which has no ``newest``) are context and score as context."""
        B, Hq, nq, n = inputs.probs.shape
        H = inputs.positions.shape[1]
        now = inputs.probs.float().reshape(B, H, Hq // H, nq, n).amax(dim=(2, 3))
        stored = inputs.stored.float()
        if self.keep_generated:
            generated = stored >= GENERATED
            if inputs.newest is not None:
                generated = generated | (inputs.positions == inputs.newest)
            now = now + GENERATED * generated.float()
        return torch.maximum(stored, now)
