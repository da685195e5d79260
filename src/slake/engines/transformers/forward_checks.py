"""The checks a :class:`~slake.engines.transformers.cache.SlakeCache` runs before every forward of a prepared model
(:meth:`SlakeCache.check_forward`): the input must fit the cache, continue what it holds, and find every layer in
step. Host facts, with one read of the mask in eager steps; nothing runs inside a compiled step. ``cache`` is the
SlakeCache (typed ``Any``: this module is imported by the cache's, which it must not import back).

Also the checks that keep a cache whole where a model or a caller could leave it part-changed: the model's layer
layout against the cache's (:func:`check_layout`), each layer's new keys against the heads it holds
(:func:`check_same_heads`), and a batch operation's argument before any layer moves (:func:`batch_index`,
:func:`check_repeats`)."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from slake.cache.prefill import check_left_padding, check_real_tokens
from slake.cache.state import PrefillInfo
from slake.engines.transformers.layer_layout import attention_layout

__all__ = ["batch_index", "check_forward", "check_layout", "check_repeats", "check_same_heads"]


def check_forward(
    cache: Any,
    num_hidden_layers: int | None,
    query_length: int | None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    batch_size: int | None = None,
) -> None:
    """:meth:`SlakeCache.check_forward` (its docstring says what is refused). A forward also drops the logits that
    :func:`slake.engines.transformers.generate.prefill` left for ``model.generate``: they are the last prompt
    position's, stale once anything else is read."""
    cache.drop_prefilled()
    if num_hidden_layers is not None and int(num_hidden_layers) != len(cache.layers):
        raise ValueError(
            f"this SlakeCache was built for {len(cache.layers)} layers but the model has "
            f"{num_hidden_layers}; build it with SlakeCache(..., config=model.config)"
        )
    if not torch.compiler.is_compiling():
        _check_held(cache, batch_size)
        _check_chunking(cache, query_length)
    # model.generate gives a compileable cache's forward its 4D masks ready made (a dict of them per layer type
    # in a hybrid model): only a 2D mask says which tokens are padding
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    info = cache.compressor.info
    if cache.compressor.static:
        # a static-mode decode step (possibly compiled) reads no host counter; it must be one token
        if query_length is not None and query_length != 1:
            raise ValueError(
                f"a SlakeCache built with max_cache_len decodes one token per forward after the "
                f"prompt, got {query_length}"
            )
        # the mask check reads the mask back from the device: eager steps only, never inside a compiled one
        # (model.generate hands a compileable cache's forward a 4D mask anyway)
        if mask is not None and info is not None and not torch.compiler.is_compiling():
            _refuse_padding_after_prompt(mask, info)
        if info is not None and not torch.compiler.is_compiling():
            _check_static_positions(cache, position_ids, info)
        return
    _refuse_layers_out_of_step(cache)
    seen = cache.compressor.seen[0]
    if query_length is None:
        return
    if seen == 0:
        if mask is not None:  # the first prompt: left padding only, refused before any layer runs
            check_left_padding(mask == 0)
            if not cache.compressor.chunked_prefill:  # a chunk may be all padding in a row, a prompt may not
                check_real_tokens(mask == 0)
        return
    given = None if mask is None else mask.shape[-1]
    # no new token: transformers cut an input no longer than the cached tokens down to nothing (a new, shorter
    # prompt), which the model's layers would fail on with a reshape error
    bad = query_length == 0 or (given is not None and given != seen + query_length)
    if not bad and mask is not None and info is not None:
        _refuse_padding_after_prompt(mask, info)
    if (
        not bad
        and position_ids is not None
        and position_ids.dim() == 2
        and info is not None
        and position_ids.shape[-1] == query_length
        and position_ids.shape[0] in (1, len(info.first_real))
    ):
        expected = seen + query_length - 1 - info.first_real
        # only rows whose last new token is real: a prompt chunk may end inside a row's left padding, whose
        # position ids are a convention (model.generate gives padding 1), not a continuation
        real = expected >= 0
        bad = bool(((position_ids[:, -1].cpu() != expected) & real).any())
    if bad:
        size = "" if given is None else f" ({given} tokens)"
        raise ValueError(
            f"this SlakeCache already holds {seen} tokens of an earlier prompt and the new input{size} does not "
            f"continue it; a cache serves one conversation: create a new SlakeCache for a new prompt, or pass the "
            f"whole conversation (cached tokens + new ones) to continue it"
        )


