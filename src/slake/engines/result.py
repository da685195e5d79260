"""What an engine returns for one generation (:class:`GenerationResult`), the same for every engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

__all__ = ["STORED_PARTS", "GenerationResult", "held_bytes"]


@dataclass
class GenerationResult:
    """Output of one generation (``slake.generate``, :meth:`slake.engines.base.Engine.generate`).

    Attributes
    ----------
    texts : list[str]
        Decoded continuations, one per prompt (without the prompt).
    prompt_tokens : list[int]
        Real (unpadded) prompt length of each prompt.
    new_tokens : list[int]
        Tokens generated for each prompt (up to and including EOS).
    method, budget :
        What compressed the cache.
    kv_bytes : dict
        ``full`` (what an uncompressed cache would hold for the same real tokens), ``kept``, ``padding``, ``slack``,
        ``metadata``, ``linear_state`` (and ``sliding`` on hybrid models); bytes, at the end of generation.
    kept_tokens_per_layer : list[float]
        Mean kept tokens per KV head, per layer, at the end of generation.
    compressed : bool
        False when every prompt fit in the budget (no eviction happened; results equal the full cache).
    layer_budgets : list | None
        Per prompt and compressed layer, the tokens per KV head chosen by score at prefill: the layer's budget less
        its observation window and sinks, which every layer keeps besides (budget 64 with a 32-token window on a
        uniform method gives 32 per layer). Their sum over layers plus the layers' windows and sinks is the budget
        times the layers. None where nothing was compressed; in a batch, None for a prompt within the budget (it
        kept everything).
    prefill_s, decode_ms_per_token : float
        Wall time of the prefill (prompt forward and compression) and mean time per decoded token.
    sequences : torch.Tensor | None
        ``(B, prompt + new)`` token ids as ``model.generate`` returned them: the (padded) prompts followed by
        the generated tokens (padded after an early EOS). The transformers engine fills it; None from the vLLM
        engine. Not in :meth:`to_dict` and not in the repr.
    hyperparameters : dict
        Every hyperparameter of the method as used (profile values included).
    profile : dict | None
        ``{"source", "values", "budget"}`` of the model profile applied (:mod:`slake.methods.profiles`), None if none
        was.
    engine : str
        The engine that generated (``transformers`` or ``vllm``).
    extra : dict
        Engine-specific accounting (the vLLM engine's KV blocks held, block size and converted model folder; the
        transformers engine's kernels, compile and second-pass times, and ``kv_dtype`` for 8-bit kept entries).
    text : str
        Property: the first (or only) continuation, ``texts[0]``; :meth:`to_dict` includes it.
    """

    texts: list[str]
    prompt_tokens: list[int]
    new_tokens: list[int]
    method: str
    budget: int | float
    kv_bytes: dict
    kept_tokens_per_layer: list[float]
    compressed: bool
    prefill_s: float
    decode_ms_per_token: float
    layer_budgets: list | None = None
    sequences: torch.Tensor | None = field(default=None, repr=False)
    hyperparameters: dict = field(default_factory=dict)
    profile: dict | None = None
    engine: str = "transformers"
    extra: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The first (or only) continuation."""
        return self.texts[0]

    def to_dict(self) -> dict:
        """JSON-ready dict (``sequences`` dropped)."""
        d = asdict(self)
        d.pop("sequences")
        d["text"] = self.text
        return d


#: the byte counts of ``kv_bytes`` a cache holds, each with what it is (``docs/conventions.md``): ``slake demo``'s
#: "KV memory" and ``slake generate``'s "held" are their sum. Not among them: ``full``, what an uncompressed cache
#: would hold, and ``blocks_held``, the vLLM engine's block-granular total of ``kept`` and ``padding``
STORED_PARTS = (
    ("kept", "the kept keys and values"),
    ("padding", "slots up to the longest head of each layer"),
    ("slack", "room allocated beyond the longest head for the next decode tokens"),
    ("metadata", "per-slot positions, validity, scores and masks"),
    ("linear_state", "SLAKE's linear state of the evicted tokens"),
    ("sliding", "a hybrid model's sliding-window layers, in their own bounded caches"),
)


def held_bytes(kv_bytes: dict) -> int:
    """Every byte a cache holds, from a result's ``kv_bytes``: the sum of the parts of :data:`STORED_PARTS`."""
    return int(sum(kv_bytes.get(k) or 0 for k, _ in STORED_PARTS))
