"""The attention function slake registers with transformers (``AttentionInterface`` name ``"slake"``).

During prefill it computes the layer's exact attention with transformers' own SDPA function (so prefill outputs are
bit-identical to plain transformers) and then lets the compressor compress the layer; during decoding it attends over
the compressed layer (exact softmax over kept entries plus the PTAA linear term when the method has one). Calls that
do not come from a :class:`~slake.engines.transformers.cache.SlakeCache` (no cache, another cache class) fall back to
plain SDPA.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from slake.engines.transformers import forward_checks
from slake.engines.transformers.cache import SlakeCache, _set_current, current_layer
from slake.engines.transformers.cache_kwarg import cache_from_kwargs, with_cache
from slake.engines.transformers.layer_layout import check_supported_attention, text_config
from slake.engines.transformers.window_layer import _set_current as _set_window
from slake.engines.transformers.window_layer import current_window

ATTENTION_NAME = "slake"

_observer = threading.local()


@contextmanager
def observe_attention(fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, float], None]) -> Iterator[None]:
    """Within the block, every attention call that does not serve a :class:`SlakeCache` first calls
    ``fn(module, query, key, scaling)`` with the post-RoPE queries ``(B, Hq, q, d)`` and every key the module attends
    to ``(B, Hkv, n, d)`` (a second pass over a plain transformers cache: KVzip's reconstruction,
    :mod:`slake.engines.transformers.reconstruction`). The attention itself is unchanged."""
    previous = getattr(_observer, "fn", None)
    _observer.fn = fn
    try:
        yield
    finally:
        _observer.fn = previous


def key_padding_from_mask(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """``(B, S)`` bool padding mask (True = padded key) read off the last query row of a 4D prefill mask."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"expected a 4D attention mask, got shape {tuple(attention_mask.shape)}")
    last = attention_mask[:, 0, -1, -kv_len:]
    pad = ~last if last.dtype == torch.bool else last < -1.0
    pad = pad.expand(batch, kv_len)
    return pad if bool(pad.any()) else None


def slake_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Registered attention function; returns ``(B, n_q, Hq, d)`` like transformers' own functions."""
    # before any branch, the fallback to SDPA included (a sliding layer, a forward without a SlakeCache): neither
    # slake's layers nor SDPA compute these
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{type(module).__name__}: slake does not support attention logit soft-capping (softcap)")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"{type(module).__name__}: slake does not support learned attention sinks (s_aux, sinks)")
    window = current_window()
    if window is not None and (key is window.keys or key is window.prompt_keys):  # a fixed-shape sliding layer
        _set_window(None)
        if key is window.keys:  # a decode step: the ring, with its own validity (transformers' mask is not read)
            return window.attend(query, query.shape[-1] ** -0.5 if scaling is None else scaling), None
        window.finish_prompt(attention_mask)  # the prompt: transformers' sliding mask, below
    layer = current_layer()
    if layer is None or key is not layer.keys or layer.layer_idx != getattr(module, "layer_idx", layer.layer_idx):
        observer = getattr(_observer, "fn", None)
        if observer is not None:
            observer(module, query, key, query.shape[-1] ** -0.5 if scaling is None else scaling)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _set_current(None)
    window = kwargs.get("sliding_window")
    if window is not None:
        _check_window(layer, int(window))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer.pending is not None:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        padding = key_padding_from_mask(attention_mask, key.shape[0], key.shape[2])
        layer.finish_prefill(query, padding, scaling)
        return out, None
    out = layer.compressor.decode_attention(layer.slot, query, scaling)
    if out.dtype != query.dtype:
        out = out.to(query.dtype)
    B, Hq, nq, d = out.shape
    if nq == 1:  # (B, Hq, 1, d) and (B, 1, Hq, d) are one layout: a view, not a transpose and a copy
        return out.reshape(B, 1, Hq, d), None
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, slake_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def prepare_model(model) -> None:
    """Route the model's attention through slake's registered function (``set_attn_implementation("slake")``).

    Without a :class:`SlakeCache` the function behaves exactly like SDPA, so a prepared model still works with
    transformers' default cache.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (or its base model) whose attention modules call ``ALL_ATTENTION_FUNCTIONS``.

    Raises
    ------
    TypeError
        For anything but a torch module with a ``config`` (a transformers model).
    ValueError
        If the model cannot switch its attention implementation (its attention does not use
        ``ALL_ATTENTION_FUNCTIONS``), or its attention is not plain softmax attention (logit soft-capping, learned
        sinks: :func:`slake.engines.transformers.layer_layout.check_supported_attention`), naming the model.

    Notes
    -----
    It also registers a forward pre-hook on the model's base model (once) that checks, before any layer runs, that a
    :class:`SlakeCache` passed to the forward was built for the model's layer count and that the input continues the
    tokens it already holds (:meth:`SlakeCache.check_forward`). The hook keeps no state; it does nothing without a
    SlakeCache.
    """
    if not _is_transformers_model(model):
        raise TypeError(f"prepare_model expects a transformers model, got {type(model).__name__}")
    check_supported_attention(model.config, type(model).__name__)
    if getattr(type(model), "_supports_sdpa", None) is False:
        # slake's function is SDPA over a compressed cache (and SDPA itself without one, or on bounded layers):
        # transformers marks the models whose attention SDPA cannot compute (learned sinks, a text decoder that adds
        # its mask as a bias, ...)
        raise ValueError(
            f"{type(model).__name__} cannot run its attention as SDPA (transformers marks it _supports_sdpa = False: "
            f"learned attention sinks, or a mask added as a bias); slake's attention is SDPA over a compressed cache, "
            f"so it cannot serve this model"
        )
    _install_input_check(model)
    _install_prefill_check(model)
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        return
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface; "
            f"slake cannot compress its cache"
        )
    model.set_attn_implementation(ATTENTION_NAME)
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError(f"{type(model).__name__} refused the '{ATTENTION_NAME}' attention implementation")


