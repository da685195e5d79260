"""The decode step through the fused Triton kernels where they cover it, the torch step elsewhere.

:func:`run_step` is what both engines call for a single-token step: with ``kernels="triton"`` it hands the step to
:func:`slake.kernels.triton_decode.fused_step_op` (two launches; one more for CriticalKV's value projection and
one more for an eviction across a layer's KV heads, four for both) when the method's decode rule has a fused
form (:meth:`slake.methods.base.Method.fused_rule`) and the storage is one the kernels address
(:class:`KVMemory`); otherwise it runs :func:`slake.cache.decode_step.decode_step` and records why in a
:class:`KernelReport` (logged once per reason and process), never silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from slake.cache.decode_step import KVMemory, SlotKV, StepSlots, decode_step
from slake.kernels import host_layer, launch_config
from slake.kernels.device_support import half_precision_products, quant_code
from slake.methods.base import Method
from slake.methods.decode_rule import FusedDecodeRule

__all__ = [
    "KVMemory", "KernelReport", "fused_arguments", "fused_decode_step", "fused_reason", "half_precision_dots",
    "keeps_order", "run_step",
]  # fmt: skip

logger = logging.getLogger("slake.kernels")

#: the storages the kernels read (:func:`slake.kernels.device_support.quant_code` gives their ``QUANT``)
_QUANT_STORAGE = (None, "int8", "fp8_e4m3")


#: the fallback reasons already logged in this process (:meth:`KernelReport.record`, :meth:`KernelReport.plan`): each
#: is said once per process, not once per cache (a ``slake eval`` makes a cache per sample, method and budget); each
#: cache's report still counts its own
_LOGGED: set[str] = set()


def _tell(reason: str) -> None:
    """Log ``reason`` (why a requested fused step runs in torch) the first time this process meets it."""
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("slake: the fused decode kernels do not cover this step (%s); it runs in torch", reason)


@dataclass
class KernelReport:
    """Which implementation ran the decode steps of one cache or pool.

    Attributes
    ----------
    steps : dict[str, int]
        Layer-steps per implementation that ran them eagerly: ``"triton"`` (the fused or dense kernels), ``"torch"``
        (the torch step), ``"sdpa"`` (the uncompressed step's one SDPA call over a prefix of slots, where no kernel
        choice applies).
    fallbacks : dict[str, int]
        Why a requested fused step ran in torch, counted per layer-step (planned layers counted once each).
    planned : dict[int, tuple[str, str | None]]
        Per layer, the implementation its static (compiled) steps run and why not the fused kernels where they were
        asked for, worked out on the host before the steps are captured (a compiled step records nothing:
        :meth:`slake.cache.decoding.Decoder.prepare_static`).
    auto : str | None
        Why ``kernels="auto"`` chose the torch step on a GPU (Triton missing or too old, an AMD GPU;
        :func:`slake.cache.compressed.kernel_choice`), None otherwise.
    """

    steps: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    planned: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    auto: str | None = None

    def record(self, kind: str, reason: str | None = None) -> None:
        """Count one layer-step run by ``kind``; ``reason``: why a requested fused step ran in torch (logged once per
        reason and process, as a warning of logger ``slake.kernels``)."""
        self.steps[kind] = self.steps.get(kind, 0) + 1
        if reason is not None:
            _tell(reason)
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def plan(self, layer: int, kind: str, reason: str | None = None) -> None:
        """Record that layer ``layer``'s static steps run ``kind`` (``reason``: why not the fused kernels asked for;
        logged once per reason and process), worked out before they are compiled. A layer planned again (a new
        prefill of the cache) replaces its plan."""
        old = self.planned.get(layer)
        if old is not None and old[1] is not None:
            self.fallbacks[old[1]] -= 1
            if not self.fallbacks[old[1]]:
                del self.fallbacks[old[1]]
        self.planned[layer] = (kind, reason)
        if reason is not None:
            _tell(reason)
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def summary(self) -> str:
        """What ran, for ``statistics()["kernels"]`` and ``slake bench``'s rows: ``"none"`` before any step;
        otherwise the implementations that ran or are planned joined by ``+`` (``"triton"``, ``"torch"``,
        ``"sdpa"``, ``"sdpa+triton"``...), followed where it applies by ``(auto: why)`` (``"auto"`` chose the torch
        step on a GPU) and ``(fallback: reason; ...)`` (why requested fused steps ran in torch)."""
        kinds = set(self.steps) | {kind for kind, _ in self.planned.values()}
        if not kinds:
            return "none"
        notes = []
        if self.auto is not None:
            notes.append(f"auto: {self.auto}")
        if self.fallbacks:
            notes.append(f"fallback: {'; '.join(sorted(self.fallbacks))}")
        text = "+".join(sorted(kinds))
        return f"{text} ({'; '.join(notes)})" if notes else text


def half_precision_dots(device: torch.device, keys_dtype: torch.dtype) -> bool:
    """Whether the first fused kernel multiplies queries by keys and probabilities by values in the keys' half
    precision (tensor cores, float32 accumulation): on a GPU, for float16 and bfloat16 keys, from compute capability
    8.0 (:func:`slake.kernels.device_support.half_precision_products`). Elsewhere (Triton's interpreter, a T4), for
    float32 or 8-bit keys, and in the second kernel's re-summed victim piece, the products are float32."""
    return half_precision_products(device, keys_dtype)


def keeps_order(method: Method, kernels: str) -> bool:
    """Whether an engine running ``method``'s decode with ``kernels`` (``"torch"``, ``"triton"``) keeps the
    ``order`` of :class:`~slake.cache.decode_step.StepSlots` for the fused step: with the fused kernels, for a decode
    rule that pools by position (SnapKV's, CAKE's, SLAKE's; CriticalKV's two stages over SnapKV's scores, and an
    eviction across a layer's KV heads, read it only over rows wider than ``launch_config.WIDE_SLOTS`` and sort
    narrower rows). The order costs 4 bytes per slot beside the 13 of a slot's position, validity and score."""
    if kernels != "triton":
        return False
    rule = method.fused_rule()
    return rule is not None and rule.kind == "pooled_attention" and rule.kernel > 1


def _why_not(method: Method, rule: FusedDecodeRule | None, slots: StepSlots, mem: KVMemory | None) -> str | None:
    """Why the fused kernels cannot run this step (None when they can) with the method's fused ``rule``. Facts of the
    step only (shapes, dtypes, the method): whether Triton can run at all was settled when the kernels were chosen
    (:func:`slake.cache.compressed.resolve_kernels`)."""
    if rule is None:
        return f"{method.name}'s decode rule has no fused form"
    if mem is None:
        return "a storage layout the kernels do not address"
    if (on_host := host_layer(mem.keys)) is not None:
        return on_host
    if mem.width > launch_config.WIDE_SLOTS and slots.target is not None:  # read in blocks (triton_wide), but
        if rule.kind == "pooled_attention" and rule.kernel > 1 and slots.order is None:
            return f"rows wider than {launch_config.WIDE_SLOTS} slots without their order by position"
    if mem.quant not in _QUANT_STORAGE:
        return f"{mem.quant} storage"
    if slots.linear is not None and slots.linear.dtype != torch.float32:
        return "a linear state that is not float32"
    if rule.kind == "expected_attention" and method.evict_before_output:
        return "a rule on mapped queries that evicts before the output"
    if method.evicts_across_heads and method.evict_before_output:
        # the layer kernel evicts across the KV heads after the attention kernel has run: it would attend the victim
        # the torch step leaves out (no shipped method combines the two)
        return "an eviction across a layer's KV heads before the output"
    if rule.two_stage is not None:
        if slots.weights is None:
            return "a two-stage rule without the slots' weights"
        if slots.layer is None or slots.layer.out_proj is None:
            return "a two-stage rule without the layer's output projection"
    return None


#: the rule whose flags a layer that does not evict at decode launches with (its code is ``KEEP_ALL``; see
#: :func:`fused_arguments`)
_NO_EVICTION = FusedDecodeRule(kind="recency")
_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_NEVER: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _never_target(device: torch.device, rows: int, heads: int) -> torch.Tensor:
    """The ``(rows, heads)`` int64 target of a layer that does not evict at decode: -1 everywhere, which the kernels
    read as "no eviction" (as the torch step reads a row's -1). Such a layer reaches the fused step only when it keeps
    a linear state or per-head visibility (a prompt compressed at prefill by a method set not to evict at decode,
    ``decode_eviction=False``); the others take the full cache's step. Never written by the kernels: one per device
    and shape in eager code, a new one under ``torch.compile`` (as :func:`_placeholder`)."""
    if torch.compiler.is_compiling():
        return torch.full((rows, heads), -1, dtype=torch.int64, device=device)
    key = (device, rows, heads)
    hit = _NEVER.get(key)
    if hit is None:
        hit = _NEVER[key] = torch.full((rows, heads), -1, dtype=torch.int64, device=device)
    return hit


def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor for a kernel argument its flags turn off (never read or written): one per device and dtype,
    made once, in eager code (each ``torch.empty`` is host time of an eager step on a GPU); under ``torch.compile``
    a new one, which the graph makes for free (a module-level tensor would be a guarded global)."""
    if torch.compiler.is_compiling():
        return torch.empty(0, dtype=dtype, device=device)
    key = (device, dtype)
    hit = _PLACEHOLDERS.get(key)
    if hit is None:
        hit = _PLACEHOLDERS[key] = torch.empty(0, dtype=dtype, device=device)
    return hit


def _step_facts(
    method: Method, slots: StepSlots, kv: SlotKV
) -> tuple[KVMemory | None, FusedDecodeRule | None, str | None]:
    """The storage the kernels would address, the rule they would launch with, and why they do not cover the step
    (None when they do): :func:`fused_arguments`'s host facts, before any tensor is made."""
    memory = getattr(kv, "kernel_memory", None)
    mem = memory() if memory is not None else None
    # a layer that does not evict at decode (it reaches this step only with a linear state or per-head visibility;
    # the others take the full cache's step) runs the kernels with a target of -1 and no rule (step_plan.KEEP_ALL:
    # the second kernel scores no slot and seeks no victim; the flags of the plain rule, recency): nothing is
    # evicted, so neither the method's rule nor its order of eviction and output matters, and a row of any width is
    # taken
    rule = _NO_EVICTION if slots.target is None else method.fused_rule()
    return mem, rule, _why_not(method, rule, slots, mem)


def fused_reason(method: Method, slots: StepSlots, kv: SlotKV) -> str | None:
    """Why the fused kernels do not cover a single-token step of ``method`` over ``slots`` and storage ``kv`` (None
    when they do), as :func:`fused_arguments` decides it: from host facts only (the method, the storage, dtypes,
    widths, which of the slots' tensors exist), so that it can be worked out before a compiled step is captured.

    Parameters
    ----------
    method : Method
        The compression method.
    slots : StepSlots
        The step's slots, as the engine passes them to :func:`run_step`.
    kv : SlotKV
        The layer's storage (a :class:`KVMemory` the kernels address where it has ``kernel_memory``).

    Returns
    -------
    str or None
        The reason, or None.
    """
    return _step_facts(method, slots, kv)[2]


def fused_arguments(
    method: Method,
    slots: StepSlots,
    kv: SlotKV,
    query: torch.Tensor,
    scaling: float,
    counter: torch.Tensor | None = None,
) -> tuple[tuple | None, str | None]:
    """What :func:`slake.kernels.triton_decode.fused_step` takes after the step's query, key and value:
    ``(arguments, None)``, or ``(None, reason)`` when the fused kernels do not cover the step. Made from the step's
    slots and storage, the method's fused rule, and the query's device, dtype and head size only; an engine may reuse
    them for a later step whose slots, storage and those facts are the same (``Decoder.step``). The step's output is
    in the query's dtype (the model's: a half-precision model needs no cast of it, a kernel fewer per layer)."""
    mem, rule, reason = _step_facts(method, slots, kv)
    if reason is not None or mem is None or rule is None:
        return None, reason
    never = slots.target is None
    from slake.kernels.step_plan import KEEP_ALL, RULE_CODES  # loaded by resolve_kernels

    dev = query.device
    target = slots.target
    if target is None:  # the kernels append and attend, and evict no slot
        target = _never_target(dev, *slots.valid.shape[:2])
        slots = replace(slots, target=target, order=None)
    elif method.evicts_across_heads and mem.width <= launch_config.WIDE_SLOTS:
        # the order is read over wide rows only: the layer kernel's evictions leave it stale, which the blockwise form
        # mends (triton_wide._drop_evicted) and the narrow form would find out only to sort the row anyway
        slots = replace(slots, order=None)
    empty_f = _placeholder(dev, torch.float32)
    empty_i = _placeholder(dev, torch.int64)
    rows = slots.rows
    row_index = empty_i
    if isinstance(rows, slice):  # a contiguous run of rows: views of the per-row tensors, no index needed
        slots = StepSlots(
            positions=slots.positions[rows],
            valid=slots.valid[rows],
            scores=slots.scores[rows],
            target=target[rows],
            newest=slots.newest,
            prompt_len=slots.prompt_len[rows],
            budget=slots.budget[rows],
            first_real=None if slots.first_real is None else slots.first_real[rows],
            head_visible=None if slots.head_visible is None else slots.head_visible[rows],
            linear=None if slots.linear is None else type(slots.linear)(slots.linear.aug[rows]),
            layer=slots.layer,
            weights=None if slots.weights is None else slots.weights[rows],
            order=None if slots.order is None else slots.order[rows],
        )
    elif rows is not None:
        row_index = rows
    low_dot = half_precision_dots(dev, mem.keys.dtype)
    flags = [
        quant_code(mem.quant, dev),
        int(low_dot),
        int(rows is not None and not isinstance(rows, slice)),
        int(slots.head_visible is not None),
        int(slots.first_real is not None),
        int(slots.linear is not None),
        KEEP_ALL if never else RULE_CODES[rule.kind],
        int(rule.group == "max"),
        int(rule.kernel),
        int(rule.pooling == "max"),
        int(rule.zero_window),
        int(rule.gain_floor),
        int(bool(method.window) and not method.newest_evictable),
        int(method.evict_before_output and not never),  # before: the victim's piece is summed again without it
        int(counter is not None),
        int(rule.value_norm),
        int(rule.two_stage is not None),
        int(rule.generated_first),
        int(slots.order is not None),
        int(method.evicts_across_heads and not never),  # the third kernel evicts across the layer's KV heads
    ]
    order = slots.order
    if order is not None and (order.dtype != torch.int32 or order.stride() != slots.positions.stride()):
        raise ValueError(
            f"slake: the slots' order must be int32 with the strides of their positions {slots.positions.stride()}, "
            f"got {order.dtype} with {order.stride()}"
        )
    d = query.shape[-1]
    query_map = method.decode_query_map(slots.layer, d, dev) if rule.kind == "expected_attention" else empty_f
    if query_map is None:
        raise ValueError(f"{method.name}: its fused rule needs decode_query_map")
    ratio = rule.two_stage
    weights = out_proj = empty_f
    if ratio is not None:  # _why_not made sure both exist
        assert slots.weights is not None and slots.layer is not None and slots.layer.out_proj is not None
        weights, out_proj = slots.weights, slots.layer.out_proj
    assert slots.target is not None
    arguments = (
        mem.keys,
        mem.values,
        list(mem.k_strides),
        list(mem.v_strides),
        empty_f if mem.k_scale is None else mem.k_scale,
        empty_f if mem.v_scale is None else mem.v_scale,
        list(mem.scale_strides),
        mem.table,
        int(mem.block_size),
        row_index,
        slots.positions,
        slots.valid,
        slots.scores,
        _placeholder(dev, torch.int32) if slots.order is None else slots.order,
        _placeholder(dev, torch.bool) if slots.head_visible is None else slots.head_visible,
        slots.newest,
        slots.target,
        slots.prompt_len,
        slots.budget,
        empty_i if slots.first_real is None else slots.first_real,
        empty_f if slots.linear is None else slots.linear.aug,
        empty_i if counter is None else counter,
        query_map,
        weights,
        out_proj,
        int(mem.width),
        float(scaling),
        int(method.window),
        int(method.sinks),
        float(rule.pinned),
        float(rule.epsilon),
        float(rule.two_stage_epsilon),
        0.0 if ratio is None else float(ratio),
        flags,
        query.dtype,  # the output: the kernels round their float32 result once, as a cast of the torch step's would
    )
    return arguments, None


def fused_decode_step(
    method: Method,
    slots: StepSlots,
    kv: SlotKV,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, str | None]:
    """:func:`~slake.cache.decode_step.decode_step` through the fused kernels: ``(output, None)``, or
    ``(None, reason)`` when they do not cover the step. ``counter`` (a 0-dim int64 tensor holding the new token's
    position, as ``slots.newest``) is advanced by one by the kernels."""
    arguments, reason = fused_arguments(method, slots, kv, query, scaling, counter)
    if arguments is None:
        return None, reason
    from slake.kernels.triton_decode import fused_step, fused_step_op  # loaded by resolve_kernels

    # the custom operator for torch.compile to capture; in eager code the function itself (the operator's Python
    # dispatch cost more than the step's own host work)
    op = fused_step_op if torch.compiler.is_compiling() else fused_step
    return op(query, key, value, *arguments), None


def run_step(
    kernels: str,
    method: Method,
    slots: StepSlots,
    kv: SlotKV,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    *,
    counter: torch.Tensor | None = None,
    report: KernelReport | None = None,
) -> torch.Tensor:
    """The single-token decode step with the chosen kernels (``"torch"`` or ``"triton"``); returns ``(R, Hq, d)``,
    float32 from the torch step, the query's dtype from the fused kernels. ``counter``: the layer's 0-dim position
    counter, advanced by one after the step (transformers engine). Where ``"triton"`` was asked for and the kernels
    do not cover the step, the torch step runs and ``report`` records why (a warning is logged the first time)."""
    if report is not None and torch.compiler.is_compiling():
        report = None  # a compiled step records nothing (a side effect per step would break the graph)
    if kernels == "triton":
        out, reason = fused_decode_step(method, slots, kv, query, key, value, scaling, counter)
        if out is not None:
            if report is not None:
                report.record("triton")
            return out
        if report is not None:
            report.record("torch", reason)
    elif report is not None:
        report.record("torch")
    out = decode_step(method, slots, kv, query, key, value, scaling)
    if counter is not None:
        counter.add_(1)
    return out
