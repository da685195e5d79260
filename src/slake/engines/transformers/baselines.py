"""The rows ``slake bench`` times beside slake's methods that are not slake's compression: their names, shared by the
engine, the measurement and the reports.

* ``full``: slake's own cache holding every token (:class:`~slake.engines.transformers.cache.SlakeCache` with the
  full method), the baseline of every ratio in ``docs/``;
* :data:`TRANSFORMERS`: transformers' own ``DynamicCache`` without any slake cache, decoded eager: the decode a user
  has without slake, which says whether slake's full cache is an honest baseline.
"""

from __future__ import annotations

__all__ = ["TRANSFORMERS", "holds_every_token"]

#: ``slake bench``'s name for transformers' own cache (``--methods transformers,...``)
TRANSFORMERS = "transformers"


def holds_every_token(method: str) -> bool:
    """Whether a row of ``method`` keeps every token, so that its budget is not its own (benchmarked once per
    length, at the first budget, and labelled without it)."""
    return method in ("full", TRANSFORMERS)
