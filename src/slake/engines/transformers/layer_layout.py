"""Which layers of a model slake compresses: the full-attention layers; sliding-window and chunked layers keep
transformers' own bounded cache (``docs/conventions.md#hybrid-models``).

Hybrid models (Gemma 2 and 3, gpt-oss, Cohere 2, Qwen 2 with ``use_sliding_window``) interleave full-attention
layers with sliding-window (or chunked) layers. A sliding layer already holds at most its window, so compressing it
saves little and would change what the model was trained to see; the full layers hold the whole context and are what
eviction should compress. :func:`attention_layout` reads the layer types the way transformers' own ``DynamicCache``
does (``get_layer_types_and_kwargs``), so a bounded layer gets exactly the cache class transformers would give it.

A model whose every layer is a sliding-window layer (Mistral or Phi-3 with ``sliding_window`` set) has no full layer
to compress: slake compresses its layers as full-attention layers while the sequence fits in the window, where the
two are the same, and refuses a longer sequence (:mod:`slake.engines.transformers.attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers.cache_utils import get_layer_types_and_kwargs

__all__ = ["BOUNDED_TYPES", "AttentionLayout", "attention_layout", "check_supported_attention"]

#: layer types whose cache transformers bounds itself (a window or a chunk)
BOUNDED_TYPES = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class AttentionLayout:
    """The layers of a model by what slake does with them.

    Attributes
    ----------
    layer_types : list[str]
        transformers' type of each decoder layer (``full_attention``, ``sliding_attention``, ``chunked_attention``).
    compressed : list[int]
        Indices of the layers slake compresses, in order; the i-th gets the compressor's layer i.
    bounded : dict[int, tuple[str, dict]]
        The layers left to transformers: index -> (layer type, keyword arguments of its cache-layer class).
    """

    layer_types: list[str]
    compressed: list[int]
    bounded: dict[int, tuple[str, dict]] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        return len(self.layer_types)

    @property
    def hybrid(self) -> bool:
        """True when some layers are left to transformers' bounded caches."""
        return bool(self.bounded)

    @classmethod
    def all_compressed(cls, num_layers: int) -> AttentionLayout:
        """Every layer compressed (a model without sliding layers, or a cache built from a layer count)."""
        return cls(layer_types=["full_attention"] * num_layers, compressed=list(range(num_layers)))


def text_config(config: Any) -> Any:
    """The text decoder's part of a model config (``get_text_config(decoder=True)``): a multimodal config such as
    ``Gemma3Config`` keeps the layer shapes and the vocabulary there; a plain causal LM's config is its own."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _model_label(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else str(getattr(config, "model_type", "this model"))


def check_supported_attention(config: Any, label: str | None = None) -> None:
    """Raise ValueError, naming the model, for attention slake does not model: logit soft-capping (Gemma 2),
    learned attention sinks (gpt-oss), multi-head latent attention (DeepSeek-V2/V3, MiniCPM3: ``kv_lora_rank``),
    values of another head size than the keys, layers sharing another's cache (Gemma 3n) and the architectures of
    :data:`_UNSUPPORTED_ATTENTION`. Their scores and outputs differ from plain softmax attention over one layer's own
    keys and values, so compressing them (or routing their bounded layers through SDPA) would silently change the
    model or fail deep inside it."""
    text = text_config(config)
    label = label or _model_label(config)
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{label} uses attention logit soft-capping (attn_logit_softcapping={softcap}), which slake "
            "does not model; it cannot compress this model's cache"
        )
    if str(getattr(text, "model_type", "")).startswith("gpt_oss"):
        raise ValueError(
            f"{label} (gpt-oss) adds learned attention sinks to every softmax, which slake does not "
            "model; it cannot compress this model's cache"
        )
    kind = str(getattr(text, "model_type", ""))
    why = _UNSUPPORTED_ATTENTION.get(kind)
    if why is None and getattr(text, "kv_lora_rank", None) is not None:
        why = "caches compressed latents (multi-head latent attention, kv_lora_rank) and expands them after the cache"
    v_dim, head_dim = getattr(text, "v_head_dim", None), getattr(text, "head_dim", None)
    if why is None and v_dim is not None and head_dim is not None and int(v_dim) != int(head_dim):
        why = f"has values of another head size than its keys (v_head_dim={v_dim}, head_dim={head_dim})"
    if why is None and getattr(text, "num_kv_shared_layers", None):
        why = "lets layers share another layer's KV cache (num_kv_shared_layers)"
    if why is not None:
        raise ValueError(f"{label} ({kind}) {why}, which slake does not model; it cannot compress this model's cache")


#: attention that goes through transformers' AttentionInterface but is not what slake's compressed layers compute
#: (2026-11-29 audit of transformers 5.24's causal LMs; each was wrong or failed deep inside without this refusal)
_UNSUPPORTED_ATTENTION = {
    "diffllama": "calls the attention function twice per layer, on two halves of its values (differential attention)",
    "doge": "adds a bias computed from its values to the attention mask (dynamic mask attention)",
    "jetmoe": "repeats its keys and values after the cache (mixture of attention heads)",
    "hrm_text": "stores each cycle of a layer under another cache index than the layer's own",
}


def attention_layout(config: Any) -> AttentionLayout:
    """The :class:`AttentionLayout` of a model config (its text decoder's, for multimodal configs).

    Raises
    ------
    ValueError
        For layer types slake cannot serve (linear attention, KV sharing between layers, ...).
    """
    text = text_config(config)
    types, kwargs = get_layer_types_and_kwargs(text)
    types = list(types)
    if isinstance(kwargs, dict):  # transformers 5.17: one dict for every layer (5.19 on: a list per layer)
        kwargs = [kwargs] * len(types)
    unknown = sorted({t for t in types if t != "full_attention" and t not in BOUNDED_TYPES})
    if unknown:
        raise ValueError(
            f"{_model_label(config)} has {', '.join(unknown)} layers; slake supports full-attention, "
            "sliding-window and chunked attention layers only"
        )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full and "chunked_attention" in types:
        # a chunked layer's bound lives in its mask alone (no sliding_window argument the attention could check):
        # compressed as a full layer, it would attend across chunks past the first
        raise ValueError(
            f"{_model_label(config)} has chunked-attention layers only (attention_chunk_size="
            f"{getattr(text, 'attention_chunk_size', None)}); slake compresses full-attention layers and leaves "
            "chunked ones to transformers, so it needs at least one full-attention layer"
        )
    if not full:  # every layer bounded: compressed as full layers while the sequence fits in the window
        return AttentionLayout(layer_types=types, compressed=list(range(len(types))))
    bounded = {i: (t, dict(kw)) for i, (t, kw) in enumerate(zip(types, kwargs)) if t in BOUNDED_TYPES}
    return AttentionLayout(layer_types=types, compressed=full, bounded=bounded)
