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


def _decoder_layers(base: Any) -> list:
    layers = getattr(base, "layers", None)
    if layers is None and hasattr(base, "model"):
        layers = getattr(base.model, "layers", None)
    return list(layers) if layers is not None else []


def _rotary(base: Any, layer_type: str) -> Rotary | None:
    """The model's rotary embedding of a layer type: transformers keeps one module on the base model, with one
    ``inv_freq`` buffer or (Gemma 3) one per layer type (``<type>_inv_freq``, ``<type>_attention_scaling``)."""
    rope = getattr(base, "rotary_emb", None)
    if rope is None and hasattr(base, "model"):
        rope = getattr(base.model, "rotary_emb", None)
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
    model has none."""
    base = getattr(model, "base_model", model)
    decoder = _decoder_layers(base)
    out = []
    for i in compressed:
        attn = getattr(decoder[i], "self_attn", None) if i < len(decoder) else None
        proj = getattr(attn, "o_proj", None)
        weight = getattr(proj, "weight", None)
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        out.append(
            LayerContext(
                rotary=_rotary(base, kind), out_proj=weight.detach() if isinstance(weight, torch.Tensor) else None
            )
        )
    return out
