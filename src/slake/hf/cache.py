"""The transformers cache class: a :class:`transformers.Cache` whose layers delegate to the engine.

Integration uses only official extension points (ARCHITECTURE.md decision 3.1): this cache-layer class and the
attention function registered in :mod:`slake.hf.attention`. ``update`` hands the new keys/values to the engine and
records which layer was updated last, so that the registered attention function, called right after by the model's
attention module, knows which compressed layer it serves.
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..budget_spec import Budget
from ..cache.compressed import CompressedKV
from ..methods.base import Method, make_method

_current = threading.local()


def current_layer() -> "SlakeCacheLayer | None":
    """The compressed layer whose ``update`` ran last in this thread (consumed by the attention function)."""
    return getattr(_current, "layer", None)


def _set_current(layer: "SlakeCacheLayer | None") -> None:
    _current.layer = layer


class SlakeCacheLayer(CacheLayerMixin):
    """One model layer of a :class:`SlakeCache`.

    The first ``update`` stores the prompt's keys/values and returns them unchanged for the exact prefill attention;
    the attention function then calls :meth:`finish_prefill`, which compresses the layer. Later updates append to
    the compressed store.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, engine: CompressedKV, layer_idx: int) -> None:
        super().__init__()
        self.engine = engine
        self.layer_idx = layer_idx
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # prompt K/V awaiting the attention function

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new keys/values; return what the attention function needs to see."""
        if self.pending is not None:
            raise _not_routed_error()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.engine.layers[self.layer_idx]
        if store is None:
            self.pending = (key_states, value_states)
            self.engine.seen[self.layer_idx] = key_states.shape[2]
            out = key_states, value_states
        else:
            store = self.engine.append(self.layer_idx, key_states, value_states)
            out = store.keys, store.values
        self.keys, self.values = out
        _set_current(self)
        return out

    def finish_prefill(self, queries: torch.Tensor, key_padding: torch.Tensor | None, scaling: float) -> None:
        """Compress the layer's prompt entries (called by the attention function after the exact attention)."""
        keys, values = self.pending
        self.pending = None
        self.engine.prefill_layer(self.layer_idx, queries, keys, values, key_padding, scaling)
        store = self.engine.layers[self.layer_idx]
        self.keys, self.values = store.keys, store.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Logical length: every token seen so far (kept or evicted), so positions stay absolute."""
        return self.engine.seen[self.layer_idx]

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise RuntimeError("a SlakeCache serves one generation; create a new one instead of resetting it")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.layer_idx == 0:
            self.engine.select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.layer_idx == 0:
            self.engine.repeat_batch(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.layer_idx == 0:
            self.engine.select_batch(indices)


class SlakeCache(Cache):
    """A compressed KV cache for ``model.generate(past_key_values=...)`` or a manual forward loop.

    The model must use the registered attention implementation (:func:`slake.hf.attention.prepare_model`).

    Parameters
    ----------
    method : str | Method
        Method name (see ``slake methods``) or a configured :class:`~slake.methods.base.Method`.
    budget : int | float | str | Budget
        Average cached tokens per layer and KV head, window included (papers' "cache size"), or a ratio in (0, 1).
    num_layers : int
        Number of decoder layers (``model.config.num_hidden_layers``).
    charge_linear_state : bool
        Charge SLAKE's linear state against the budget (equal-memory comparisons).
    kv_dtype : str | None
        Storage of the kept keys and values: None (model dtype) or ``"int8"`` / ``"fp8_e4m3"`` (8-bit codes with a
        float32 scale per row, dequantised in attention; :mod:`slake.cache.quant`).
    prefill_chunk : int | None
        Prefill the prompt in chunks of this many tokens, compressing after each chunk, so that prefill memory is
        bounded independently of the prompt length (ARCHITECTURE.md decision 2: an explicit trade of exactness).
        Used by :func:`slake.hf.generate.prefill` / :func:`slake.generate`; None (default) = exact prefill.
    **hyperparameters
        Overrides of the method's hyperparameters (e.g. ``window=16``).
    """

    def __init__(self, method: str | Method, budget: int | float | str | Budget, num_layers: int,
                 charge_linear_state: bool = False, prefill_chunk: int | None = None, kv_dtype: str | None = None,
                 **hyperparameters) -> None:
        if prefill_chunk is not None and int(prefill_chunk) < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None for an exact prefill), got {prefill_chunk}")
        m = make_method(method, **hyperparameters)
        self.engine = CompressedKV(m, budget, num_layers, charge_linear_state=charge_linear_state, kv_dtype=kv_dtype)
        self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
        super().__init__(layers=[SlakeCacheLayer(self.engine, i) for i in range(num_layers)])

    def begin_chunked_prefill(self, attention_mask: torch.Tensor) -> None:
        """Enter chunked-prefill mode for a prompt with this ``(B, S)`` attention mask (1 = real token).

        Feed the prompt chunk by chunk through the model, then call :meth:`end_chunked_prefill`
        (:func:`slake.hf.generate.prefill` does both).
        """
        self.engine.begin_chunked_prefill(attention_mask == 0)

    def end_chunked_prefill(self) -> None:
        """Leave chunked-prefill mode (later tokens are decode steps)."""
        self.engine.end_chunked_prefill()

    @property
    def method(self) -> Method:
        """The compression method."""
        return self.engine.method

    def check_routed(self) -> None:
        """Raise if a layer's prompt was stored but never reached the registered attention function."""
        if any(layer.pending is not None for layer in self.layers):
            raise _not_routed_error()

    def statistics(self) -> dict:
        """Cache statistics: bytes (kept, padding, metadata, linear state), kept tokens per layer, budgets."""
        self.check_routed()
        eng = self.engine
        info = eng.info
        return {
            "method": eng.method.name,
            "budget": eng.budget.value,
            "kv_dtype": eng.kv_dtype,
            "compressed": bool(info is not None and bool(info.compress.any())),
            "kv_bytes": eng.byte_counts(),
            "kept_tokens_per_layer": eng.kept_tokens_per_layer(),
            "layer_budgets": (info.layer_budgets.tolist() if info is not None and info.layer_budgets is not None
                              else None),
        }


def _not_routed_error() -> RuntimeError:
    return RuntimeError(
        "the model's attention did not go through slake's registered attention function, so the cache could not be "
        "compressed. Call slake.prepare_model(model) (it sets model.set_attn_implementation('slake')), and use a "
        "model whose attention modules call ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2, Qwen3, ...).")


__all__ = ["Budget", "SlakeCache", "SlakeCacheLayer", "current_layer"]
