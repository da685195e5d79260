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
    """Keep every token (no compression). The budget is ignored."""

    window: int = 0
    decode_eviction: bool = False

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "full KV cache, no compression (upper bound)"
    paper: ClassVar[str] = "-"
    keeps_everything: ClassVar[bool] = True
