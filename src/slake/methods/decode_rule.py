"""A method's decode rule in the terms the fused decode kernels implement (:mod:`slake.kernels`).

Every evicting method defines its decode rule as plain torch in :meth:`~slake.methods.base.Method.decode_scores`;
that is the reference. Most rules are one of a few families over the step's attention probabilities, and a method
that belongs to one says so with :meth:`~slake.methods.base.Method.fused_rule`, so that the fused kernels can run
its step on a GPU. The kernels' tests run each method's step both ways and require the same victims, so a
description that drifted from its ``decode_scores`` fails there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RULE_KINDS", "FusedDecodeRule"]

#: the families of decode rules the fused kernels implement
RULE_KINDS = (
    "pooled_attention",  # this step's attention, reduced over the KV head's query heads, pooled over positional
    #                      neighbours (SnapKV, PyramidKV, AdaKV, CAKE, SLAKE, LAVa)
    "accumulated_attention",  # stored score (0 if not finite) + this step's group-mean attention (H2O)
    "sharpened_accumulation",  # stored score + the reduced softmax(c * logits) with AhaKV's gain c
    "layer_attention",  # this step's attention averaged over every query head of the layer (TOVA)
    "recency",  # the slot's position: the oldest unprotected token goes (StreamingLLM)
    "pinned_recency",  # pinned slots (stored score >= PINNED / 2) keep PINNED, the others their position (SAGE-KV)
    "running_max",  # max of the stored score and this step's attention reduced over the query heads (KVzip)
    "key_diversity",  # minus the cosine of the slot's key to the mean unit key of the slots held (KeyDiff)
    "expected_attention",  # softmax of the step's queries moved by a fixed (d, d) map, group mean, optionally
    #                        (+ epsilon) x the value's L2 norm (Expected Attention)
)


@dataclass(frozen=True)
class FusedDecodeRule:
    """The parameters of a decode rule of one of the :data:`RULE_KINDS`.

    Attributes
    ----------
    kind : str
        One of :data:`RULE_KINDS`.
    group : str
        How the ``g`` query heads of a KV head are reduced: ``"mean"`` or ``"max"``.
    kernel : int
        Pooling kernel over positional neighbours (``pooled_attention``; 1: no pooling).
    pooling : str
        ``"avg"`` (zero padding, divided by ``kernel``) or ``"max"`` (``-inf`` padding).
    zero_window : bool
        ``pooled_attention``: the protected window's slots contribute 0 to their neighbours' pooling (CAKE).
    gain_floor : bool
        ``sharpened_accumulation``: AhaKV's gain ``c`` is clamped at 1.
    pinned : float
        ``pinned_recency``: the score of a pinned slot.
    value_norm : bool
        ``expected_attention``: the score is ``(p + epsilon) * ||v||_2`` instead of ``p``.
    epsilon : float
        ``expected_attention`` with ``value_norm``: added to the attention before the value weighting.
    two_stage : float | None
        CriticalKV's two stages over the kind's scores (the base scores ``a``): the ``floor(two_stage * n)`` best of
        a row's ``n`` held slots by ``a`` score :data:`slake.methods.criticalkv.FIRST`, the others
        ``(a + two_stage_epsilon) * w`` with ``w`` the slot's weight (``Method.slot_weighted``: the mean over the
        KV head's query heads ``g`` of ``||W_o^g v||_1``, :func:`slake.methods.criticalkv.projected_norm`; the
        kernels compute the new slot's from ``LayerContext.out_proj``); None: no stages.
    two_stage_epsilon : float
        Added to the base score before the weighting.
    generated_first : bool
        ``running_max``: generated tokens (the step's new slot, and every slot whose stored score is at least 2)
        take ``2 +`` this step's reduced attention (:data:`slake.methods.kvzip.GENERATED`), so that they rank above
        every prompt slot, whose scores are attention probabilities (at most 1, exactly 1 for a pair a query
        attended to alone). KVzip's ``keep_generated``.

    The ``expected_attention`` kind's map is not a parameter here: the kernels take it from
    :meth:`slake.methods.base.Method.decode_query_map`.
    """

    kind: str
    group: str = "mean"
    kernel: int = 1
    pooling: str = "avg"
    zero_window: bool = False
    gain_floor: bool = False
    pinned: float = 0.0
    value_norm: bool = False
    epsilon: float = 0.0
    two_stage: float | None = None
    two_stage_epsilon: float = 0.0
    generated_first: bool = False

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"unknown fused decode rule {self.kind!r}; expected one of {', '.join(RULE_KINDS)}")
        if self.group not in ("mean", "max") or self.pooling not in ("avg", "max") or self.kernel < 1:
            raise ValueError(f"bad fused decode rule parameters: {self}")
        if self.two_stage is not None and not 0.0 <= self.two_stage <= 1.0:
            raise ValueError(f"bad fused decode rule parameters: {self}")
