"""The attention backend the plugin registers in place of vLLM's ``CPU_ATTN`` (worker side).

It is vLLM's CPU backend plus compression, through vLLM's backend registry (``register_backend``):

* **Prefill** of a request whose prompt is longer than the budget: vLLM's kernel computes the layer's exact
  attention over the whole prompt; then :class:`slake.cache.compressed.CompressedKV` (the engine the transformers
  path uses) scores and selects the kept tokens of that layer from the same post-RoPE queries/keys, and the kept
  keys/values are written, per KV head, to the request's first cache slots. The scheduler side
  (:mod:`slake.engines.vllm.plugin.scheduler`) then returns the request's other blocks to vLLM's block pool. For
  CAKE/SLAKE (cascading layer budgets, ``docs/methods/cake.md#cascading-prefill``) a layer's budget is known only
  after the last layer's preference, so every layer's kept entries stay in this process until the last layer's
  prefill and are written then.
  The cascade is deferred (``CompressedKV(defer_cascade=True)``): each layer is evicted at its own stage and at the
  final one, not re-evicted at every stage in between: the same kept sets, without the cascade's hundreds of small
  re-evictions per request, whose memory bound buys nothing here (vLLM's blocks hold the whole prompt for the step);
  SLAKE's PTAA linear state (a fixed ``(d + 1)^2`` per layer and KV head) lives in this process, next to the metadata.
* **Decode** of all compressed requests of a step is one batched computation per layer
  (:class:`slake.engines.vllm.plugin.decode_pool.DecodePool`): the new token's key/value goes straight into each
  request's free slot in vLLM's blocks (the slot the previous step evicted, per KV head; vLLM's own write of it is
  masked), the rows' kept slots are gathered into one padded ``(requests, Hkv, W, d)`` tensor with a validity
  mask, and attention (SLAKE: exact softmax over the kept entries plus the linear term), the method's decode scores
  and the eviction of one slot per request and KV head run once for all of them, with the transformers engine's
  arithmetic. Only
  the new token's slot is written; the rest of the kept cache is only read. The cache of a compressed request never
  holds more than :meth:`slake.engines.vllm.plugin.config.SlakeVllmConfig.slots` slots per layer and KV head
  (``budget + 1``; CAKE/SLAKE: ``min(max_layer_budget, prompt) + 1``).
* Requests whose prompt fits in the budget, and every request when slake is not configured, run vLLM's kernel
  unchanged.

Positions are untouched: vLLM's runner gives token ``t`` after a prompt of ``N`` tokens position ``N + t`` (RoPE),
whatever the compressed length; only the cache bookkeeping (``seq_lens``, slots) of compressed requests changes.

The plugin's state for an engine (requests, the decode pool, the layers' cache tensors, timings) is one
:class:`slake.engines.vllm.plugin.state.PluginState`, made and owned by the engine's metadata builder
(:class:`SlakeCPUAttentionMetadataBuilder`); each step's plan (:class:`slake.engines.vllm.plugin.state.StepPlan`)
travels to the layers in the step's metadata (``metadata.slake``), as vLLM's own backends carry a step's state. This
module keeps nothing at module level. After prefill a request holds one row of the decode pool (positions,
validity and scores per slot, the PTAA linear state) and nothing else; keys and values stay in vLLM's blocks. A
finished request's row is released when the scheduler reports it finished, a preempted request's row is saved with a
copy of its kept keys/values (:meth:`PluginState.request_preempted`, at most :attr:`PluginState.save_max` requests and
:attr:`PluginState.save_max_bytes` bytes),
and when vLLM recomputes the request the saved kept cache is written into its new blocks and the recomputation's last
token decodes over it, so it continues exactly as if it had not been preempted (beyond that many saved requests, a
recomputed request is compressed afresh from its longer prefill, and its tokens may then differ). Those request
events reach the state through :mod:`slake.engines.vllm.plugin.worker`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from slake.engines.vllm.plugin.config import parse_config
from slake.engines.vllm.plugin.layer_facts import layer_index
from slake.engines.vllm.plugin.paged import CpuAttnLayout, PagedLayout, slot_mapping
from slake.engines.vllm.plugin.state import DecodeBatch, PluginState, StepPlan
from slake.engines.vllm.plugin.validate import check_layer_attention, validate_engine_config

__all__ = [
    "SlakeCPUAttentionBackend",
    "SlakeCPUAttentionBackendImpl",
    "SlakeCPUAttentionMetadata",
    "SlakeCPUAttentionMetadataBuilder",
    "layer_index",
]

logger = init_logger(f"vllm.plugins.{__name__}")  # under vLLM's logging configuration


@dataclass
class SlakeCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU attention metadata plus the plugin's plan of the step (None for an engine without slake)."""

    slake: StepPlan | None = None


class SlakeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder plus the plugin: it owns the engine's :class:`PluginState` and plans each step.

    Compressed decode rows see one cache slot in vLLM's kernel (the decode pool's output replaces theirs)."""

    #: how this backend's cache tensors store keys and values (``CPU_ATTN``'s block-transposed keys); a GPU backend
    #: would use :class:`slake.engines.vllm.plugin.paged.FlashAttnLayout` (``docs/gpu.md``)
    layout_cls: type[PagedLayout] = CpuAttnLayout

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        mc = vllm_config.model_config
        cfg = parse_config(vllm_config.additional_config, mc.hf_config)
        self.slake_state: PluginState | None = None
        if cfg is None:
            return
        validate_engine_config(cfg, vllm_config, warn=False)  # the engine's scheduler warns, once per engine
        check_isa(getattr(self, "isa", None), self.layout_cls)
        cfg = cfg.for_engine(getattr(mc, "max_model_len", None))  # the decode pool's rows: at most a request's tokens
        self.slake_state = PluginState(
            cfg,
            num_layers=int(mc.hf_text_config.num_hidden_layers),
            # the cache vLLM allocated (its attention layers' heads), not the model config's count: a key that the
            # architecture ignores (a stray num_key_value_heads in a GPT-2 or OPT config.json) sizes nothing here
            kv_heads=int(kv_cache_spec.num_kv_heads),
            head_dim=int(kv_cache_spec.head_size),
            block_size=self.block_size,
            max_rows=min(int(vllm_config.scheduler_config.max_num_seqs), 8),
            layout=self.layout_cls(),
        )
        logger.info("slake: compressing the KV cache with %s", cfg.describe())
        logger.info("slake: %s", cfg.describe_profile())
        # which decode step runs; a step the fused kernels do not cover runs in torch, logged once per reason
        # (logger slake.kernels) and counted in the report (PluginState.report: kernels, kernel_fallbacks)
        logger.info("slake: decode step: %s (kernels=%s)", self.slake_state.kernels, cfg.kernels)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        if self.slake_state is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        plan, cm = self.slake_state.plan_step(common_attn_metadata)
        md = super().build(common_prefix_len, cm, fast_build)
        return SlakeCPUAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, slake=plan)


def check_isa(isa: str | None, layout: type[PagedLayout]) -> None:
    """Refuse, at start-up, a CPU kernel ISA whose cache layout ``layout`` does not read (vLLM's CPU metadata builder
    picks ``isa`` from the dtype, block size and CPU: ``amx`` for bfloat16 at a block size that is a multiple of 32
    on an AMX CPU). The first compressed write still checks that the layout reads back what vLLM's op stored
    (:meth:`PagedLayout.check`), a second guard against a vLLM build that changes a layout under the same ISA."""
    if isa is None or not layout.isas or isa in layout.isas:
        return
    if isa in layout.refused_isas:
        raise ValueError(
            f"slake: vLLM's CPU attention picked its {isa!r} kernels, whose KV-cache layout the plugin cannot read (it "
            f"reads {layout.name} as stored by {', '.join(repr(i) for i in layout.isas)}); serve the model in float32 "
            f"or float16 (--dtype float32)"
        )
    logger.warning(
        "slake: vLLM's CPU attention picked its %r kernels, which the plugin was never run with (it was written "
        "and tested on %s); the first compressed request checks that the cache reads back what vLLM stored",
        isa,
        ", ".join(repr(i) for i in layout.isas),
    )


def _step_plan(layer_name: str) -> StepPlan | None:
    """The plugin's plan of the running step for ``layer_name``, from the step's metadata in vLLM's forward context
    (for ``do_kv_cache_update``, which vLLM calls without the metadata)."""
    md = get_forward_context().attn_metadata
    if isinstance(md, dict):
        md = md.get(layer_name)
    return getattr(md, "slake", None)


class SlakeCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention plus prefill compaction and the batched decode of compressed requests."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        model = getattr(vllm_config, "model_config", None)
        if parse_config(vllm_config.additional_config, getattr(model, "hf_config", None)) is not None:
            check_layer_attention(self)  # a slake engine: what this layer's compressed steps would drop

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping_: torch.Tensor) -> None:
        """Write the step's new keys and values into vLLM's paged cache, as the CPU backend does, except the
        decode tokens of compressed rows, which :meth:`forward`'s pool places in the slots their eviction freed;
        ValueError where vLLM built the layer with other KV heads than the model computes."""
        plan = _step_plan(layer.layer_name)
        if plan is not None and key.shape[0] != slot_mapping_.shape[0]:
            # vLLM's op writes key.shape[0] rows and reads that many slots, past the end of the mask's copy below
            raise ValueError(
                f"slake: attention layer {layer.layer_name} received {key.shape[0]} key rows for "
                f"{slot_mapping_.shape[0]} tokens: vLLM built it with {self.num_kv_heads} KV heads of size "
                f"{self.head_size}, which is not what the model computes (a config.json key that the architecture "
                f"ignores, such as num_key_value_heads in a GPT-NeoX config, which vLLM's Transformers backend "
                f"reads); remove that key from the model's config.json"
            )
        if plan is not None and plan.masked_tokens is not None:
            slot_mapping_ = slot_mapping_.clone()
            slot_mapping_[plan.masked_tokens] = -1  # compressed decode tokens are placed by the pool in forward
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping_)

    def _write(
        self,
        state: PluginState,
        layer,
        kv_cache: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_ids: torch.Tensor,
    ) -> None:
        """Write ``(Hkv, n, d)`` keys/values to the request's first ``n`` slots (vLLM's own cache-write op; the
        engine's first write checks that its layout reads back exactly what the op stored: the second guard after
        :func:`check_isa`, which refuses a known-unreadable ISA when the engine starts)."""
        bs = kv_cache.shape[2]
        n = keys.shape[1]
        slots = slot_mapping(block_ids, n, bs)
        k = keys.transpose(0, 1).contiguous().to(kv_cache.dtype)
        v = values.transpose(0, 1).contiguous().to(kv_cache.dtype)
        CPUAttentionBackendImpl.do_kv_cache_update(self, layer, k, v, kv_cache, slots)
        if not state.layout_checked:
            state.layout.check(kv_cache, k.transpose(0, 1), v.transpose(0, 1), block_ids)
            state.layout_checked = True

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ) -> torch.Tensor:
        out = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        plan: StepPlan | None = getattr(attn_metadata, "slake", None)
        if plan is None or not plan.active:
            return out
        li = layer_index(layer.layer_name)
        plan.state.caches[li] = kv_cache
        if plan.prefills:
            self._prefill(plan, li, layer, query, key, value, kv_cache)
        if plan.decode is not None:
            self._decode(plan, plan.decode, li, layer, query, key, value, kv_cache, output)
        return out

    def _prefill(self, plan: StepPlan, li: int, layer, query, key, value, kv_cache: torch.Tensor) -> None:
        """Compress layer ``li`` of the step's compressed prefills (vLLM's kernel has computed their exact
        attention), and write the kept entries of every layer whose budget is final."""
        state = plan.state
        pool = state.decode_pool()
        for st, qs, qe, blocks in plan.prefills:
            cache = st.cache
            assert cache is not None  # a prefilling request holds its engine object until its last layer
            q = query[qs:qe].transpose(0, 1).unsqueeze(0)
            k = key[qs:qe].transpose(0, 1).unsqueeze(0)
            v = value[qs:qe].transpose(0, 1).unsqueeze(0)
            cache.prefill_layer(li, q, k, v, None, self.scale)
            st.pending[li] = (self, layer, kv_cache, blocks)
            if cache.method.layer_budgets == "preference" and li < cache.num_layers - 1:
                continue  # the cascade may still shrink this layer: write every layer after the last one
            for pending_li, (impl, lay, layer_cache, blk) in sorted(st.pending.items()):
                store = cache.layers[pending_li]
                assert store is not None
                if store.capacity > blk.numel() * layer_cache.shape[2]:
                    raise RuntimeError(
                        f"slake: layer {pending_li} keeps {store.capacity} slots, more than the "
                        f"request's {blk.numel()} blocks hold"
                    )
                impl._write(state, lay, layer_cache, store.keys[0], store.values[0], blk)
                assert st.row is not None
                pool.load_layer(st.row, pending_li, store, cache.targets[pending_li])
                cache.layers[pending_li] = None  # the kept entries live in vLLM's blocks, the metadata in the pool
                st.layers_loaded += 1
            st.pending.clear()
            if st.layers_loaded == cache.num_layers:
                st.cache = None

    def _decode(
        self,
        plan: StepPlan,
        batch: DecodeBatch,
        li: int,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Layer ``li``'s batched decode of the step's compressed requests (restored ones first get their saved
        kept cache back); their rows of ``output`` are replaced by the pool's."""
        state = plan.state
        pool = state.decode_pool()
        t0 = time.perf_counter() if state.timing else 0.0
        for st, blocks in plan.restores:
            assert st.saved is not None
            k_saved, v_saved = st.saved["kv"][li]
            self._write(state, layer, kv_cache, k_saved, v_saved, blocks)
            if li == len(st.saved["kv"]) - 1:
                st.saved = None
        qidx, qs = batch.qidx, batch.qslice

        def take(t: torch.Tensor) -> torch.Tensor:  # the rows' tokens: a view when they are contiguous
            return t[qs] if qs is not None and t.is_contiguous() else t.index_select(0, qidx)

        o = pool.decode_layer(
            li,
            batch.row_index,
            batch.table,
            batch.blocks,
            batch.offsets,
            batch.newest,
            take(query),
            take(key),
            take(value),
            kv_cache,
            self.scale,
            batch.widths[li],
        )
        if qs is not None:
            output[qs] = o.reshape(qidx.numel(), *output.shape[1:])
        else:
            output.index_copy_(0, qidx, o.to(output.dtype).reshape(qidx.numel(), *output.shape[1:]))
        if state.timing:
            plan.decode_s += time.perf_counter() - t0
            if li == pool.num_layers - 1:
                state.record_step_time(plan)


class SlakeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with slake's compression (registered by :func:`slake.engines.vllm.plugin.register`)."""

    @staticmethod
    def get_impl_cls() -> type[SlakeCPUAttentionBackendImpl]:
        """The attention implementation vLLM builds per layer: :class:`SlakeCPUAttentionBackendImpl`."""
        return SlakeCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[SlakeCPUAttentionMetadataBuilder]:
        """The metadata builder vLLM runs per step: :class:`SlakeCPUAttentionMetadataBuilder`."""
        return SlakeCPUAttentionMetadataBuilder
