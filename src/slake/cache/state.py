"""What every phase of a compressed cache reads and writes (:class:`CacheState`), and the per-sequence facts fixed at
prefill (:class:`PrefillInfo`).

A :class:`slake.cache.compressed.CompressedKV` is this state plus one object per phase: the prefill and its cascade
(:mod:`slake.cache.prefill`), the chunked prefill (:mod:`slake.cache.chunked`), decoding
(:mod:`slake.cache.decoding`) and the accounting (:mod:`slake.cache.accounting`). The phases share the state; none
of them keeps a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slake.budgets.budget import Budget
from slake.cache.layer_store import _GROWTH, LayerStore
from slake.methods.base import LayerContext, Method

__all__ = ["CacheState", "PrefillInfo"]


@dataclass
class PrefillInfo:
    """Per-sequence facts fixed at prefill."""

    prompt_len: int  # padded length S
    real_len: torch.Tensor  # (B,) int64
    first_real: torch.Tensor  # (B,) int64 position of the first real token
    budget: torch.Tensor  # (B,) int64 average per-layer budget C (window included)
    compress: torch.Tensor  # (B,) bool: the whole prompt (real_len plus trailing tokens) > budget, False for a
    # method that keeps everything
    preferences: list[torch.Tensor | None] = field(default_factory=list)
    layer_budgets: torch.Tensor | None = None  # (B, L) int64 selectable budgets (final)
    #: host copies of ``compress.any()`` / ``compress.all()``, read at every decode step without a device read-back
    compress_any: bool = False
    compress_all: bool = False
    #: device copies of ``real_len``, ``first_real`` and ``budget`` by (name, device), made once per device (the
    #: decode step reads them; a model split over devices reads one copy per device)
    on_device: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict)

    def device_copy(self, name: str, device: torch.device) -> torch.Tensor:
        """``getattr(self, name)`` on ``device``, copied once per device and reused: no copy per step, also for a
        model whose layers are on several devices (one copy per device, rather than one copied again at every
        change of device, which made the fused steps' arguments again at every step)."""
        key = (name, device)
        t = self.on_device.get(key)
        if t is None:
            t = self.on_device[key] = getattr(self, name).to(device)
        return t

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (a batch selection or repetition) to every per-sequence tensor."""
        self.real_len, self.first_real, self.budget, self.compress = (
            fn(self.real_len),
            fn(self.first_real),
            fn(self.budget),
            fn(self.compress),
        )
        if self.layer_budgets is not None:
            self.layer_budgets = fn(self.layer_budgets)
        self.compress_any, self.compress_all = bool(self.compress.any()), bool(self.compress.all())
        self.on_device.clear()


class CacheState:
    """The layers of one generation and what the phases record about them.

    Attributes
    ----------
    method, budget, num_layers, kv_dtype :
        The configuration (``kv_dtype``: None or the canonical 8-bit storage name).
    layers : list[LayerStore | None]
        One store per layer, None before the layer's prefill.
    targets : list[torch.Tensor | None]
        Per layer, ``(B, Hkv)`` int64 slots kept after each decode step (-1 where a sequence is not compressed), or
        None where the layer does not evict at decode.
    seen : list[int]
        Tokens each layer has seen (kept or evicted), on the host; in static decode mode the device counters
        :attr:`position` are the truth.
    position : list[torch.Tensor | None]
        Per layer, the position of the next token as a 0-dim int64 device tensor (updated in place each step).
    info : PrefillInfo | None
        The per-sequence facts, from the first prefilled layer on.
    layer_context : list[LayerContext | None]
        Per layer, what the engine knows about the model's layer (rotary embedding, output projection), for methods
        whose ``layer_facts()`` name it (``PrefillInputs.layer``, ``DecodeInputs.layer``).
    pass_scores : torch.Tensor | None
        ``(L, B, Hkv, S)`` scores of the method's second pass over the prompt (``Method.second_pass``), set by the
        engine before the prefill (``PrefillInputs.pass_scores``).
    growth : int
        Slots a decode step adds to an append-only layer (the full cache, a prompt within the budget, no decode
        eviction) whose row is full: 256 by default, which amortises the reallocation; an engine that knows how many
        tokens it will decode sets it to that (:meth:`CompressedKV.expect_decode_steps`), so that the layer holds no
        room it never uses.
    """

    def __init__(self, method: Method, budget: Budget, num_layers: int, kv_dtype: str | None) -> None:
        self.method = method
        self.budget = budget
        self.num_layers = num_layers
        self.kv_dtype = kv_dtype
        self.layers: list[LayerStore | None] = [None] * num_layers
        self.targets: list[torch.Tensor | None] = [None] * num_layers
        self.seen: list[int] = [0] * num_layers
        self.position: list[torch.Tensor | None] = [None] * num_layers
        self.info: PrefillInfo | None = None
        self.layer_context: list[LayerContext | None] = [None] * num_layers
        self.pass_scores: torch.Tensor | None = None
        self.growth: int = _GROWTH

    def check_engine_inputs(self, layer_idx: int) -> None:
        """Refuse a prefill that lacks what the engine must give the method: its layer facts (rotary embedding,
        output projection) and its second pass's scores (ValueError, before anything is compressed)."""
        m = self.method
        if m.keeps_everything:
            return
        ctx = self.layer_context[layer_idx]
        missing = [f for f in m.layer_facts() if ctx is None or getattr(ctx, f) is None]
        if missing:
            raise ValueError(
                f"{m.name} needs the model's {' and '.join(missing)} of layer {layer_idx}, which this engine did not "
                f"provide (the transformers engine reads them from the model at the first forward; a model without "
                f"a rotary embedding or an output projection cannot run {m.name})"
            )
        if m.second_pass is not None and self.pass_scores is None:
            raise ValueError(
                f"{m.name} scores the prompt with a second pass ({m.second_pass}) before compressing it: prefill it "
                f"with slake.generate or slake.engines.transformers.generate.prefill, not a plain model forward "
                f"(model.generate given the same prompt then continues from that prefill)"
            )

    def store(self, layer_idx: int) -> LayerStore:
        """Layer ``layer_idx``'s store (RuntimeError before its prefill)."""
        store = self.layers[layer_idx]
        if store is None:
            raise RuntimeError(f"layer {layer_idx} has not been prefilled")
        return store

    def prefill_info(self) -> PrefillInfo:
        """The per-sequence facts (RuntimeError before the first prefill)."""
        if self.info is None:
            raise RuntimeError("no layer has been prefilled")
        return self.info

    def evicts(self, layer_idx: int) -> bool:
        """True when every row of the layer evicts one token per decode step (its size then stays fixed)."""
        info = self.info
        m = self.method
        return (
            self.targets[layer_idx] is not None
            and m.decode_eviction
            and info is not None
            and not m.keeps_everything
            and info.compress_all
        )

    def decode_bound(self, layer_idx: int) -> torch.Tensor:
        """``(B, Hkv)`` the most slots each row and KV head of a scored layer holds after a decode step: its target,
        or for an eviction across the layer's KV heads (``evicts_across_heads``) the row's largest target; -1 where
        the row keeps every token."""
        target = self.targets[layer_idx]
        assert target is not None
        if self.method.evicts_across_heads:
            return target.amax(-1, keepdim=True).expand_as(target)
        return target

    def scored(self, layer_idx: int) -> bool:
        """True when the layer's decode steps score its slots (it has targets and the method evicts at decode)."""
        m = self.method
        return self.targets[layer_idx] is not None and m.decode_eviction and not m.keeps_everything