def _check_static_positions(cache: Any, position_ids: torch.Tensor | None, info: PrefillInfo) -> None:
    """Check an eager static step's ``position_ids`` against the cache's next position on the device (no read-back:
    ``torch._assert_async``, a RuntimeError on the CPU, a device-side assert on CUDA), as the dynamic cache checks
    them on the host: each row's new token must be its next real token (its next position less its left padding).
    A compiled step is not checked (the hook runs in the graph; the row table would be a new constant)."""
    rows = info.first_real.shape[0]
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != 1:
        return
    if position_ids.shape[0] not in (1, rows):
        return  # a batch the cache does not hold: refused by the batch check
    counter = cache.compressor.decoder.position_of(0)
    expected = counter.to(position_ids.device) - info.device_copy("first_real", position_ids.device)
    seen = cache.compressor.seen[0]
    # as on the host: a row whose next token would still be left padding has no position to continue
    torch._assert_async(
        ((position_ids[:, -1] == expected) | (expected < 0)).all(),
        f"this SlakeCache holds the tokens of an earlier prompt (its {seen} prompt tokens and the steps after "
        f"them) and the new input's position_ids do not continue it (each row's next real token); a cache serves "
        f"one conversation: create a new SlakeCache for a new prompt",
    )


def _refuse_layers_out_of_step(cache: Any) -> None:
    """Refuse a forward over layers that hold different numbers of tokens: an earlier forward stopped part-way
    through the model (a Ctrl-C, an error in a layer), after some layers had stored its tokens and before the
    others did. Continued, the cache would silently keep those layers a token short from then on (a plain
    transformers cache fails on the shapes). Host counts only; a fixed-shape cache keeps its counts on the
    device and is not checked."""
    counts = [
        c for c in (getattr(layer, "get_seq_length", _no_count)() for layer in cache.layers) if isinstance(c, int)
    ]
    if counts and min(counts) != max(counts):
        raise ValueError(
            f"this SlakeCache's layers hold different numbers of tokens ({min(counts)} to {max(counts)}): an "
            f"earlier forward stopped part-way through the model (an interrupt, or an error in a layer), so the "
            f"cache matches no sequence; create a new SlakeCache (or continue from a copy taken before that "
            f"forward, copy.deepcopy(cache))"
        )


def _no_count() -> None:
    """The count of a layer without ``get_seq_length``: none, left out of the comparison."""
    return None


def _check_held(cache: Any, batch_size: int | None) -> None:
    """Refuse a forward of another batch size than the sequences the cache holds, or one outside
    ``torch.inference_mode()`` over a cache filled inside it (its tensors are inference tensors, which no later
    step could update in place); host facts only."""
    store = next((s for s in cache.compressor.layers if s is not None), None)
    if store is None:
        return
    held = int(store.valid.shape[0])
    if batch_size is not None and int(batch_size) != held:
        raise ValueError(
            f"this SlakeCache holds {held} sequence(s) but the input has {batch_size}: a cache continues the "
            f"batch it was filled with; keep or reorder its sequences first (cache.batch_select_indices(indices), "
            f"cache.batch_repeat_interleave(n)), or create a new SlakeCache"
        )
    if store.valid.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            "this SlakeCache was filled under torch.inference_mode() and cannot be updated outside it "
            "(model.generate runs under torch.no_grad()): continue it inside `with torch.inference_mode():` "
            "too, or fill it under torch.no_grad()"
        )


def _check_chunking(cache: Any, query_length: int | None) -> None:
    """Refuse a first prompt longer than ``prefill_chunk`` given whole to the model (``model.generate``): only
    :func:`slake.engines.transformers.generate.prefill` takes it in chunks, and the prefill memory the chunks
    bound would silently not be bounded."""
    chunk = cache.prefill_chunk
    if chunk is None or query_length is None or query_length <= chunk or cache.exact_prefill:
        return
    if cache.compressor.chunked_prefill or any(s is not None for s in cache.compressor.layers):
        return  # a chunk of a chunked prefill, or a later turn
    raise ValueError(
        f"this SlakeCache was built with prefill_chunk={chunk}, but a forward of the whole {query_length}-token "
        f"prompt (model.generate) would prefill it in one piece: only slake.generate and "
        f"slake.engines.transformers.generate.prefill take a prompt in chunks; call prefill(model, cache, "
        f"input_ids, attention_mask) first (model.generate of the same prompt then continues from its logits), or "
        f"build the cache without prefill_chunk"
    )


def _refuse_padding_after_prompt(mask: torch.Tensor, info: PrefillInfo) -> None:
    """Raise ValueError when the 2D ``mask`` (1 = attend) has a 0 at or after a row's first real prompt token
    (``info.first_real``): the cache knows only the first prompt's left padding, keeps and attends every later
    token, and would silently ignore such a 0 (one read of the mask back to the host)."""
    if mask.shape[0] != info.first_real.shape[0]:
        return  # a batch the cache does not hold: the continuation check refuses it
    cols = torch.arange(mask.shape[-1], device=mask.device)
    late = (mask == 0) & (cols >= info.device_copy("first_real", mask.device)[:, None])
    if not bool(late.any()):
        return
    row = int(late.any(-1).nonzero()[0, 0])
    at = int(late[row].nonzero()[0, 0])
    raise ValueError(
        f"the attention mask masks out position {at} of row {row}, after the prompt's left padding: a SlakeCache "
        f"takes padding only at the left of its first prompt (tokenizer.padding_side = 'left') and padding after "
        f"the prompt is not supported; give every later token a mask of 1 (model.generate does, also for rows that "
        f"have finished), and continue conversations whose new turns differ in length in separate caches"
    )


