"""What a method may need to know about a transformers model's layers: the rotary embedding and the output
projection (:class:`slake.methods.base.LayerContext`), read from the model without changing it.

Expected Attention moves query statistics between positions with the model's RoPE; CriticalKV weighs a token by the
norm of what its value writes through ``W_o``. The compressor holds references to these tensors (no copy); nothing is
stored on the model's modules.

The rotary embedding is checked per layer against slake's convention (:class:`slake.methods.rotary.Rotary`:
transformers' Llama ``rotate_half``), once per bind (:func:`_check_rotary`): the attention's ``forward`` source says
where it applies RoPE (``apply_*rot*`` / ``apply_*rope*`` calls and the ``if`` tests around them, evaluated on the
module: ``use_rope``, ``sliding_window``, ``is_sliding``...), and the function it calls is run on a probe vector with
the model's own cos/sin at a few positions and compared with :meth:`Rotary.rotate`. A layer that applies no RoPE gets
the identity rotation; a layer whose rotation differs (interleaved pairs, opposite sign, a complex rotation), cannot be
checked, or whose frequencies the model recomputes in its forward (``rope_type`` "dynamic") gets a
:class:`~slake.methods.rotary.RefusedRotary`, which refuses a method that uses it with the reason.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import re
import textwrap
from typing import Any

import torch

from slake.methods.base import LayerContext
from slake.methods.rotary import RefusedRotary, Rotary

__all__ = ["layer_contexts"]

#: names of the functions an attention forward applies RoPE with (transformers: ``apply_rotary_pos_emb``, Llama 4's
#: ``apply_rotary_emb``, Qwen2-VL's ``apply_multimodal_rotary_pos_emb``...)
_APPLY = re.compile(r"^apply_\w*(rot|rope)", re.IGNORECASE)
#: probe positions (0 is the identity in every convention; the others tell conventions apart) and the tolerance
_PROBE_POSITIONS = (0, 1, 2, 5, 11, 97)
_PROBE_TOL = 1e-3
#: where a decoder layer keeps its attention module (Llama: self_attn; GPT-NeoX: attention)
_ATTENTION_NAMES = ("self_attn", "attention", "self_attention", "attn")
_USERS = "expected-attention, ada-expected-attention and criticalkv[scorer=expected-attention]"


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


def _first_attribute(candidates: list[Any], *names: str) -> Any:
    """The first of ``names`` of the first candidate that has it (not None), else None."""
    values = (getattr(c, name, None) for c in candidates for name in names)
    return next((v for v in values if v is not None), None)


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


_COMPARE = {
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


class _Unknown(Exception):
    """An expression :func:`_evaluate` cannot evaluate from the attention module alone."""


def _evaluate(node: ast.expr, attn: Any) -> Any:
    """The value of an ``if`` test of an attention forward that reads only ``self`` (its attributes), constants and
    ``and``/``or``/``not``/comparisons; :class:`_Unknown` for anything else (another variable, a call)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return attn
    if isinstance(node, ast.Attribute):
        value = _evaluate(node.value, attn)
        if not hasattr(value, node.attr):
            raise _Unknown
        return getattr(value, node.attr)
    if isinstance(node, ast.BoolOp):
        values = (bool(_evaluate(v, attn)) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, attn)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, attn)
        for op, comparator in zip(node.ops, node.comparators):
            compare = _COMPARE.get(type(op))
            right = _evaluate(comparator, attn)
            if compare is None:
                raise _Unknown
            if not compare(left, right):
                return False
            left = right
        return True
    raise _Unknown


