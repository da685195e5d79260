"""The attention backend the plugin registers in place of vLLM's ``CPU_ATTN`` (worker side).

It is vLLM's CPU backend plus compression, through vLLM's backend registry (``register_backend``):

* **Prefill** of a request whose prompt is longer than the budget: vLLM's kernel computes the layer's exact
  attention over the whole prompt; then :class:`slake.cache.compressed.CompressedKV` (the engine the transformers
  path uses) scores and selects the kept tokens of that layer from the same post-RoPE queries/keys, and the kept
  keys/values are written, per KV head, to the request's first cache slots. The scheduler side
  (:mod:`slake.engines.vllm.plugin.scheduler`) then returns the request's other blocks to vLLM's block pool. For
  CAKE/SLAKE (cascading
  layer budgets, ``docs/methods/cake.md#cascading-prefill``) a layer's budget is known only after the last layer's
  preference, so every layer's kept entries stay in this process until the last layer's prefill and are written then.
  The cascade is deferred (``CompressedKV(defer_cascade=True)``): each layer is evicted at its own stage and at the
  final one, not re-evicted at every stage in between: the same kept sets, without the cascade's hundreds of small
  re-evictions per request, whose memory bound buys nothing here (vLLM's blocks hold the whole prompt for the step);
  SLAKE's PTAA linear state (a fixed ``(d + 1)^2`` per layer and KV head) lives in this process, next to the metadata.
* **Decode** of all compressed requests of a step is one batched computation per layer
  (:class:`slake.engines.vllm.plugin.decode_pool.DecodePool`): the new token's key/value goes straight into each
  request's free slot
  in vLLM's blocks (the slot the previous step evicted, per KV head; vLLM's own write of it is masked), the rows'
  kept slots are gathered into one padded ``(requests, Hkv, W, d)`` tensor with a validity mask, and attention
  (SLAKE: exact softmax over the kept entries plus the linear term), the method's decode scores and the eviction
  of one slot per request and KV head run once for all of them, with the transformers engine's arithmetic. Only
  the new token's slot is written; the rest of the kept cache is only read. The cache of a compressed request never
  holds more than :meth:`slake.engines.vllm.plugin.config.SlakeVllmConfig.slots` slots per layer and KV head (``budget
  + 1``;
  CAKE/SLAKE: ``min(max_layer_budget, prompt) + 1``).
* Requests whose prompt fits in the budget, and every request when slake is not configured, run vLLM's kernel
  unchanged.

Positions are untouched: vLLM's runner gives token ``t`` after a prompt of ``N`` tokens position ``N + t`` (RoPE),
whatever the compressed length; only the cache bookkeeping (``seq_lens``, slots) of compressed requests changes.

Per-request state lives in this worker process, keyed by vLLM's request id (read from the model runner's
persistent batch, whose ``_update_states`` the plugin wraps, :func:`install_runner_hook`): after prefill, one row
of the decode pool (positions, validity and scores per slot, the PTAA linear state) and nothing else; keys and
values stay in vLLM's blocks. A finished request's row is released when the scheduler reports it finished. A
preempted request's row is saved with a copy of its kept keys/values (a few MB, at most ``_SAVE_MAX`` requests);
when vLLM recomputes the request (a prefill of its prompt plus the tokens generated so far), the saved kept cache is
written into its new blocks and the recomputation's last token decodes over it, so the request continues exactly as
if it had not been preempted. Beyond ``_SAVE_MAX`` saved requests, a recomputed request is compressed afresh from
its longer prefill (its tokens may then differ from an unpreempted run).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
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
from slake.engines.vllm.plugin.config import SlakeVllmConfig, parse_config
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import CpuAttnLayout, PagedLayout, slot_blocks, slot_mapping
from slake.engines.vllm.plugin.validate import validate_engine_config

logger = init_logger(f"vllm.plugins.{__name__}")  # under vLLM's logging configuration


@dataclass
class RequestState:
    """One compressed request in this worker.

    ``cache`` is the engine object of its prefill (dropped once every layer is in the decode pool); ``row`` its
    :class:`DecodePool` row while it runs; ``saved`` its row's metadata and kept keys/values while it is preempted.
    """

    req_id: str
    prompt_len: int
    cache: CompressedKV | None
    row: int | None = None
    #: layer -> (backend impl, layer, kv_cache, block ids) of layers whose kept entries are written at the end of the
    #: prefill step (CAKE's cascade re-evicts earlier layers while later ones are prefilled)
    pending: dict = field(default_factory=dict)
    layers_loaded: int = 0
    saved: dict | None = None
    final_kept: list[float] | None = None
    meta_bytes: int = 0
    lin_bytes: int = 0
    preemptions: int = 0

    def kept_tokens_per_layer(self) -> list[float]:
        """Mean kept tokens per KV head, per layer (valid slots), now or when the request finished."""
        if self.row is not None and _POOL is not None:
            return _POOL.kept(self.row)
        if self.final_kept is not None:
            return list(self.final_kept)
        return [float(s.valid.sum(-1).float().mean()) if s is not None else 0.0 for s in self.cache.layers]

    def metadata_bytes(self) -> int:
        """Bytes of the per-slot metadata kept between steps (positions, validity, scores), all layers."""
        return self.meta_bytes

    def linear_state_bytes(self) -> int:
        """Bytes of the PTAA linear states (SLAKE), all layers; 0 for methods without one."""
        return self.lin_bytes


@dataclass
class StepPlan:
    """What the plugin does in one forward step (built once per step by the metadata builder)."""

    #: (state, query start, query end, block ids) of compressed requests whose prefill runs in this step
    prefills: list = field(default_factory=list)
    #: (state, block ids) of preempted compressed requests recomputed in this step: their saved kept cache is
    #: written back into their new blocks before their last token decodes over it
    restores: list = field(default_factory=list)
    #: the batched decode of this step, or None: pool rows (R,), token indices (R,), block tables (R, nb),
    #: slot blocks (R, W), offsets (W,), the new tokens' positions (R, 1, 1), and per layer the slots to read
    #: (``DecodePool.layer_widths``)
    rows: torch.Tensor | None = None
    #: ``rows`` as the slice ``a:a+R`` when they are contiguous (the pool then updates them in place), else ``rows``
    row_index: torch.Tensor | slice | None = None
    widths: list[int] = field(default_factory=list)
    qidx: torch.Tensor | None = None
    table: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    newest: torch.Tensor | None = None
    #: token indices whose K/V vLLM must not write (the decode tokens of compressed requests)
    masked_tokens: torch.Tensor | None = None
    #: requests in the step (all kinds), and the plugin's decode time of this step summed over layers (TIMING)
    num_reqs: int = 0
    decode_s: float = 0.0


#: worker-process registry: request id -> state of the running compressed request
_STATES: dict[str, RequestState] = {}
#: preempted requests saved, and recomputed requests restored, in this process (tests read them)
COUNTERS = {"saved": 0, "restored": 0}
#: preempted compressed requests waiting to be recomputed: request id -> state with ``saved``
_SAVED: dict[str, RequestState] = {}
#: most preempted requests whose kept cache is saved (each a few MB: kept keys/values of every layer)
_SAVE_MAX = 64
#: the decode pool of this worker's engine (created by the first metadata builder)
_POOL: DecodePool | None = None
_ENGINE: int | None = None
#: layer index -> its KV cache tensor (recorded by the backend; read when a request is preempted)
_CACHES: dict[int, torch.Tensor] = {}
#: the model runner of this process (set by the wrapped ``_update_states``); its persistent batch names the rows
_RUNNER = None
#: the plan of the step being run (read by ``do_kv_cache_update``, which receives no metadata)
_CURRENT: StepPlan | None = None
_LAYOUT_CHECKED = False
#: how this backend's cache tensors store keys and values (``CPU_ATTN``'s block-transposed keys); the decode pool and
#: the preemption copy go through it. A GPU backend would pass :class:`slake.engines.vllm.plugin.paged.FlashAttnLayout`
#: (``docs/gpu.md``).
LAYOUT: PagedLayout = CpuAttnLayout()
#: compressed requests started in this process, newest last, recorded only while ``RECORD_RUNS`` is True (set by
#: :func:`slake.engines.vllm.runner.run_vllm`, which reads them back; a server records nothing)
RUN_LOG: list[RequestState] = []
RECORD_RUNS = False
_RUN_LOG_MAX = 256
#: when True, every step with compressed decode rows appends ``(compressed decode rows, requests in the step,
#: layers, plugin seconds summed over layers)`` to STEP_TIMES (``slake bench --engine vllm`` and the tests set it)
TIMING = False
STEP_TIMES: list[tuple[int, int, int, float]] = []


def _config() -> tuple[SlakeVllmConfig | None, VllmConfig]:
    vcfg = get_current_vllm_config()
    return parse_config(vcfg.additional_config), vcfg


def _reset() -> None:
    """Forget every request (a new engine in this process)."""
    global _POOL, _RUNNER, _CURRENT
    _STATES.clear()
    _SAVED.clear()
    _CACHES.clear()
    _POOL = None
    _RUNNER = None
    _CURRENT = None


def _release(st: RequestState) -> None:
    """Give a request's pool row back, remembering what it kept (for ``RUN_LOG`` readers)."""
    if st.row is not None and _POOL is not None:
        st.final_kept = _POOL.kept(st.row)
        _POOL.release(st.row)
    st.row = None


