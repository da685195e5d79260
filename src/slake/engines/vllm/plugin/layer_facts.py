"""What a method may need to know about the layers of the model vLLM runs: the rotary embedding and the output
projection (:class:`slake.methods.base.LayerContext`), read from vLLM's model without changing it.

Expected Attention moves query statistics between positions with the model's RoPE, CriticalKV weighs a token by the
norm of what its value writes through ``W_o`` (``docs/methods/expected-attention.md``, ``docs/methods/criticalkv.md``).
The transformers engine reads these from a transformers model (:mod:`slake.engines.transformers.layer_facts`); this
is the same for vLLM's model classes, whose attention modules (Llama, Qwen2, Mistral, ...) hold the paged attention
layer as ``attn`` (with its ``layer_name``), the output projection as ``o_proj`` and the rotary embedding as
``rotary_emb``. Under tensor parallelism ``o_proj`` is a ``RowParallelLinear`` whose weight holds the columns of this
rank's query heads, which are the heads this rank's decode step scores.

This module imports nothing of vLLM (it reads attributes), so that it is tested without it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from slake.methods.base import LayerContext
from slake.methods.rotary import Rotary

__all__ = ["layer_index", "out_proj_weight", "vllm_layer_contexts", "vllm_rotary"]

_LAYER_RE = re.compile(r"\.(\d+)\.")

#: vLLM rotary classes whose inverse frequencies are ``_compute_inv_freq(base)`` and whose cosines are unscaled
_PLAIN_ROPE = ("RotaryEmbedding", "Llama3RotaryEmbedding")


def layer_index(layer_name: str) -> int:
    """Decoder-layer index of an attention layer name such as ``model.layers.3.self_attn.attn``."""
    found = _LAYER_RE.findall(f".{layer_name}.")
    if len(found) != 1:
        raise RuntimeError(f"slake: cannot read the layer index of attention layer {layer_name!r}")
    return int(found[0])


def vllm_rotary(rope: Any) -> Rotary:
    """A :class:`~slake.methods.rotary.Rotary` equal to a vLLM rotary embedding module ``rope``.

    Supported: plain RoPE and Llama 3's frequency scaling (``inv_freq = rope._compute_inv_freq(rope.base)``, scaling
    1) and YaRN (``_compute_inv_freq(rope.scaling_factor)``, its ``mscale`` as the attention scaling), in the
    ``rotate_half`` (NeoX) convention, which is :class:`Rotary`'s.

    Raises
    ------
    ValueError
        For another rotary class (linear or dynamic NTK scaling, M-RoPE, ...) or the GPT-J (interleaved) convention:
        the plugin cannot express it, and a wrong rotation would silently move the queries to wrong positions.
    """
    kind = type(rope).__name__
    if not getattr(rope, "is_neox_style", False):
        raise ValueError(f"slake: the model's rotary embedding ({kind}) rotates interleaved pairs, which slake's "
                         "Rotary (rotate_half) cannot express")  # fmt: skip
    if kind in _PLAIN_ROPE:
        inv, scaling = rope._compute_inv_freq(rope.base), 1.0
    elif kind == "YaRNScalingRotaryEmbedding":
        inv, scaling = rope._compute_inv_freq(rope.scaling_factor), float(rope.mscale)
    else:
        raise ValueError(
            f"slake: the model's rotary embedding {kind} is not one the plugin reads (plain, Llama 3 or YaRN RoPE)"
        )
    cache = getattr(rope, "cos_sin_cache", None)
    device = cache.device if isinstance(cache, torch.Tensor) else None
    # on the model's device: the decode rule's rotations then run where the step runs, with no host copy per step
    inv = torch.as_tensor(inv, dtype=torch.float32).detach().to(device)
    if 2 * inv.numel() != int(rope.rotary_dim):
        raise ValueError(f"slake: {kind} has {inv.numel()} frequencies for rotary_dim {rope.rotary_dim}")
    return Rotary(inv, scaling)


def out_proj_weight(proj: Any) -> torch.Tensor:
    """``W_o`` ``(hidden, Hq * d)`` of a vLLM output projection (this rank's columns under tensor parallelism).

    vLLM's CPU backend may repack a linear layer's weight for its GEMM kernels and leave ``weight`` empty
    (``dispatch_cpu_unquantized_gemm``); the weight is then read back through the layer's own linear method applied
    to the identity (``I W^T = W^T``; every output is one product with 1, so the values are exact), without the
    bias and without the all-reduce of ``RowParallelLinear.forward``. The same probe reads a quantised layer's
    effective weight."""
    weight = getattr(proj, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0 and weight.dtype.is_floating_point:
        return weight.detach()
    method = getattr(proj, "quant_method", None)
    n = getattr(proj, "input_size_per_partition", None)
    if method is None or n is None:
        raise ValueError(f"slake: cannot read the output projection's weight of {type(proj).__name__}")
    dtype = getattr(proj, "params_dtype", None) or torch.get_default_dtype()
    device = next((p.device for p in proj.parameters() if p.numel()), torch.device("cpu"))
    with torch.no_grad():
        eye = torch.eye(int(n), dtype=dtype, device=device)
        return method.apply(proj, eye, None).transpose(0, 1).contiguous()


def vllm_layer_contexts(model: Any, num_layers: int, facts: tuple[str, ...]) -> list[LayerContext]:
    """One :class:`LayerContext` per decoder layer of vLLM's ``model``, with the ``facts`` a method names
    (``"rotary"``, ``"out_proj"``; :meth:`slake.methods.base.Method.layer_facts`).

    Raises
    ------
    ValueError
        When a layer's attention module lacks what ``facts`` name, or the model's layers cannot be found.
    """
    found: dict[int, Any] = {}
    for _, module in model.named_modules():
        attn = getattr(module, "attn", None)
        name = getattr(attn, "layer_name", None)
        if isinstance(name, str):
            found[layer_index(name)] = module
    missing = sorted(set(range(num_layers)) - set(found))
    if missing:
        raise ValueError(
            f"slake: cannot find the attention modules of layers {missing[:5]} in {type(model).__name__} (a module "
            "holding the paged attention layer as 'attn'), which the method's model facts are read from"
        )
    out = []
    for i in range(num_layers):
        module = found[i]
        rotary = out_proj = None
        if "rotary" in facts:
            rope = getattr(module, "rotary_emb", None)
            if rope is None:
                raise ValueError(f"slake: layer {i}'s attention module {type(module).__name__} has no rotary_emb")
            rotary = vllm_rotary(rope)
        if "out_proj" in facts:
            proj = getattr(module, "o_proj", None)
            if proj is None:
                raise ValueError(f"slake: layer {i}'s attention module {type(module).__name__} has no o_proj")
            out_proj = out_proj_weight(proj)
        out.append(LayerContext(rotary=rotary, out_proj=out_proj))
    return out