@functools.lru_cache(maxsize=256)
def _rope_sites(forward: Any) -> tuple[tuple[ast.expr, tuple[tuple[ast.expr, bool], ...]], ...] | None:
    """Where an attention ``forward`` applies RoPE: each ``apply_*rot*`` call's callee with the ``if`` tests around
    it (and the branch it sits in); None when the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    sites: list[tuple[ast.expr, tuple[tuple[ast.expr, bool], ...]]] = []

    def visit(node: ast.AST, tests: tuple[tuple[ast.expr, bool], ...]) -> None:
        if isinstance(node, (ast.If, ast.IfExp)):
            visit(node.test, tests)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                visit(child, (*tests, (node.test, True)))
            for child in node.orelse if isinstance(node.orelse, list) else [node.orelse]:
                visit(child, (*tests, (node.test, False)))
            return
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if _APPLY.match(name):
                sites.append((f, tests))
        for inner in ast.iter_child_nodes(node):
            visit(inner, tests)

    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else tree.body
    for stmt in body:
        visit(stmt, ())
    return tuple(sites)


def _applied_rope(attn: Any) -> tuple[str, Any]:
    """How the attention module ``attn`` applies RoPE, from its ``forward``'s source: ``("rope", fn)`` (one call of
    the function ``fn`` on this layer), ``("none", None)`` (every call sits in a branch this layer does not take: a
    NoPE layer) or ``("unknown", why)``."""
    forward = inspect.unwrap(type(attn).forward)
    sites = _rope_sites(forward)
    if sites is None:
        return "unknown", f"the source of {type(attn).__name__}.forward (where it applies RoPE) is unreadable"
    if not sites:
        return "unknown", f"{type(attn).__name__}.forward calls no apply_*rotary* function slake recognises"
    reached = []
    for callee, tests in sites:
        try:
            if all(bool(_evaluate(test, attn)) == branch for test, branch in tests):
                reached.append(callee)
        except _Unknown:
            conditions = " and ".join(ast.unparse(t) for t, _ in tests)
            return "unknown", f"it applies RoPE only when `{conditions}`, which slake cannot evaluate from the module"
    if not reached:
        return "none", None
    if len(reached) > 1:
        return "unknown", f"{type(attn).__name__}.forward applies RoPE in {len(reached)} places"
    callee = reached[0]
    if isinstance(callee, ast.Name):
        fn = getattr(forward, "__globals__", {}).get(callee.id)
    else:
        try:
            fn = _evaluate(callee, attn)
        except _Unknown:
            fn = None
    if not callable(fn):
        return "unknown", f"slake cannot find the function `{ast.unparse(callee)}` it applies RoPE with"
    return "rope", fn


def _interleaved(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` rotated in interleaved pairs ``(2i, 2i+1)`` by ``p * inv_freq[i]`` (GPT-J, Cohere, GLM), scaled."""
    r = rotary.rotary_dim
    ang = positions.to(x.device, torch.float64)[..., None] * rotary.inv_freq.to(x.device, torch.float64)
    cos, sin = ang.cos().float(), ang.sin().float()
    even, odd = x[..., 0:r:2].float(), x[..., 1:r:2].float()
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2) * rotary.scaling
    return torch.cat([out, x[..., r:].float()], -1)


def _probe(rope: Any, kind: str, apply: Any, rotary: Rotary, head_dim: int) -> str | None:
    """Compare the model's RoPE (``apply(q, k, cos, sin)`` with the cos/sin of its rotary module ``rope``, read
    through its undecorated forward so that no frequency update runs) with ``rotary.rotate`` on a probe vector at
    :data:`_PROBE_POSITIONS`: None where they agree, else what differs."""
    dev = rotary.inv_freq.device
    pos = torch.tensor([_PROBE_POSITIONS], device=dev)
    forward = inspect.unwrap(type(rope).forward)
    extra = {"layer_type": kind} if isinstance(getattr(rope, f"{kind}_inv_freq", None), torch.Tensor) else {}
    name = getattr(apply, "__name__", "its RoPE function")
    try:
        with torch.no_grad():
            emb = forward(rope, torch.zeros(1, device=dev), pos, **extra)
    except Exception as e:  # noqa: BLE001 - any failure means: not verified
        return f"its rotary embedding module could not be read with a probe ({type(e).__name__}: {e})"
    if not (isinstance(emb, tuple) and len(emb) == 2 and all(isinstance(t, torch.Tensor) for t in emb)):
        return f"its rotary embedding gives no (cos, sin) pair for {name} (a complex or otherwise different rotation)"
    cos, sin = emb
    g = torch.Generator().manual_seed(0)
    out = None
    for d in dict.fromkeys((head_dim, int(cos.shape[-1]))):  # a model that slices the rotary channels itself: r
        q, k = torch.randn(2, 1, 1, len(_PROBE_POSITIONS), d, generator=g).to(dev).unbind(0)
        try:
            with torch.no_grad():
                out = apply(q, k, cos.float(), sin.float())
        except Exception:  # noqa: BLE001 - a shape the function does not take: try the next
            continue
        break
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and all(isinstance(t, torch.Tensor) and t.shape == q.shape for t in out)
    ):
        return f"{name} could not be run on a probe vector in transformers' (cos, sin) layout"
    scale = float(torch.maximum(q.abs().max(), k.abs().max()))

    def close(rotate) -> bool:
        return all(float((y.float() - rotate(x)).abs().max()) <= _PROBE_TOL * scale for x, y in zip((q, k), out))

    p = pos[0]
    if close(lambda x: rotary.rotate(x, p)):
        return None
    if close(lambda x: _interleaved(rotary, x, p)):
        return f"{name} rotates interleaved channel pairs (2i, 2i+1), not slake's rotate-half pairs (i, i + r/2)"
    if close(lambda x: rotary.rotate(x, -p)):
        return f"{name} rotates by the opposite angle (rotate_half with the signs flipped)"
    return f"{name} rotates the query and key channels differently from slake's rotate-half convention"