def request_finished(req_id: str) -> None:
    """Drop a finished (or aborted) request's state: its pool row and any saved preemption copy."""
    st = _STATES.pop(req_id, None)
    if st is not None:
        _release(st)
    st = _SAVED.pop(req_id, None)
    if st is not None:
        st.saved = None


def request_preempted(req_id: str, block_ids: list[int] | None) -> None:
    """Save a preempted request's row and kept keys/values (its blocks are still intact: no step has run since
    the scheduler freed them), and release its row."""
    st = _STATES.pop(req_id, None)
    if st is None:
        return
    st.preemptions += 1
    if st.row is None or _POOL is None or st.pending or len(_SAVED) >= _SAVE_MAX or not block_ids or not _CACHES:
        if st.row is not None:
            logger.warning("slake: preempted request %s will be compressed afresh when recomputed", req_id)
        _release(st)
        return
    held = torch.tensor(block_ids[: _CONFIG_BLOCKS(st.prompt_len)], dtype=torch.int64)
    n = min(_POOL.width, held.numel() * _POOL.block_size)
    kv = {li: _POOL.layout.read(cache, held, n) for li, cache in _CACHES.items()}
    st.saved = {"meta": _POOL.row_state(st.row), "kv": kv}
    _release(st)
    _SAVED[req_id] = st
    COUNTERS["saved"] += 1