def _is_transformers_model(model: Any) -> bool:
    """A torch module with a ``config`` (a function, so that the check does not narrow ``model``'s type)."""
    return isinstance(model, torch.nn.Module) and hasattr(model, "config")


def _install_prefill_check(model) -> None:
    """Wrap the ``generate`` prefill the model's class uses (``GenerationMixin._prefill``, or an override of it on
    the class that defines it) in :func:`_refuse_chunked_first_prompt`, once per process: it does nothing without a
    :class:`SlakeCache`, so other models and caches are untouched. On the class rather than the instance: a method
    bound in the instance's dict did not pickle (``torch.save(model)``), tied a shallow copy to the original and made
    the model a reference cycle. Models without ``_prefill`` (not a ``GenerationMixin``) are left as they are."""
    owner = next((c for c in type(model).__mro__ if "_prefill" in vars(c)), None)
    if owner is None or not callable(vars(owner)["_prefill"]) or getattr(vars(owner)["_prefill"], "_slake", False):
        return
    owner._prefill = _checked(vars(owner)["_prefill"])


def _checked(prefill):
    """``prefill`` (``GenerationMixin._prefill``) behind :func:`_refuse_chunked_first_prompt`."""

    @functools.wraps(prefill)
    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        handed = _handed_over(self, input_ids, generation_config, model_kwargs)
        if handed is not None:
            return handed
        _refuse_chunked_first_prompt(input_ids, generation_config, model_kwargs)
        return prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

    _prefill._slake = True
    return _prefill


def _handed_over(model, input_ids, generation_config, model_kwargs: dict) -> Any:
    """The model output of the prompt that :func:`slake.engines.transformers.generate.prefill` put in the cache, when
    ``generate`` is given exactly that prompt; else None (and ``generate`` prefills what it is given, as usual).

    ``prefill`` leaves its last position's logits on the cache (``SlakeCache.prefilled_logits``), used once: the
    first token is then chosen from them, and nothing is read again. This is how ``slake.generate`` runs a method with
    a second pass over the prompt (KVzip), which runs between the prompt's prefill and the first decode step: every
    prompt token is prefilled exactly (ARCHITECTURE.md decision 2), as in ``slake eval`` and ``slake bench``. Without
    this, transformers would read the whole prompt again over the filled cache (it slices ``input_ids[:, -0:]``)."""
    cache = cache_from_kwargs(model_kwargs)
    logits = getattr(cache, "prefilled_logits", None) if isinstance(cache, SlakeCache) else None
    prefilled = getattr(cache, "prefilled_input", None)
    if logits is None or prefilled is None:
        return None
    prompt, prompt_mask = prefilled
    cache.drop_prefilled()
    rows, held = int(input_ids.shape[0]), int(cache.get_seq_length())
    if int(input_ids.shape[1]) != held:
        return None  # more tokens than prefilled (the last prompt token after trailing_tokens=1, a later turn)
    if rows != logits.shape[0] or model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            f"the SlakeCache holds a prefilled prompt of {logits.shape[0]} row(s) and {held} tokens, but generate "
            f"was given {rows} row(s) of {int(input_ids.shape[1])} tokens (beam search and num_return_sequences "
            f"expand the batch): give generate that prompt itself"
        )
    mask = model_kwargs.get("attention_mask")
    same = torch.equal(input_ids, prompt.to(input_ids.device)) and (
        mask is None or torch.equal(mask.to(prompt_mask.dtype), prompt_mask.to(mask.device))
    )
    if not same:
        return None  # another prompt of the same size: generate reads it, and the cache refuses it as a new prompt
    for option in ("output_hidden_states", "output_attentions"):
        if getattr(generation_config, option, False):
            raise ValueError(
                f"generate({option}=True) after slake's prefill: the prompt's forward ran in prefill(), so its "
                f"{option.removeprefix('output_')} are not there to return; drop the option, or let generate prefill "
                f"a method without a second pass itself"
            )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits[:, None, :], **with_cache(model, cache))