def check_layout(cache: Any, config: Any) -> None:
    """Refuse a model whose sliding-window or chunked layers are not the ones ``cache`` was built for.

    A hybrid cache (built with ``config=`` of a model with bounded layers) keeps transformers' bounded cache layer
    for each of them; given to a model of the same layer count whose layer is full attention (or bounded by another
    window), that layer would keep only a window of the keys its attention reads, and the tokens would be silently
    wrong. A cache built from a layer count (every layer compressed) is left to the attention function's window check
    (:func:`slake.engines.transformers.attention._check_window`). Checked once per model config (by identity)."""
    if config is None or not cache.layout.hybrid or getattr(cache, "_layout_config", None) is config:
        return
    try:
        model = attention_layout(config)
    except ValueError as err:  # layer types slake cannot serve: not the layout this cache was built for either
        raise ValueError(f"this SlakeCache was built for another model: {err}") from err
    for i, (kind, kwargs) in sorted(cache.layout.bounded.items()):
        theirs = model.bounded.get(i)
        if theirs != (kind, kwargs):
            what = model.layer_types[i] if theirs is None else f"{theirs[0]} {theirs[1]}"
            raise ValueError(
                f"this SlakeCache was built for a model whose layer {i} is {kind} {kwargs}, but this model's layer {i} "
                f"is {what}: the cache's layers would not hold what the model's attention reads; build the cache "
                f"for this model, SlakeCache(..., config=model.config)"
            )
    cache._layout_config = config


def check_same_heads(
    layer_idx: int, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
) -> None:
    """Refuse new keys and values ``(B, H, n, d)`` of another head count or size than the ``keys`` / ``values`` a
    layer holds (a cache continued by another model), before the layer changes. Shapes only: compile-safe. Called
    for every layer at every step, so the equal case compares the sizes and builds nothing (about 0.5 µs on this
    CPU, half the cost of comparing tuples of ints)."""
    ks, hs = key_states.shape, keys.shape
    if ks[1] == hs[1] and ks[-1] == hs[-1] and value_states.shape[-1] == values.shape[-1]:
        return
    held = (int(hs[1]), int(hs[-1]), int(values.shape[-1]))
    new = (int(ks[1]), int(ks[-1]), int(value_states.shape[-1]))
    if held != new:
        raise ValueError(
            f"layer {layer_idx} of this SlakeCache holds {held[0]} KV heads of size {held[1]} (values {held[2]}), "
            f"but the model gave {new[0]} heads of size {new[1]} (values {new[2]}): a cache serves the model that "
            f"filled it; create a new SlakeCache for this model (SlakeCache(..., config=model.config))"
        )


def _held_rows(cache: Any) -> int | None:
    """Sequences the cache holds (None before its first prefill)."""
    store = next((s for s in cache.compressor.layers if s is not None), None)
    return None if store is None else int(store.valid.shape[0])


def batch_index(cache: Any, index: Any, *, check_values: bool = True) -> torch.Tensor:
    """``index`` as a 1-D integer tensor of the rows ``cache`` holds, refused (ValueError) before any layer moves.

    A boolean mask over the rows is taken as the rows it marks (transformers' own layers index with it). With
    ``check_values`` every index must be a row (``0 <= i < rows``; one read of the index back to the host): the
    compressed layers' ``index_select`` takes no negative index where transformers' bounded layers do, and a hybrid
    cache's sliding layers before the first compressed one had moved when the compressed ones refused. Beam search's
    ``reorder_cache`` passes ``check_values=False`` (its rows are valid, and a step reads nothing back)."""
    index = torch.as_tensor(index)
    rows = _held_rows(cache)
    if index.dtype == torch.bool and index.dim() == 1:
        if rows is not None and index.numel() != rows:
            raise ValueError(f"a batch selection by a boolean mask of {index.numel()} for {rows} sequences")
        index = index.nonzero().flatten()
    if index.dim() != 1 or index.numel() == 0 or index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(f"a batch selection needs a non-empty 1-D integer index, got shape {tuple(index.shape)}")
    if check_values and rows is not None:
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= rows:
            raise ValueError(
                f"a batch selection takes indices of the {rows} sequences the cache holds (0 to {rows - 1}), "
                f"got {low if low < 0 else high}"
            )
    return index


def check_repeats(repeats: Any) -> None:
    """Refuse a batch repeat count that is not an integer >= 1, before any layer moves."""
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ValueError(f"a batch repeat needs an integer count >= 1, got {repeats!r}")
