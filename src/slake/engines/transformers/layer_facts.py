"""What a method may need to know about a transformers model's layers: the rotary embedding and the output
projection (:class:`slake.methods.base.LayerContext`), read from the model without changing it.

Expected Attention moves query statistics between positions with the model's RoPE; CriticalKV weighs a token by the
norm of what its value writes through ``W_o``. The compressor holds references to these tensors (no copy); nothing is
stored on the model's modules.
"""

from __future__ import annotations

from typing import Any

import torch

from slake.methods.base import LayerContext
from slake.methods.rotary import Rotary

__all__ = ["layer_contexts"]


def _decoder_candidates(model: Any) -> list[Any]:
    """The modules that may hold a model's decoder layers and rotary embedding, most likely first.

    transformers' own lookup (``get_decoder()``) comes first: it finds the text decoder of a multimodal model
    (``Gemma3ForConditionalGeneration`` keeps it at ``model.language_model``), where the attribute walk below, written
    for causal LMs, stops at the wrapper. The walk follows as a fallback for models (or stand-ins) without that method
    or whose method answers something else.
    """
    candidates: list[Any] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(get_decoder())
        except (AttributeError, NotImplementedError, ValueError):  # a model that declines the generic lookup
            pass
    base = getattr(model, "base_model", model)
    inner = getattr(base, "model", None)
    candidates += [base, inner, getattr(base, "language_model", None), getattr(inner, "language_model", None)]
    return [c for c in candidates if c is not None]


def _first_attribute(candidates: list[Any], name: str) -> Any:
    """``name`` of the first candidate that has it (not None), else None."""
    return next((v for v in (getattr(c, name, None) for c in candidates) if v is not None), None)


def _rotary(rope: Any, layer_type: str) -> Rotary | None:
    """The rotary embedding of a layer type from the model's ``rotary_emb`` module (None: the model has none):
    transformers keeps one module on the text decoder, with one ``inv_freq`` buffer or (Gemma 3) one per layer type
    (``<type>_inv_freq``, ``<type>_attention_scaling``)."""
    if rope is None:
        return None
    inv = getattr(rope, f"{layer_type}_inv_freq", None)
    if isinstance(inv, torch.Tensor):
        return Rotary(inv.detach(), float(getattr(rope, f"{layer_type}_attention_scaling", 1.0) or 1.0))
    inv = getattr(rope, "inv_freq", None)
    if isinstance(inv, torch.Tensor):
        return Rotary(inv.detach(), float(getattr(rope, "attention_scaling", 1.0) or 1.0))
    return None


def layer_contexts(model: Any, compressed: list[int], layer_types: list[str]) -> list[LayerContext]:
    """One :class:`LayerContext` per compressed layer (the compressor's order) of ``model`` (a causal LM or its base
    model): the layer type's rotary embedding and the attention module's ``o_proj`` weight, each None where the
    model has none. A multimodal model's text decoder is read (:func:`_decoder_candidates`)."""
    candidates = _decoder_candidates(model)
    layers = _first_attribute(candidates, "layers")
    decoder = list(layers) if layers is not None else []
    rope = _first_attribute(candidates, "rotary_emb")
    out = []
    for i in compressed:
        attn = getattr(decoder[i], "self_attn", None) if i < len(decoder) else None
        proj = getattr(attn, "o_proj", None)
        weight = getattr(proj, "weight", None)
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        out.append(
            LayerContext(
                rotary=_rotary(rope, kind), out_proj=weight.detach() if isinstance(weight, torch.Tensor) else None
            )
        )
    return out