def _rope_type(rope: Any, kind: str) -> str:
    rope_type = getattr(rope, "rope_type", None)
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(kind)
    return rope_type if isinstance(rope_type, str) else ""


def _check_rotary(rope: Any, attn: Any, kind: str, rotary: Rotary, probes: dict) -> tuple[Rotary | None, str | None]:
    """The rotary to bind for a layer (``rotary``, the identity for a layer without RoPE) and None, or None and the
    reason slake's rotate-half ``rotary`` does not model the layer's RoPE. ``probes`` caches :func:`_probe`'s
    answers within one bind."""
    if attn is None:
        return None, "slake found no attention module (self_attn) to check how it applies RoPE"
    try:
        how, what = _applied_rope(attn)
    except Exception as e:  # noqa: BLE001 - any failure means: not verified
        return None, f"slake could not read how the attention applies RoPE ({type(e).__name__}: {e})"
    if how == "none":
        return Rotary(rotary.inv_freq.new_zeros(0)), None  # NoPE: positions do not move a query
    if how == "unknown":
        return None, what
    if "dynamic" in _rope_type(rope, kind):
        return None, (
            "its rope_type 'dynamic' (dynamic NTK scaling) replaces the inverse frequencies inside the forward once a "
            "sequence outgrows max_position_embeddings, after slake has read them"
        )
    head_dim = getattr(attn, "head_dim", None)
    head_dim = int(head_dim) if isinstance(head_dim, int) else rotary.rotary_dim
    key = (what, kind, head_dim)
    if key not in probes:
        probes[key] = _probe(rope, kind, what, rotary, head_dim)
    return (rotary, None) if probes[key] is None else (None, probes[key])


def _model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) if config is not None else None
    for c in (text, config):
        model_type = getattr(c, "model_type", None)
        if isinstance(model_type, str) and model_type:
            return model_type
    return type(model).__name__


def layer_contexts(model: Any, compressed: list[int], layer_types: list[str]) -> list[LayerContext]:
    """One :class:`LayerContext` per compressed layer (the compressor's order) of ``model`` (a causal LM or its base
    model): the layer type's rotary embedding and the attention module's ``o_proj`` weight, each None where the
    model has none. A multimodal model's text decoder is read (:func:`_decoder_candidates`).

    The rotary embedding is checked against slake's rotate-half convention (:func:`_check_rotary`): a layer without
    RoPE gets the identity rotation, a layer whose RoPE slake's :class:`Rotary` does not model a
    :class:`RefusedRotary` naming the model type, the layer and the reason (a method that uses it raises it)."""
    candidates = _decoder_candidates(model)
    layers = _first_attribute(candidates, "layers")
    decoder = list(layers) if layers is not None else []
    rope = _first_attribute(candidates, "rotary_emb")
    probes: dict = {}
    out = []
    for i in compressed:
        attn = _first_attribute([decoder[i]], *_ATTENTION_NAMES) if i < len(decoder) else None
        proj = getattr(attn, "o_proj", None)
        weight = getattr(proj, "weight", None)
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        rotary = _rotary(rope, kind)
        if rotary is not None:
            checked, reason = _check_rotary(rope, attn, kind, rotary, probes)
            rotary = checked or RefusedRotary(
                rotary.inv_freq.new_zeros(0),
                reason=(
                    f"{_USERS} need the model's rotary embedding in slake's rotate-half convention (transformers' "
                    f"Llama rotate_half), checked per layer when the cache binds the model; {_model_type(model)} "
                    f"layer {i}: {reason}. Use a method that does not read the rotary embedding (e.g. snapkv)"
                ),
            )
        out.append(LayerContext(rotary=rotary, out_proj=weight.detach() if isinstance(weight, torch.Tensor) else None))
    return out