_CONFIG_BLOCKS = None  # set by the builder: prompt_len -> blocks a compressed request holds


def install_runner_hook() -> None:
    """Wrap ``GPUModelRunner._update_states`` (the CPU runner inherits it) so that this worker learns which
    requests finished or were preempted, and which model runner's persistent batch names the step's rows."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states
    if getattr(original, "_slake", False):
        return

    def _update_states(self, scheduler_output):
        global _RUNNER
        _RUNNER = self
        if _STATES or _SAVED:
            for rid in scheduler_output.finished_req_ids:
                request_finished(rid)
            for rid in scheduler_output.preempted_req_ids or ():
                req = self.requests.get(rid)
                request_preempted(rid, list(req.block_ids[0]) if req is not None and req.block_ids else None)
        return original(self, scheduler_output)

    _update_states._slake = True
    _update_states.__wrapped__ = original
    GPUModelRunner._update_states = _update_states


class SlakeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder plus the step plan; compressed decode rows see ``budget + 1`` cache slots."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        global _ENGINE, _CONFIG_BLOCKS
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.slake = parse_config(vllm_config.additional_config)
        if self.slake is not None:
            validate_engine_config(self.slake, vllm_config)
            self.num_layers = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
            mc = vllm_config.model_config
            self.kv_heads = int(mc.get_num_kv_heads(vllm_config.parallel_config))
            self.head_dim = int(mc.get_head_size())
            if _ENGINE != id(vllm_config):
                _reset()
                _ENGINE = id(vllm_config)
            bs, cfg = self.block_size, self.slake
            _CONFIG_BLOCKS = lambda n: cfg.blocks(bs, n)  # noqa: E731
            logger.info("slake: compressing the KV cache with %s", self.slake.describe())

    def _pool(self) -> DecodePool:
        global _POOL
        if _POOL is None:
            _POOL = DecodePool(
                self.slake.method,
                self.num_layers,
                self.kv_heads,
                self.head_dim,
                self.slake.slots(),
                self.block_size,
                rows=min(int(self.vllm_config.scheduler_config.max_num_seqs), 8),
                layout=LAYOUT,
            )
        return _POOL

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        global _CURRENT
        if self.slake is None:
            _CURRENT = None  # an engine without slake in a process that ran one with it
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        plan = StepPlan(num_reqs=int(cm.num_reqs))
        qsl = cm.query_start_loc_cpu.tolist() if cm.query_start_loc_cpu is not None else cm.query_start_loc.tolist()
        seq_lens = cm.seq_lens.cpu().clone()
        table = cm.block_table_tensor
        bs = self.block_size
        runner = _RUNNER
        req_ids = runner.input_batch.req_ids if runner is not None else None
        decodes = []  # (state, token index, batch row, blocks held)
        for i in range(cm.num_reqs):
            qs, qe = qsl[i], qsl[i + 1]
            qlen, slen = qe - qs, int(seq_lens[i])
            if qlen == 0:
                continue
            first = int(table[i, 0])
            if first == 0:  # vLLM's null block: dummy/profiling rows
                continue
            rid = req_ids[i] if req_ids is not None and i < len(req_ids) else f"block-{first}"
            if qlen == slen:  # a prefill from position 0: a new or recomputed request
                old = _STATES.pop(rid, None)
                if old is not None:
                    _release(old)
                saved = _SAVED.pop(rid, None)
                if saved is not None and saved.saved is not None:  # recomputed after preemption: restore
                    st = saved
                    st.row = self._pool().allocate(st.prompt_len, self.slake.budget)
                    self._pool().restore_row(st.row, st.saved["meta"])
                    held = self.slake.blocks(bs, st.prompt_len)
                    plan.restores.append((st, table[i, :held].clone()))
                    COUNTERS["restored"] += 1
                    _STATES[rid] = st
                    decodes.append((st, qe - 1, i, held))  # the last token decodes over the restored cache
                    continue
                if self.slake.compresses(slen):
                    cache = CompressedKV(self.slake.method, self.slake.budget, self.num_layers, defer_cascade=True)
                    st = RequestState(rid, slen, cache)
                    pool = self._pool()
                    st.row = pool.allocate(slen, self.slake.budget)
                    st.meta_bytes, st.lin_bytes = pool.row_bytes()
                    _STATES[rid] = st
                    if RECORD_RUNS:
                        RUN_LOG.append(st)
                        del RUN_LOG[:-_RUN_LOG_MAX]
                    held = min(self.slake.blocks(bs, slen), math.ceil(slen / bs))  # kept entries fit the prompt's
                    plan.prefills.append((st, qs, qe, table[i, :held].clone()))
                continue
            st = _STATES.get(rid)
            if st is None:
                continue
            if qlen != 1:
                raise RuntimeError(
                    f"slake: a compressed request was scheduled {qlen} tokens in one step; the plugin "
                    f"supports one token per decode step (no speculative decoding, no chunked prefill)"
                )
            decodes.append((st, qs, i, self.slake.blocks(bs, st.prompt_len)))
            # vLLM's kernel still runs over this row, but the pool's output replaces it: let it read one slot
            # (never past the request's blocks, and no wasted pass over the kept cache)
            seq_lens[i] = 1
        if decodes:
            decodes.sort(key=lambda d: d[0].row)  # row order: usually one contiguous run of the pool's rows
            pool = self._pool()
            W = pool.width
            nb = -(-W // bs)
            idx = torch.tensor([d[2] for d in decodes], dtype=torch.int64)
            held = torch.tensor([d[3] for d in decodes], dtype=torch.int64)
            tbl = table[idx, :nb].to(torch.int64)
            # slots past a request's own blocks (CAKE/SLAKE prompts below the layer cap) are never valid: point
            # them at its first block so that the gather stays inside its own data
            tbl = torch.where(torch.arange(nb)[None, :] < held[:, None], tbl, tbl[:, :1])
            plan.table = tbl
            plan.blocks, plan.offsets = slot_blocks(tbl, W, bs)
            rows = [int(d[0].row) for d in decodes]
            plan.rows = torch.tensor(rows, dtype=torch.int64)
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            plan.row_index = slice(rows[0], rows[0] + len(rows)) if contiguous else plan.rows
            plan.widths = pool.layer_widths(rows)
            plan.qidx = torch.tensor([d[1] for d in decodes], dtype=torch.int64)
            plan.newest = pool.seen.index_select(0, plan.rows).view(-1, 1, 1)
            pool.seen.index_add_(0, plan.rows, torch.ones_like(plan.rows))
            restored = {id(st) for st, _ in plan.restores}
            masked = [d[1] for d in decodes if id(d[0]) not in restored]
            plan.masked_tokens = torch.tensor(masked, dtype=torch.int64) if masked else None
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
    """vLLM's CPU attention plus prefill compaction and the batched decode of compressed requests."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping_: torch.Tensor) -> None:
        plan = _CURRENT
        if plan is not None and plan.masked_tokens is not None:
            slot_mapping_ = slot_mapping_.clone()
            slot_mapping_[plan.masked_tokens] = -1  # compressed decode tokens are placed by the pool below
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping_)

    def _write(
        self, layer, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor
    ) -> None:
        """Write ``(Hkv, n, d)`` keys/values to the request's first ``n`` slots (vLLM's own cache-write op; the
        first write of the process checks that :data:`LAYOUT` reads back exactly what the op stored)."""
        global _LAYOUT_CHECKED
        bs = kv_cache.shape[2]
        n = keys.shape[1]
        slots = slot_mapping(block_ids, n, bs)
        k = keys.transpose(0, 1).contiguous().to(kv_cache.dtype)
        v = values.transpose(0, 1).contiguous().to(kv_cache.dtype)
        CPUAttentionBackendImpl.do_kv_cache_update(self, layer, k, v, kv_cache, slots)
        if not _LAYOUT_CHECKED:
            LAYOUT.check(kv_cache, k.transpose(0, 1), v.transpose(0, 1), block_ids)
            _LAYOUT_CHECKED = True

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ) -> torch.Tensor:
        out = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        plan: StepPlan | None = getattr(attn_metadata, "slake_plan", None)
        if plan is None or not (plan.prefills or plan.rows is not None):
            return out
        li = layer_index(layer.layer_name)
        _CACHES[li] = kv_cache
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
                        f"slake: layer {pending_li} keeps {store.capacity} slots, more than the "
                        f"request's {blk.numel()} blocks hold"
                    )
                impl._write(lay, cache, store.keys[0], store.values[0], blk)
                _POOL.load_layer(st.row, pending_li, store, st.cache.targets[pending_li])
                st.cache.layers[pending_li] = None  # the kept entries live in vLLM's blocks, the metadata in the pool
                st.layers_loaded += 1
            st.pending.clear()
            if st.layers_loaded == st.cache.num_layers:
                st.cache = None
        if plan.rows is None:
            return out
        t0 = time.perf_counter() if TIMING else 0.0
        for st, blocks in plan.restores:
            k_saved, v_saved = st.saved["kv"][li]
            self._write(layer, kv_cache, k_saved, v_saved, blocks)
            if li == len(st.saved["kv"]) - 1:
                st.saved = None
        qidx = plan.qidx
        o = _POOL.decode_layer(
            li,
            plan.row_index,
            plan.table,
            plan.blocks,
            plan.offsets,
            plan.newest,
            query.index_select(0, qidx),
            key.index_select(0, qidx),
            value.index_select(0, qidx),
            kv_cache,
            self.scale,
            plan.widths[li],
        )
        output.index_copy_(0, qidx, o.to(output.dtype).reshape(qidx.numel(), *output.shape[1:]))
        if TIMING:
            plan.decode_s += time.perf_counter() - t0
            if li == _POOL.num_layers - 1:
                STEP_TIMES.append((int(qidx.numel()), plan.num_reqs, _POOL.num_layers, plan.decode_s))
                del STEP_TIMES[:-4096]
        return out


class SlakeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with slake's compression (registered by :func:`slake.engines.vllm.plugin.register`)."""

    @staticmethod
    def get_impl_cls() -> type[SlakeCPUAttentionBackendImpl]:
        return SlakeCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[SlakeCPUAttentionMetadataBuilder]:
        return SlakeCPUAttentionMetadataBuilder
