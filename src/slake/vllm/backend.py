"""The attention backend the plugin registers in place of vLLM's ``CPU_ATTN`` (worker side).

It is vLLM's CPU backend plus compression, through vLLM's backend registry (``register_backend``):

* **Prefill** of a request whose prompt is longer than the budget: vLLM's kernel computes the layer's exact
  attention over the whole prompt; then :class:`slake.cache.compressed.CompressedKV` (the engine the transformers
  path uses) scores and selects the kept tokens of that layer from the same post-RoPE queries/keys, and the kept
  keys/values are written, per KV head, to the request's first cache slots. The scheduler side
  (:mod:`slake.vllm.scheduler`) then returns the request's other blocks to vLLM's block pool. For CAKE/SLAKE (cascading
  layer budgets, ``docs/methods/cake.md#cascading-prefill``) the engine re-evicts earlier layers as later ones are
  prefilled, so every layer's kept entries stay in this process until the last layer's prefill and are written then;
  SLAKE's PTAA linear state (a fixed ``(d + 1)^2`` per layer and KV head) lives in this process, next to the metadata.
* **Decode** of a compressed request: the step's new key/value is not written by vLLM (its slot is masked); the
  layer's kept slots are read from the paged cache into the engine's ``LayerStore``, and
  ``CompressedKV.append`` + ``CompressedKV.decode_attention`` compute the output and evict with the method's decode
  rule exactly as in the transformers engine (SLAKE: exact softmax over the kept entries plus the linear term);
  the store's slots are written back. The cache of a compressed request therefore never holds more than
  :meth:`slake.vllm.config.SlakeVllmConfig.slots` slots per layer and KV head (``budget + 1``; CAKE/SLAKE:
  ``min(max_layer_budget, prompt) + 1``).
* Requests whose prompt fits in the budget, and every request when slake is not configured, run vLLM's kernel
  unchanged.

Positions are untouched: vLLM's runner gives token ``t`` after a prompt of ``N`` tokens position ``N + t`` (RoPE),
whatever the compressed length; only the cache bookkeeping (``seq_lens``, slots) of compressed requests changes.

Per-request state lives in this worker process, keyed by the request's first block id (a block belongs to one
request at a time while prefix caching is off; a request's prefill from position 0 resets the entry). Only small
per-slot metadata (positions, validity, scores) is kept between steps; keys and values stay in vLLM's blocks. The
worker does not see when a request finishes, so a finished request's metadata stays until its first block starts
another request: at most one entry per KV block, ``13 * (budget + 1)`` bytes per layer and KV head, i.e. about a
tenth of the KV cache's size in the worst case for head dim 64, float32, budget 128 and block size 32.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from slake.cache.compressed import CompressedKV
from slake.vllm.config import SlakeVllmConfig, parse_config
from slake.vllm.paged import check_layout, read_slots, slot_mapping
from slake.vllm.validate import validate_engine_config

logger = init_logger(f"vllm.plugins.{__name__}")  # under vLLM's logging configuration


@dataclass
class RequestState:
    """One compressed request in this worker: the engine object that holds its per-layer slot metadata."""

    prompt_len: int
    cache: CompressedKV
    #: layer -> (backend impl, layer, kv_cache, block ids) of layers whose kept entries are written at the end of the
    #: prefill step (CAKE's cascade re-evicts earlier layers while later ones are prefilled)
    pending: dict = field(default_factory=dict)

    def kept_tokens_per_layer(self) -> list[float]:
        """Mean kept tokens per KV head, per layer (valid slots of the engine's stores)."""
        return [float(s.valid.sum(-1).float().mean()) if s is not None else 0.0 for s in self.cache.layers]

    def metadata_bytes(self) -> int:
        """Bytes of the per-slot metadata kept between steps (positions, validity, scores), all layers."""
        return sum(
            int(s.positions.nbytes + s.valid.nbytes + s.scores.nbytes) for s in self.cache.layers if s is not None
        )

    def linear_state_bytes(self) -> int:
        """Bytes of the PTAA linear states (SLAKE), all layers; 0 for methods without one."""
        return sum(int(s.linear.nbytes()) for s in self.cache.layers if s is not None and s.linear is not None)


@dataclass
class StepPlan:
    """What the plugin does in one forward step (built once per step by the metadata builder)."""

    #: (state, query start, query end, block ids) of compressed requests whose prefill runs in this step
    prefills: list = field(default_factory=list)
    #: (state, query index, block ids) of compressed requests decoding one token in this step
    decodes: list = field(default_factory=list)
    #: token indices whose K/V vLLM must not write (the decode tokens of compressed requests)
    masked_tokens: list = field(default_factory=list)


#: worker-process registry: first block id -> state of the compressed request that owns it
_STATES: dict[int, RequestState] = {}
#: the plan of the step being run (read by ``do_kv_cache_update``, which receives no metadata)
_CURRENT: StepPlan | None = None
_LAYOUT_CHECKED = False
#: compressed requests started in this process, newest last, recorded only while ``RECORD_RUNS`` is True (set by
#: :func:`slake.engines.vllm.runner.run_vllm`, which reads them back; a server records nothing)
RUN_LOG: list[RequestState] = []
RECORD_RUNS = False
_RUN_LOG_MAX = 256


def _config() -> tuple[SlakeVllmConfig | None, VllmConfig]:
    vcfg = get_current_vllm_config()
    return parse_config(vcfg.additional_config), vcfg


class SlakeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder plus the step plan; compressed decode rows see ``budget + 1`` cache slots."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.slake = parse_config(vllm_config.additional_config)
        if self.slake is not None:
            validate_engine_config(self.slake, vllm_config)
            self.num_layers = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
            logger.info("slake: compressing the KV cache with %s", self.slake.describe())

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        global _CURRENT
        if self.slake is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        plan = StepPlan()
        qsl = cm.query_start_loc_cpu.tolist() if cm.query_start_loc_cpu is not None else cm.query_start_loc.tolist()
        seq_lens = cm.seq_lens.cpu().clone()
        table = cm.block_table_tensor
        bs = self.block_size
        changed = False
        for i in range(cm.num_reqs):
            qs, qe = qsl[i], qsl[i + 1]
            qlen, slen = qe - qs, int(seq_lens[i])
            if qlen == 0:
                continue
            first = int(table[i, 0])
            if first == 0:  # vLLM's null block: dummy/profiling rows
                continue
            if qlen == slen:  # a prefill from position 0: a new (or recomputed) request owns this first block
                _STATES.pop(first, None)
                if self.slake.compresses(slen):
                    st = RequestState(slen, CompressedKV(self.slake.method, self.slake.budget, self.num_layers))
                    _STATES[first] = st
                    if RECORD_RUNS:
                        RUN_LOG.append(st)
                        del RUN_LOG[:-_RUN_LOG_MAX]
                    held = min(self.slake.blocks(bs, slen), math.ceil(slen / bs))  # kept entries fit the prompt's
                    plan.prefills.append((st, qs, qe, table[i, :held].clone()))
                continue
            st = _STATES.get(first)
            if st is None:
                continue
            if qlen != 1:
                raise RuntimeError(
                    f"slake: a compressed request was scheduled {qlen} tokens in one step; the plugin "
                    f"supports one token per decode step (no speculative decoding, no chunked prefill)"
                )
            plan.decodes.append((st, qs, table[i, : self.slake.blocks(bs, st.prompt_len)].clone()))
            plan.masked_tokens.append(qs)
            seq_lens[i] = self.slake.slots(st.prompt_len)  # vLLM's kernel must not read past the request's blocks
            changed = True
        if changed:
            cm = dataclasses.replace(
                cm, seq_lens=seq_lens.to(cm.seq_lens.device), max_seq_len=int(seq_lens[: cm.num_reqs].max())
            )
        md = super().build(common_prefix_len, cm, fast_build)
        md.slake_plan = plan
        _CURRENT = plan
        return md


_LAYER_RE = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """Decoder-layer index of an attention layer name such as ``model.layers.3.self_attn.attn``."""
    found = _LAYER_RE.findall(f".{layer_name}.")
    if len(found) != 1:
        raise RuntimeError(f"slake: cannot read the layer index of attention layer {layer_name!r}")
    return int(found[0])


class SlakeCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention plus prefill compaction and decode-time eviction of compressed requests."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping_: torch.Tensor) -> None:
        plan = _CURRENT
        if plan is not None and plan.masked_tokens:
            slot_mapping_ = slot_mapping_.clone()
            slot_mapping_[plan.masked_tokens] = -1  # compressed decode tokens are placed by the engine below
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping_)

    def _write(
        self, layer, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor
    ) -> None:
        """Write ``(Hkv, n, d)`` keys/values to the request's first ``n`` slots (vLLM's own cache-write op)."""
        global _LAYOUT_CHECKED
        bs = kv_cache.shape[2]
        n = keys.shape[1]
        slots = slot_mapping(block_ids, n, bs)
        k = keys.transpose(0, 1).contiguous().to(kv_cache.dtype)
        v = values.transpose(0, 1).contiguous().to(kv_cache.dtype)
        CPUAttentionBackendImpl.do_kv_cache_update(self, layer, k, v, kv_cache, slots)
        if not _LAYOUT_CHECKED:
            check_layout(kv_cache, k.transpose(0, 1), v.transpose(0, 1), block_ids)
            _LAYOUT_CHECKED = True

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ) -> torch.Tensor:
        out = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        plan: StepPlan | None = getattr(attn_metadata, "slake_plan", None)
        if plan is None or not (plan.prefills or plan.decodes):
            return out
        li = layer_index(layer.layer_name)
        for st, qs, qe, blocks in plan.prefills:
            q = query[qs:qe].transpose(0, 1).unsqueeze(0)
            k = key[qs:qe].transpose(0, 1).unsqueeze(0)
            v = value[qs:qe].transpose(0, 1).unsqueeze(0)
            st.cache.prefill_layer(li, q, k, v, None, self.scale)
            st.pending[li] = (self, layer, kv_cache, blocks)
            if st.cache.method.layer_budgets == "preference" and li < st.cache.num_layers - 1:
                continue  # the cascade may still shrink this layer: write every layer after the last one
            for pending_li, (impl, lay, cache, blk) in sorted(st.pending.items()):
                store = st.cache.layers[pending_li]
                if store.capacity > blk.numel() * cache.shape[2]:
                    raise RuntimeError(
                        f"slake: layer {pending_li} keeps {store.capacity} slots, more than the request's "
                        f"{blk.numel()} blocks hold"
                    )
                impl._write(lay, cache, store.keys[0], store.values[0], blk)
                store.keys = store.values = None  # the kept entries live in vLLM's blocks only
            st.pending.clear()
        for st, qi, blocks in plan.decodes:
            store = st.cache.layers[li]
            cap = store.positions.shape[-1]
            k_old, v_old = read_slots(kv_cache, blocks, cap)
            store.keys, store.values = k_old.unsqueeze(0), v_old.unsqueeze(0)
            st.cache.append(
                li, key[qi : qi + 1].transpose(0, 1).unsqueeze(0), value[qi : qi + 1].transpose(0, 1).unsqueeze(0)
            )
            o = st.cache.decode_attention(li, query[qi : qi + 1].transpose(0, 1).unsqueeze(0), self.scale)
            output[qi] = o[0, :, 0].to(output.dtype).reshape(output[qi].shape)
            if store.capacity > blocks.numel() * kv_cache.shape[2]:
                raise RuntimeError(
                    f"slake: layer {li} grew to {store.capacity} slots, more than the request's "
                    f"{blocks.numel()} blocks hold"
                )
            self._write(layer, kv_cache, store.keys[0], store.values[0], blocks)
            store.keys = store.values = None
        return out


class SlakeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with slake's compression (registered by :func:`slake.vllm.register`)."""

    @staticmethod
    def get_impl_cls() -> type[SlakeCPUAttentionBackendImpl]:
        return SlakeCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[SlakeCPUAttentionMetadataBuilder]:
        return SlakeCPUAttentionMetadataBuilder
