"""CriticalKV: attention scores corrected by what each value writes through the output projection
(``docs/methods/criticalkv.md``).

Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective", 2025
(arXiv 2502.03805; kvpress ``CriticalKVPress`` / ``CriticalAdaKVPress``). Evicting pair ``j`` perturbs the layer's
output by at most its attention times ``||W_o^h v_j||_1`` (Sec. 3), so a base scorer's attention estimate ``a_j`` is
corrected by the projected value norm, in two stages (Sec. 4, Algorithm 1): a head's budget ``b`` first takes its
``int(r * b)`` best pairs by ``a_j`` alone (``r = first_stage_ratio = 0.5``), then fills the rest by

    s_j = (a_j + eps) * mean_{g in group} ||W_o^g v_j||_1

The base scorer is SnapKV (window attention, pooled, averaged over the window rows as kvpress does) or Expected
Attention without its own value weighting (``scorer="expected-attention"``). ``ada-criticalkv`` splits a layer's budget
over its KV heads with AdaKV's rule on the base scores (CriticalAdaKV), then runs the two stages within each head.

Choices and deviations (``docs/methods/criticalkv.md#deviations``):

* kvpress counts the protected tokens (window, sinks) inside the first stage and the budget (its base scores give
  them the maximum); here they are protected outside, so the first stage keeps ``max(int(r * C), 1) - protected``
  selectable pairs (the same pairs). AdaKV's safeguard floor is taken on the selectable budget (kvpress: on the
  budget with the window, ``docs/faithfulness.md`` (F)).
* ``ada-criticalkv`` marks the pairs it keeps with a score above :data:`KEPT` and reports their count per head as its
  head budgets (kvpress marks them with the largest float): the two-stage choice depends on the head budgets.
* Decode (the paper and kvpress compress once, after prefill): each step applies the same two stages to the slots a
  head holds, with the base scorer's decode rule: of the ``int(r * n)`` first-stage places the protected slots take
  theirs, as at prefill, and the best unprotected slots by base score the rest (exempt); the victim is the lowest
  ``(a + eps) * ||W_o v||_1`` among the others. The projected norm of a slot depends on its value
  alone, so the engines compute it once, when the slot is written, and keep it beside the slot's score
  (:attr:`~slake.methods.base.Method.slot_weighted`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from slake.methods.ada_snapkv import AdaKVHeads, adakv_head_budgets
from slake.methods.base import DecodeInputs, LayerContext, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import real_positions
from slake.methods.decode_rule import FusedDecodeRule
from slake.methods.expected_attention import ExpectedAttention
from slake.methods.snapkv import SnapKV

__all__ = ["KEPT", "AdaCriticalKV", "CriticalKV", "projected_norm", "two_stage"]

#: score marking a first-stage pair (above any corrected score) and, for ``ada-criticalkv``, a kept pair
FIRST = 1e30
KEPT = 1e35
#: largest ``epsilon``: ``(base + epsilon) * norm`` stays far below :data:`FIRST` for any value norm below 1e23
MAX_EPSILON = 1e6


def projected_norm(values: torch.Tensor, out_proj: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, Hkv, n)`` float32 mean over a KV head's query heads ``g`` of ``||W_o^g v_j||_1``.

    ``values``: ``(B, Hkv, n, d)``; ``out_proj``: ``(hidden, Hq * d)`` (query head ``g`` owns columns ``g*d..``).
    The weight is read in place, as a ``(Hq, d, hidden)`` view, never rearranged or cast: a decode step projects one
    value per KV head, and a copy of ``W_o`` per call would cost more than the projection (Llama-3-8B's is 64 MB in
    float32). The projection runs in the weight's dtype (float32 accumulation on a GPU; on bfloat16 weights the
    products are rounded to bfloat16 before the L1 sum, which is taken in float32).
    """
    B, H, n, d = values.shape
    g = num_heads // H
    hidden = out_proj.shape[0]
    heads = out_proj.view(hidden, num_heads, d).permute(1, 2, 0)  # (Hq, d, hidden): W_o^q transposed, a view
    out = values.new_zeros(B, H, n, dtype=torch.float32)
    block = max(1, (1 << 24) // max(1, B * num_heads * hidden))
    for i in range(0, n, block):
        v = values[:, :, i : i + block]
        m = v.shape[2]
        # each query head's copy of its KV head's values: (Hq, B * m, d), small next to the weight
        x = v.to(out_proj.dtype).transpose(0, 1).reshape(H, 1, B * m, d).expand(H, g, B * m, d)
        proj = torch.bmm(x.reshape(num_heads, B * m, d), heads)  # (Hq, B * m, hidden)
        norm = proj.abs().sum(-1, dtype=torch.float32).view(H, g, B, m).mean(1)  # (H, B, m)
        out[:, :, i : i + block] = norm.transpose(0, 1)
    return out


def two_stage(
    base: torch.Tensor, norm: torch.Tensor, candidates: torch.Tensor, first: torch.Tensor, eps: float
) -> torch.Tensor:
    """CriticalKV's scores: the ``first[b, h]`` best candidates by ``base`` get :data:`FIRST`, the others
    ``(base + eps) * norm``. ``base, norm``: ``(B, H, n)``; ``candidates``: bool ``(B, H, n)``; ``first``:
    ``(B, H)``."""
    masked = base.float().masked_fill(~candidates, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    rank = torch.sort(order, dim=-1).indices
    corrected = (base.float() + eps) * norm
    return torch.where(rank < first[..., None], torch.full_like(corrected, FIRST), corrected)


@register
@dataclass
class CriticalKV(Method):
    """Two-stage selection: base attention scores, then scores corrected by the projected value norm.

    Parameters
    ----------
    window : int
        Observation window of the SnapKV scorer (32); set 0 with ``scorer="expected-attention"``.
    kernel, pooling, group_first : int, str, bool
        The SnapKV scorer's pooling (5, ``"avg"``, False: plain ``snapkv``'s).
    scorer : str
        ``"snapkv"`` (default) or ``"expected-attention"`` (without its value weighting).
    epsilon : float
        Added to the base score before the correction (1e-4, kvpress).
    first_stage_ratio : float
        Share of a head's budget chosen by the base score alone (0.5, the paper's and kvpress's).
    """

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    group_first: bool = False
    scorer: str = "snapkv"
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    name: ClassVar[str] = "criticalkv"
    summary: ClassVar[str] = "SnapKV scores corrected by ||W_o v||_1 in two stages (output perturbation)"
    paper: ClassVar[str] = (
        "Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective, 2025"
    )
    decode_reads_kv: ClassVar[bool] = True
    slot_weighted: ClassVar[bool] = True
    needs_layer: ClassVar[tuple[str, ...]] = ("out_proj",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scorer not in ("snapkv", "expected-attention"):
            raise ValueError(f"{self.name}: scorer must be 'snapkv' or 'expected-attention', got {self.scorer!r}")
        if not 0.0 <= self.first_stage_ratio <= 1.0:
            raise ValueError(f"{self.name}: need 0 <= first_stage_ratio <= 1, got {self.first_stage_ratio}")
        if not 0.0 <= self.epsilon <= MAX_EPSILON:
            # (base + epsilon) * norm must stay below the first stage's mark (FIRST) and ada-criticalkv's (KEPT):
            # a larger epsilon ranked second-stage pairs above the first stage and counted them as kept, over the
            # budget; at 1e6 the second stage already orders by the value norm alone, within float32's precision
            raise ValueError(f"{self.name}: need 0 <= epsilon <= {MAX_EPSILON:g}, got {self.epsilon}")
        # made once: the decode step asks for both at every step of every layer (hyperparameters never change)
        self._scorer = self._make_base()
        base_rule = self._scorer.fused_rule()
        self._rule = (
            None
            if base_rule is None
            else replace(base_rule, two_stage=self.first_stage_ratio, two_stage_epsilon=self.epsilon)
        )

    def layer_facts(self) -> tuple[str, ...]:
        """The output projection, and the rotary embedding for the Expected Attention scorer."""
        return ("out_proj", "rotary") if self.scorer == "expected-attention" else ("out_proj",)

    def _base(self) -> Method:
        """The base scorer (SnapKV or Expected Attention with CriticalKV's window and sinks)."""
        return self._scorer

    def _make_base(self) -> Method:
        if self.scorer == "snapkv":
            return SnapKV(window=self.window, sinks=self.sinks, kernel=self.kernel, pooling=self.pooling,
                          group_first=self.group_first)  # fmt: skip
        return ExpectedAttention(window=self.window, sinks=self.sinks, vnorm=False)

    def _candidates(self, inputs: PrefillInputs) -> torch.Tensor:
        pad = inputs.key_padding
        S = pad.shape[1]
        idx = torch.arange(S, device=pad.device).view(1, -1)
        pos = real_positions(pad)
        ok = ~pad & (pos >= self.sinks) & (idx < S - self.window)
        return ok[:, None, :].expand(-1, inputs.keys.shape[1], -1)

    def _prefill_parts(self, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Base scores (SnapKV's as a mean over the window rows, as kvpress), projected norms and candidates."""
        base = self._base().prefill_scores(inputs).scores.float()
        if self.scorer == "snapkv":
            base = base / max(min(inputs.window, inputs.keys.shape[2]), 1)
        layer = inputs.layer
        if layer is None or layer.out_proj is None:
            raise ValueError(f"{self.name}: needs the layer's output projection (LayerContext.out_proj)")
        norm = projected_norm(inputs.values, layer.out_proj, inputs.queries.shape[1])
        return base, norm, self._candidates(inputs)

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Two-stage scores; the first stage takes ``max(int(r * C), 1) - protected`` pairs per head."""
        base, norm, cand = self._prefill_parts(inputs)
        assert inputs.budget is not None
        total = torch.clamp(torch.floor(inputs.budget.double() * self.first_stage_ratio), min=1).to(torch.int64)
        first = (total.to(base.device) - self.protected).clamp_min(0)[:, None].expand(-1, base.shape[1])
        return PrefillScores(scores=two_stage(base, norm, cand, first, self.epsilon))

    def slot_weights(self, values: torch.Tensor, layer: LayerContext | None) -> torch.Tensor:
        """``||W_o^g v||_1`` averaged over the query heads ``g`` of the slot's KV head (:func:`projected_norm`)."""
        if layer is None or layer.out_proj is None:
            raise ValueError(f"{self.name}: needs the layer's output projection (LayerContext.out_proj)")
        return projected_norm(values, layer.out_proj, layer.out_proj.shape[1] // values.shape[-1])

    @property
    def reads_block_queries(self) -> bool:
        """With the Expected Attention scorer, a block's statistics are those of every one of its queries."""
        return self._base().reads_block_queries

    def decode_query_map(self, layer: LayerContext | None, head_dim: int, device: torch.device) -> torch.Tensor | None:
        """The Expected Attention scorer's map (None with the SnapKV scorer)."""
        return self._base().decode_query_map(layer, head_dim, device)

    def fused_rule(self) -> FusedDecodeRule | None:
        """The base scorer's fused rule with CriticalKV's two stages over it."""
        return self._rule

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """The base decode rule, then the two stages over the slots held: of the ``int(r * n)`` first-stage places,
        the protected slots (window, sinks) take theirs and the best others by base score the rest, as the prefill
        counts them. ``n`` is the slots held at a single-token step (one over the head's target); where several
        tokens are evicted at once (a block, a later prompt chunk: ``inputs.target``) it is the target plus one, as
        at a step: the slots held then would size the first stage past what the head keeps, and its exempt slots,
        all tied, would be kept or evicted by slot order (before 2026-11-29, with a block longer than the budget).

        The projected norms come from ``inputs.weights`` where the engine keeps them per slot (computed once per
        slot: recomputing them costs ``n * d * Hq * hidden`` multiply-adds per sequence, layer and step), else from
        the values."""
        if inputs.values is None or inputs.layer is None or inputs.layer.out_proj is None:
            raise ValueError(f"{self.name}: the decode step needs the values and the output projection")
        base = self._base().decode_scores(inputs).float()  # SnapKV's decode rule already averages the queries
        norm = inputs.weights
        if norm is None:
            norm = projected_norm(inputs.values, inputs.layer.out_proj, inputs.probs.shape[1])
        # the protected slots count inside the first stage, as at prefill (kvpress gives them the largest score):
        # of the ``int(r * n)`` first-stage places they take theirs, and the best unprotected slots the rest
        protected = self._held_protected(inputs)
        held = inputs.valid.sum(-1)
        if inputs.target is not None:  # a block or chunk: sized as the single-token step that keeps the target
            target = inputs.target.to(held.device)
            held = torch.where(target >= 0, torch.minimum(held, target + 1), held)
        total = torch.floor(held.double() * self.first_stage_ratio).to(torch.int64)
        first = (total - protected.sum(-1)).clamp_min(0)
        return two_stage(base, norm, inputs.valid & ~protected, first, self.epsilon)

    def _held_protected(self, inputs: DecodeInputs) -> torch.Tensor:
        """``(B, Hkv, n)`` bool: the held slots no eviction may take (the window's newest tokens and the sinks), as
        the engines guard them (:func:`slake.cache.decode_step.protected_slots`). Sinks are never evicted, so a row's
        first real token is its lowest held position."""
        pos, valid = inputs.positions, inputs.valid
        protected = torch.zeros_like(valid)
        if self.window and not self.newest_evictable:
            newest = inputs.newest
            if newest is None:
                newest = pos.masked_fill(~valid, -1).amax(-1, keepdim=True)
            protected = pos > newest - self.window
        if self.sinks:
            first = pos.masked_fill(~valid, torch.iinfo(pos.dtype).max).amin(-1, keepdim=True)
            protected = protected | ((pos >= first) & (pos < first + self.sinks))
        return protected & valid


@register
@dataclass
class AdaCriticalKV(AdaKVHeads, CriticalKV):
    """CriticalAdaKV: AdaKV head budgets on the base scores, CriticalKV's two stages inside each head.

    Parameters
    ----------
    kernel, pooling, group_first : int, str, bool
        7, ``"max"``, True: ``ada-snapkv``'s.
    alpha_safeguard : float
        AdaKV's safeguard (0.2).
    """

    kernel: int = 7
    pooling: str = "max"
    group_first: bool = True

    name: ClassVar[str] = "ada-criticalkv"
    not_chunkable: ClassVar[str | None] = (
        "its per-head budgets are the counts its prefill's two stages mark over the prompt, which a later chunk's "
        "scores do not carry (every head would keep its protected tokens only)"
    )
    summary: ClassVar[str] = "CriticalKV with AdaKV adaptive head budgets (CriticalAdaKV)"
    paper: ClassVar[str] = (
        "Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective, 2025 "
        "(CriticalAdaKV)"
    )

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Head budgets from the base scores, two stages per head, kept pairs marked above :data:`KEPT`."""
        base, norm, cand = self._prefill_parts(inputs)
        assert inputs.budget is not None
        P = self.protected
        sel = (inputs.budget.to(base.device) - P).clamp_min(0)
        ranked = base.masked_fill(~cand, float("-inf"))
        heads = adakv_head_budgets(ranked, sel, self.alpha_safeguard, self.safeguard)  # (B, H)
        floor = torch.floor(sel.double() * self.alpha_safeguard).to(torch.int64)[:, None]
        total = torch.clamp(torch.floor((heads + P).double() * self.first_stage_ratio), min=1).to(torch.int64)
        first = torch.maximum((total - P).clamp_min(0), torch.minimum(floor, heads))
        scores = two_stage(base, norm, cand, first, self.epsilon).masked_fill(~cand, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        kept = torch.sort(order, dim=-1).indices < heads[..., None]
        return PrefillScores(scores=torch.where(kept, torch.full_like(scores, KEPT), scores))

    def head_budgets(
        self, scores: torch.Tensor, selectable: torch.Tensor, *, budget: torch.Tensor | None = None, final: bool = True
    ) -> torch.Tensor:
        """The per-head counts chosen at scoring: the candidates marked :data:`KEPT`."""
        return (torch.isfinite(scores) & (scores >= KEPT)).sum(-1)