def _refuse_chunked_first_prompt(input_ids, generation_config, model_kwargs: dict) -> None:
    """Refuse transformers' own chunked prefill (``generate(prefill_chunk_size=N)``, or a checkpoint's
    ``generation_config``) of a first prompt longer than one chunk into an empty :class:`SlakeCache`.

    transformers feeds such a prompt to the model in pieces, and the cache cannot tell a piece from a later turn: a
    first piece within the budget compresses nothing (and no later piece does), a larger one is compressed alone by
    the prefill rule and the rest evicted by the decode rule, which is neither the method's prefill nor slake's own
    chunked prefill. A later turn may be chunked: its tokens are appended one decode step after another either way.
    """
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    cache = cache_from_kwargs(model_kwargs)
    if chunk is None or not isinstance(cache, SlakeCache) or cache.get_seq_length() > 0:
        return
    embeds = model_kwargs.get("inputs_embeds")
    source = embeds if embeds is not None else input_ids
    length = int(source.shape[1]) if source is not None and source.dim() >= 2 else 0
    if length <= chunk:
        return
    raise ValueError(
        f"generate(prefill_chunk_size={chunk}) (or the model's generation_config) would feed this "
        f"{length}-token prompt to the SlakeCache in pieces, which it would take for a short prompt and later turns "
        f"(compressing nothing, or the first piece alone): use slake's chunked prefill instead, "
        f"slake.generate(..., prefill_chunk={chunk}) or SlakeCache(..., prefill_chunk={chunk}) filled by "
        f"slake.engines.transformers.generate.prefill, or pass prefill_chunk_size=None"
    )


def _check_slake_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: validate a SlakeCache against the model and the new input before any layer runs."""
    cache = cache_from_kwargs(kwargs)
    if not isinstance(cache, SlakeCache):
        return
    if kwargs.get("use_cache") is False:
        # the model would neither store this forward's keys and values nor read the cached ones as a continuation
        raise ValueError(
            "use_cache=False with a SlakeCache: the cache would not be used; pass use_cache=True (or leave it "
            "unset), also where the model's generation_config sets use_cache=False"
        )
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    source = ids if ids is not None else embeds
    q = int(source.shape[1]) if source is not None and source.dim() >= 2 else None
    batch = int(source.shape[0]) if source is not None and source.dim() >= 2 else None
    cfg = getattr(module, "config", None)
    text = None if cfg is None else text_config(cfg)
    cache.check_forward(
        getattr(text, "num_hidden_layers", None),
        q,
        kwargs.get("attention_mask"),
        kwargs.get("position_ids"),
        batch_size=batch,
    )
    if not torch.compiler.is_compiling():  # once per model config, in the eager prefill
        forward_checks.check_layout(cache, cfg)
    cache.bind_model(module)


def _install_input_check(model) -> None:
    base = getattr(model, "base_model", model)
    if not isinstance(base, torch.nn.Module) or getattr(base, "_slake_input_check", False):
        return
    base.register_forward_pre_hook(_check_slake_cache, with_kwargs=True)
    base._slake_input_check = True


def _check_window(layer, window: int) -> None:
    """Refuse a sequence longer than a sliding-window layer's ``window`` in a layer slake compresses as a full one.

    Eagerly a ValueError. A static (fixed-shape, compiled) step reads no host value: its position counter is the
    new token's position, checked on the device (``torch._assert_async``: a RuntimeError on the CPU, a device-side
    assert on CUDA) instead of a Python branch on it, which ``torch.compile(fullgraph=True)`` cannot trace."""
    length = layer.get_seq_length()
    if isinstance(length, torch.Tensor):  # static mode: the counter is the new token's position, not yet counted
        torch._assert_async(length < window, _window_message(layer.layer_idx, window))
    elif length > window:
        raise ValueError(_window_message(layer.layer_idx, window))


def _window_message(layer_idx: int, window: int) -> str:
    """Why a sequence longer than a sliding-window layer's window is refused (made only where it is needed)."""
    return (
        f"layer {layer_idx} uses sliding-window attention ({window} tokens) and the sequence "
        f"is longer; slake compresses full-attention layers only: either the model has none (every layer "
        f"is a sliding-window layer), or this SlakeCache was built without the model's configuration "
        f"(num_layers=...) and does not know which layers slide: build it with SlakeCache(..., "
        f"config=model.config)"
    )
