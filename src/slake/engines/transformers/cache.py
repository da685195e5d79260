"""The transformers cache class: a :class:`transformers.Cache` whose layers delegate to the compressor.

Integration uses only official extension points (``docs/design.md#official-extension-points``): this cache-layer class
and the attention function registered in :mod:`slake.engines.transformers.attention`. ``update`` hands the new
keys/values to the
compressor and records which layer was updated last, so that the registered attention function, called right after by
the model's attention module, knows which compressed layer it serves.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from slake.budgets.budget import Budget
from slake.cache.chunked import check_chunkable
from slake.cache.compressed import CompressedKV
from slake.cache.state import PrefillInfo
from slake.engines.transformers import forward_checks
from slake.engines.transformers.bounded_layers import bounded_layer, held_bytes
from slake.engines.transformers.layer_layout import AttentionLayout, attention_layout, text_config
from slake.engines.transformers.python_options import check_count, check_flag
from slake.engines.transformers.window_layer import WindowLayer
from slake.methods.base import Method, check_compileable

_current = threading.local()


def current_layer() -> SlakeCacheLayer | None:
    """The compressed layer whose ``update`` ran last in this thread (consumed by the attention function)."""
    return getattr(_current, "layer", None)


def _set_current(layer: SlakeCacheLayer | None) -> None:
    _current.layer = layer


class SlakeCacheLayer(CacheLayerMixin):
    """One compressed model layer of a :class:`SlakeCache`.

    The first ``update`` stores the prompt's keys/values and returns them unchanged for the exact prefill attention;
    the attention function then calls :meth:`finish_prefill`, which compresses the layer. Later updates append to
    the compressed store. ``layer_idx`` is the model's layer index, ``slot`` the compressor's (they differ in hybrid
    models, whose sliding-window layers are not compressed).

    ``keys`` / ``values`` (transformers' cache interface) are the store's storage, not attention inputs: every slot,
    free ones included, and with 8-bit kept entries the codes without their scales. The layer's keys and values as
    attention reads them are ``compressor.layers[slot].dense_keys()`` / ``dense_values()`` over its ``valid`` slots.
    """

    is_compileable = False  # per instance: True in a SlakeCache built with max_cache_len (docs/compile.md)
    is_sliding = False
    is_croppable = False

    def __init__(
        self, compressor: CompressedKV, layer_idx: int, slot: int | None = None, siblings: list | None = None
    ) -> None:
        super().__init__()
        self.compressor = compressor
        self.layer_idx = layer_idx
        self.slot = layer_idx if slot is None else slot
        self._all = siblings  # every compressed layer of the cache (shared list), or None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # prompt K/V awaiting the attention function

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take the dtype and device of the layer's first keys (the store itself is made by its prefill)."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new keys/values; return what the attention function needs to see."""
        if self.pending is not None:
            raise _not_routed_error()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.compressor.layers[self.slot]
        if store is None:
            self.pending = (key_states, value_states)
            self.compressor.seen[self.slot] = key_states.shape[2]
            out = key_states, value_states
        else:
            forward_checks.check_same_heads(self.layer_idx, store.keys, store.values, key_states, value_states)
            store = self.compressor.append(self.slot, key_states, value_states)
            out = store.keys, store.values
        self.keys, self.values = out
        _set_current(self)
        return out

    def finish_prefill(self, queries: torch.Tensor, key_padding: torch.Tensor | None, scaling: float) -> None:
        """Compress the layer's prompt entries (called by the attention function after the exact attention)."""
        keys, values = self.pending
        self.pending = None
        self.compressor.prefill_layer(self.slot, queries, keys, values, key_padding, scaling)
        self._refresh_siblings()  # the cascade and static preallocation may replace earlier layers' tensors

    def _siblings(self) -> list:
        return self._all if self._all is not None else [self]

    def _refresh_siblings(self) -> None:
        """Point every compressed layer's ``keys`` / ``values`` at its store's current tensors (after the compressor
        replaced them: a prefill's cascade, a batch reordered, selected or repeated)."""
        for layer in self._siblings():
            store = self.compressor.layers[layer.slot]
            if store is not None:
                layer.keys, layer.values = store.keys, store.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask transformers builds for ``query_length`` new tokens: every token
        seen so far, or the query alone in static mode."""
        if self.compressor.static:
            # the registered attention function does not read the mask at decode (padding and visibility live in
            # the store's masks), so a fixed size keeps transformers' mask, built every step, fixed-shape
            return query_length, 0
        return self.compressor.seen[self.slot] + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:  # type: ignore[override]
        """Logical length: every token seen so far (kept or evicted), so positions stay absolute. In static mode a
        0-dim device tensor (as transformers' ``StaticLayer`` returns): a compiled step reads no host value."""
        if self.compressor.static:
            return self.compressor.position_of(self.slot)
        return self.compressor.seen[self.slot]

    def get_max_length(self) -> int:
        """-1: a compressed layer has no maximum length (it keeps its budget whatever the tokens seen)."""
        return -1

    def reset(self) -> None:
        """Refused (RuntimeError): evicted tokens are gone, so a cache serves one generation."""
        raise RuntimeError("a SlakeCache serves one generation; create a new one instead of resetting it")

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing for 0; any other crop is refused (:data:`CROP_REFUSAL`): evicted tokens are gone."""
        if tokens_to_remove:
            raise ValueError(CROP_REFUSAL)

    # the compressor maps every compressed layer's rows at once (when slot 0's layer is called); ``keys`` /
    # ``values`` then follow the new tensors, so that they show the cache's rows and no longer hold the old storage
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Take the batch rows ``beam_idx`` (beam search's reorder), every compressed layer at once."""
        if self.slot == 0:
            self.compressor.select_batch(beam_idx)
            self._refresh_siblings()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (``num_return_sequences``), every compressed layer at once."""
        if self.slot == 0:
            self.compressor.repeat_batch(repeats)
            self._refresh_siblings()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (in that order), every compressed layer at once."""
        if self.slot == 0:
            self.compressor.select_batch(indices)
            self._refresh_siblings()


class SlakeCache(Cache):
    """A compressed KV cache for ``model.generate(cache=...)`` or a manual forward loop.

    transformers before 5.24 takes it as ``past_key_values=``;
    :func:`slake.engines.transformers.cache_kwarg.with_cache` picks the
    name the model declares.

    The model must use the registered attention implementation
    (:func:`slake.engines.transformers.attention.prepare_model`).

    Parameters
    ----------
    method : str | Method
        Method name (see ``slake methods``) or a configured :class:`~slake.methods.base.Method`.
    budget : int | float | str | Budget
        Average cached tokens per layer and KV head, window included (papers' "cache size"), or a ratio in (0, 1).
    num_layers : int | PretrainedConfig | None
        Number of decoder layers (``model.config.num_hidden_layers``); a model config is accepted here too. Prefer
        ``config=model.config``, which cannot be wrong. Checked against the model at the first forward.
    charge_linear_state : bool
        Charge SLAKE's linear state against the budget (equal-memory comparisons).
    kv_dtype : str | None
        Storage of the kept keys and values: None (model dtype) or ``"int8"`` / ``"fp8_e4m3"`` (8-bit codes with a
        float32 scale per row, dequantised in attention; :mod:`slake.cache.quant`).
    prefill_chunk : int | None
        Prefill the prompt in chunks of this many tokens, compressing after each chunk, so that prefill memory is
        bounded independently of the prompt length (an explicit trade of exactness,
        ``docs/conventions.md#chunked-prefill``). A layer-preference method's (CAKE, SLAKE, LAVa) first chunk reaches
        past the budget by a chunk, so that its layer split sees evictions
        (:func:`slake.cache.chunked.first_chunk_end`).
        Used by :func:`slake.engines.transformers.generate.prefill` / :func:`slake.generate`; a longer first prompt
        handed whole to the model (``model.generate``) is refused. None (default) = exact prefill.
    max_cache_len : int | None
        Positions the cache must serve (prompt + new tokens), as transformers' ``StaticCache`` takes it. Given, the
        cache decodes with fixed shapes and without reading anything back from the device once the prompt is
        prefilled, and says so (``is_compileable``): layers that evict keep one free slot per row, append-only
        layers (the full cache, a prompt within its budget) get room for ``max_cache_len - prompt`` tokens up front.
        ``model.generate(..., compile_config=...)`` and ``torch.compile`` then run each decode step as one graph
        (``docs/compile.md``). A method whose decode cannot be fixed-shape is refused (ValueError). A hybrid model's
        sliding-window layers are then fixed rings of ``window`` slots
        (:class:`~slake.engines.transformers.window_layer.WindowLayer`); its prompt must come in one prefill, and
        chunked-attention layers are refused.
    config : PretrainedConfig | None
        The model's config (``model.config``), as transformers' own caches take it: the layer count and the layer
        types are read from it (in a hybrid model only the full-attention layers are compressed; sliding-window and
        chunked layers get transformers' own bounded cache layers, :mod:`slake.engines.transformers.layer_layout`),
        and the model's hyperparameter profile applies (:mod:`slake.methods.profiles`): hyperparameters that ``method``
        (a name or spec) and ``hyperparameters`` leave unset come from the model's calibrated or shipped profile, or the
        papers' tables. The profile applied is ``cache.profile`` (None when none was).
    profile_model : model or config, optional
        Where the profile comes from when it should not be ``config`` (default: ``config``; with neither, the
        method's defaults).
    kernels : str
        The single-token decode step's implementation: ``"auto"`` (default: Triton's fused kernels on NVIDIA GPUs,
        the torch step elsewhere), ``"torch"`` or ``"triton"`` (on the CPU through Triton's interpreter, for tests;
        ``docs/gpu.md#the-fused-decode-step``). Which ran is ``cache.statistics()["kernels"]``.
    **hyperparameters
        Overrides of the method's hyperparameters (e.g. ``window=16``).

    Notes
    -----
    One cache serves one conversation. A forward whose attention mask does not continue the cached sequence (a new,
    unrelated prompt given to ``model.generate`` with a used cache) raises ValueError instead of answering from the
    stale context; passing the whole conversation (the cached tokens followed by new ones) continues it. Because
    transformers hands the cache only the uncached tail of the input, an unrelated prompt *longer* than the cached
    sequence cannot be told apart from a continuation: create a new cache for each new prompt.
    """

    def __init__(
        self,
        method: str | Method,
        budget: int | float | str | Budget,
        num_layers: int | None = None,
        charge_linear_state: bool = False,
        prefill_chunk: int | None = None,
        kv_dtype: str | None = None,
        *,
        config=None,
        max_cache_len: int | None = None,
        profile_model=None,
        kernels: str = "auto",
        **hyperparameters,
    ) -> None:
        from slake.methods.profiles import resolve_method

        positional_config = num_layers if hasattr(num_layers, "num_hidden_layers") else None  # SlakeCache(m, b, cfg)
        source = next((x for x in (profile_model, config, positional_config) if x is not None), None)
        num_layers = _resolve_num_layers(num_layers, config)
        model_config = config if config is not None else positional_config
        self.layout = (
            attention_layout(model_config) if model_config is not None else AttentionLayout.all_compressed(num_layers)
        )
        if self.layout.num_layers != num_layers:
            raise ValueError(f"the config lists {self.layout.num_layers} layer types for {num_layers} layers")
        check_count("prefill_chunk", prefill_chunk, optional=True)  # None: an exact prefill
        check_count("max_cache_len", max_cache_len, minimum=2, optional=True)  # prompt + new tokens
        check_flag("charge_linear_state", charge_linear_state)
        m, self.profile = resolve_method(method, budget, source, **hyperparameters)
        self.compressor = CompressedKV(
            m,
            budget,
            len(self.layout.compressed),
            charge_linear_state=charge_linear_state,
            kv_dtype=kv_dtype,
            kernels=kernels,
        )
        self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
        #: set by :func:`slake.engines.transformers.generate.prefill` around a prefill it was asked to run exactly
        self.exact_prefill = False
        #: the model's class, once a forward has bound it (:meth:`bind_model`), for errors that name it
        self.model_name: str | None = None
        #: the model config whose layer layout was found to be this cache's (``forward_checks.check_layout``)
        self._layout_config: Any = None
        if self.prefill_chunk is not None:  # refused when the cache is built, not at its first prompt
            check_chunkable(m)
        if max_cache_len is not None:
            chunked = sorted(i for i, (kind, _) in self.layout.bounded.items() if kind != "sliding_attention")
            if chunked:
                raise ValueError(
                    f"compiled decoding (max_cache_len) is not supported for chunked-attention layers (layers "
                    f"{chunked}): build the cache without max_cache_len"
                )
            if self.layout.hybrid and prefill_chunk is not None:
                raise ValueError(
                    "compiled decoding (compile=True, --compile, or a SlakeCache with max_cache_len) of a hybrid model "
                    "takes its prompt in one prefill: its sliding-window layers keep a fixed ring (WindowLayer); use "
                    "either compiled decoding or a chunked prefill (prefill_chunk, --prefill-chunk) with this model"
                )
            check_compileable(m)
            self.compressor.max_cache_len = int(max_cache_len)
        # not ``self.max_cache_len``: transformers' Cache has a read-only property of that name in some versions
        self.static_len = None if max_cache_len is None else int(max_cache_len)
        #: a second-pass method's task prompt (KVzip: :class:`slake.engines.transformers.reconstruction.
        #: ReconstructionPrompt`), set by the caller that has the tokenizer; and the seconds its pass took
        self.reconstruction: Any = None
        self.second_pass_s: float | None = None
        #: ``(B, vocab)`` last-position logits of the prompt that
        #: :func:`slake.engines.transformers.generate.prefill` put in the cache, which ``model.generate``'s prefill
        #: returns once, instead of reading the prompt again, when it is given exactly that prompt (any forward
        #: drops them)
        self.prefilled_logits: torch.Tensor | None = None
        #: the ``(B, S)`` prompt and mask those logits are of: a generate of another prompt does not receive them
        self.prefilled_input: tuple[torch.Tensor, torch.Tensor] | None = None
        slots = {layer: slot for slot, layer in enumerate(self.layout.compressed)}
        compressed: list[SlakeCacheLayer] = []
        layers: list = []
        for i in range(num_layers):
            if i in slots:
                layer = SlakeCacheLayer(self.compressor, i, slots[i], compressed)
                layer.is_compileable = self.static_len is not None
                compressed.append(layer)
                layers.append(layer)
            else:
                kind, kwargs = self.layout.bounded[i]
                if self.static_len is not None:  # a fixed-shape ring (transformers' static layer recompiles per step)
                    layers.append(WindowLayer(kwargs["sliding_window"], self.static_len, layer_idx=i))
                else:  # transformers' own layer, copying what it keeps out of the whole prompt (bounded_layers)
                    layers.append(bounded_layer(kind, kwargs, i))
        super().__init__(layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Route a layer's new keys/values to its compressed layer (a clear error for a layer the cache lacks)."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"the model updated layer {layer_idx}, but this SlakeCache was built for "
                f"{len(self.layers)} layers; build it with SlakeCache(..., config=model.config)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_forward(
        self,
        num_hidden_layers: int | None,
        query_length: int | None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        batch_size: int | None = None,
    ) -> None:
        """Refuse a forward that does not fit this cache (called before every forward of a prepared model).

        Parameters
        ----------
        num_hidden_layers : int | None
            The model's layer count; must equal the cache's.
        query_length : int | None
            Tokens in this forward.
        attention_mask, position_ids : torch.Tensor | None
            The forward's 2D attention mask and position ids, when given. The first prompt's mask must be left
            padding; later, the mask must cover the cached tokens plus the new ones, with no 0 after a row's left
            padding, and the new tokens' positions must follow the cached ones (left padding accounted for), i.e.
            the new input continues the cached sequence.
        batch_size : int | None
            Sequences in this forward; once the cache holds tokens, must equal the sequences it holds.

        Raises
        ------
        ValueError
            For a layer-count mismatch, a prompt that is not left-padded, a mask with padding after the prompt, new
            input that is not a continuation of the cached sequence, a batch of another size than the cache's, a
            cache filled under ``torch.inference_mode()`` continued outside it, or layers that hold different
            numbers of tokens (an earlier forward stopped part-way through the model: an interrupt, or an error in
            a layer).
        """
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 1:
            # a decode loop's ``position_ids=torch.tensor([pos])``, which transformers broadcasts as ``[[pos]]``:
            # checked as that row, not passed unchecked
            position_ids = position_ids[None]
        forward_checks.check_forward(self, num_hidden_layers, query_length, attention_mask, position_ids, batch_size)

    def bind_model(self, model) -> None:
        """Give the compressor what the method needs to know about the model's layers (rotary embedding, output
        projection: :mod:`slake.engines.transformers.layer_facts`), once, before the first prefill. Called by the
        model's input check (:func:`slake.prepare_model`) at every forward; it does nothing for methods that need
        nothing or once bound."""
        self.model_name = type(model).__name__  # named by the errors of a model whose attention slake does not see
        eng = self.compressor
        if not eng.method.layer_facts() or any(c is not None for c in eng.layer_context):
            return
        from slake.engines.transformers.layer_facts import layer_contexts

        eng.layer_context = layer_contexts(model, self.layout.compressed, self.layout.layer_types)

    def begin_chunked_prefill(self, attention_mask: torch.Tensor) -> None:
        """Enter chunked-prefill mode for a prompt with this ``(B, S)`` attention mask (1 = real token).

        Feed the prompt chunk by chunk through the model, then call :meth:`end_chunked_prefill`
        (:func:`slake.engines.transformers.generate.prefill` does both).
        """
        self.compressor.begin_chunked_prefill(attention_mask == 0)

    def end_chunked_prefill(self, *, check: bool = True) -> None:
        """Leave chunked-prefill mode (later tokens are decode steps).

        Raises
        ------
        RuntimeError
            With ``check`` (the default), when the chunks fed stop short of the prompt given to
            :meth:`begin_chunked_prefill` (its budget and compress decision are the whole prompt's); ``check=False``
            leaves the mode without it, after a chunk that failed."""
        self.compressor.end_chunked_prefill(check=check)

    @property
    def method(self) -> Method:
        """The compression method."""
        return self.compressor.method

    def crop(self, max_length: int) -> None:
        """Refused (:data:`CROP_REFUSAL`) unless it removes nothing (``0``), before any layer is touched."""
        if max_length:
            raise ValueError(CROP_REFUSAL)

    def drop_prefilled(self) -> None:
        """Forget the logits ``prefill`` left for ``model.generate`` (and the prompt they are of): any forward does,
        and so does moving the rows (a first token from another row's prompt); ``generate`` then reads its input."""
        self.prefilled_logits = self.prefilled_input = None

    # each argument is checked before any layer moves: a hybrid model's bounded layers (transformers' own) come
    # before its first compressed layer and took what the compressed layers then refused (forward_checks.batch_index)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        beam_idx = forward_checks.batch_index(self, beam_idx, check_values=False)
        self.drop_prefilled()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        forward_checks.check_repeats(repeats)
        self.drop_prefilled()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (integers, or a boolean mask over the rows), in that order, in every layer."""
        indices = forward_checks.batch_index(self, indices)
        self.drop_prefilled()
        super().batch_select_indices(indices)

    def check_routed(self) -> None:
        """Raise if a layer's prompt was stored but never reached the registered attention function."""
        if any(getattr(layer, "pending", None) is not None for layer in self.layers):
            raise _not_routed_error(self.model_name)
        filled = sum(s is not None for s in self.compressor.layers)
        expected = len(self.layout.compressed)
        if self.compressor.info is not None and not self.compressor.chunked_prefill and filled != expected:
            what = "compressed layers" if self.layout.hybrid else "layers"
            raise ValueError(
                f"the model filled {filled} {what} but this SlakeCache was built for {expected}: a forward stopped "
                f"part-way through the model (an interrupt, or an error in a layer; create a new SlakeCache), or the "
                f"cache was built for another model (build it with SlakeCache(..., config=model.config))"
            )

    def byte_counts(self, sequence: int | None = None) -> dict[str, int]:
        """Bytes held: the compressor's counts (``full``, ``kept``, ``padding``, ``slack``, ``metadata``,
        ``linear_state``; :meth:`slake.cache.compressed.CompressedKV.byte_counts`) and, in a hybrid model,
        ``sliding``: what the sliding-window and chunked layers hold in transformers' own bounded caches (their
        tensors' storage, :func:`~slake.engines.transformers.bounded_layers.held_bytes`), or in a fixed-shape
        cache's rings (whose slots' positions count in ``metadata``).
        ``sequence``: one sequence of the batch."""
        counts = self.compressor.byte_counts(sequence)
        if self.layout.hybrid:
            held = [
                t
                for i in self.layout.bounded
                for t in (getattr(self.layers[i], "keys", None), getattr(self.layers[i], "values", None))
                if isinstance(t, torch.Tensor)
            ]
            counts["sliding"] = held_bytes(held, sequence)  # their storage: a view keeps all of it alive
            for i in self.layout.bounded:  # a fixed-shape cache's ring keeps each slot's position
                positions = getattr(self.layers[i], "positions", None)
                if positions is not None:
                    positions = positions if sequence is None else positions[sequence]
                    counts["metadata"] += positions.numel() * positions.element_size()
        return counts

    def statistics(self) -> dict:
        """Cache statistics: bytes (:meth:`byte_counts`; the full cache's bytes are not known here, ``slake.generate``
        adds them), kept tokens per compressed layer, budgets (``layer_budgets``: per sequence and compressed layer,
        the tokens chosen by score, window and sinks excluded: :class:`slake.engines.result.GenerationResult`), and
        which layers are compressed (``compressed_layers``) and which are left to their bounded cache
        (``sliding_layers``, empty unless the model is hybrid)."""
        self.check_routed()
        eng = self.compressor
        info = eng.info
        return {
            "method": eng.method.name,
            "budget": eng.budget.value,
            "kv_dtype": eng.kv_dtype,
            "kernels": eng.decoder.report.summary(),
            "compressed": bool(info is not None and bool(info.compress.any())),
            "kv_bytes": self.byte_counts(),
            "kept_tokens_per_layer": eng.kept_tokens_per_layer(),
            "compressed_layers": list(self.layout.compressed),
            "sliding_layers": sorted(self.layout.bounded),
            "layer_budgets": _layer_budgets(info),
        }


def _layer_budgets(info: PrefillInfo | None) -> list | None:
    """Each sequence's selectable budget per compressed layer, or None for a sequence within the budget (it kept
    everything; the allocation computed for it is never applied), None where nothing was compressed."""
    if info is None or info.layer_budgets is None or not bool(info.compress.any()):
        return None
    rows = info.layer_budgets.tolist()
    return [row if bool(c) else None for row, c in zip(rows, info.compress.tolist(), strict=True)]


def _resolve_num_layers(num_layers, config) -> int:
    """The cache's layer count from ``num_layers`` and/or a model ``config`` (which must agree)."""
    if num_layers is not None and not isinstance(num_layers, int) and hasattr(num_layers, "num_hidden_layers"):
        if config is not None:
            raise ValueError("pass the model config once (config=model.config)")
        num_layers, config = None, num_layers
    from_config = None
    if config is not None:
        from_config = getattr(text_config(config), "num_hidden_layers", None)
        if not isinstance(from_config, int) or from_config < 1:
            raise ValueError(f"the config has no valid num_hidden_layers ({from_config!r})")
    if num_layers is None:
        if from_config is None:
            raise ValueError("SlakeCache needs the model's config (config=model.config) or num_layers")
        return from_config
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if from_config is not None and from_config != num_layers:
        raise ValueError(f"num_layers={num_layers} disagrees with the config's num_hidden_layers={from_config}")
    return num_layers


#: why a SlakeCache cannot be cropped (``Cache.crop``: assisted decoding, prompt-lookup decoding)
CROP_REFUSAL = (
    "a SlakeCache cannot be cropped (Cache.crop: assisted or prompt-lookup decoding, assistant_model=, "
    "prompt_lookup_num_tokens=): the tokens its eviction dropped, and those folded into its linear state, cannot be "
    "taken back; decode without a draft model"
)


def _not_routed_error(model_name: str | None = None) -> RuntimeError:
    who = "the model's" if model_name is None else f"{model_name}'s"
    return RuntimeError(
        f"{who} attention did not go through slake's registered attention function with each layer's own cached "
        "keys, so the cache could not be compressed. Call slake.prepare_model(model) (it sets "
        "model.set_attn_implementation('slake')); if it was called, the architecture computes its attention in a "
        "way slake does not model (it changes the keys after the cache, or reads another layer's): use a model "
        "whose attention modules pass the cached keys and values to ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2, "
        "Qwen3, Gemma 3, ...)."
    )


__all__ = ["Budget", "SlakeCache", "SlakeCacheLayer", "check_compileable", "current_layer"]
