"""Where a decode step evicts for methods with per-head budgets: in every KV head, or across a layer's KV heads.

Methods whose prefill gives the KV heads of a layer different sizes (AdaKV's cross-head top-k, KVzip's global top-k
over layers and heads) keep them at those sizes while decoding by default: one eviction per step and KV head
(``docs/methods/README.md#decode-eviction``). A head left with only its sinks then sees none of the answer being
written. ``decode_scope="layer"`` keeps the **layer** at its size instead: each step appends one token per KV head and
evicts as many, the lowest-scored unprotected slots of the whole layer, so heads grow and shrink as their scores
say, within the widest head's prefill size (the storage the layer already has). The same idea as the prefill's
cross-head top-k, carried into decoding; no paper evicts this way while decoding (they append), so it is our
extension, like every decode rule of these methods.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DECODE_SCOPES", "DecodeScope"]

#: the values of ``decode_scope``
DECODE_SCOPES = ("head", "layer")


@dataclass
class DecodeScope:
    """Mixin giving a method with per-head budgets the ``decode_scope`` hyperparameter.

    Parameters
    ----------
    decode_scope : str
        ``"head"``: one eviction per step and KV head, each head keeps its prefill size. ``"layer"``: the layer keeps
        its size and evicts its ``Hkv`` lowest-scored unprotected slots across its heads (a head never grows past the
        layer's widest prefill head). Not with ``linear_cache`` (PTAA folds one victim per KV head and step).
    """

    decode_scope: str = "head"

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.decode_scope not in DECODE_SCOPES:
            raise ValueError(
                f"{self.name}: decode_scope must be one of {', '.join(DECODE_SCOPES)}, "  # type: ignore[attr-defined]
                f"got {self.decode_scope!r}"
            )
        if self.decode_scope == "layer" and self.linear_cache:  # type: ignore[attr-defined]
            raise ValueError(
                f"{self.name}: decode_scope=layer cannot fold into a linear state "  # type: ignore[attr-defined]
                "(PTAA folds one victim per KV head and step); use decode_scope=head with linear_cache"
            )

    @property
    def evicts_across_heads(self) -> bool:
        """True with ``decode_scope="layer"`` and decode eviction on."""
        return self.decode_scope == "layer" and bool(self.decode_eviction)  # type: ignore[attr-defined]
