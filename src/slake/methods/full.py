"""Full cache: the uncompressed upper bound (``docs/methods/baselines.md#full-cache``).

Every token is kept; decoding appends. Results equal transformers' default cache up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from slake.methods.base import Method, register


@register
@dataclass
class FullCache(Method):
    """Keep every token (no compression). The budget is ignored.

    The shared hyperparameters (``window``, ``sinks``, ``linear_cache``, ``decode_eviction``) cannot apply to a cache
    that evicts nothing: only their defaults are accepted (``full[linear_cache=true]`` is refused).
    """

    window: int = 0
    decode_eviction: bool = False

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "full KV cache, no compression (upper bound)"
    paper: ClassVar[str] = "-"
    keeps_everything: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        # none of these can apply to a cache that evicts nothing: refuse them rather than report them as in effect
        unused = {"window": 0, "sinks": 0, "linear_cache": False, "decode_eviction": False}
        given = [f"{k}={getattr(self, k)!r}" for k, v in unused.items() if getattr(self, k) != v]
        if given:
            raise ValueError(
                f"full keeps every token: window, sinks, linear_cache and decode_eviction do not apply to it "
                f"(got {', '.join(given)})"
            )
