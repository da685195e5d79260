"""The plugin's worker-side state of one engine, in one object owned by that engine's attention-metadata builder.

vLLM's v1 attention backends keep no module globals: the metadata builder is made once per engine (per KV-cache
group) and its :meth:`build` makes, every step, the metadata object that carries the step's state to every layer's
``Impl.forward``. The plugin follows that shape:

* :class:`PluginState` holds everything that lives across steps for one engine: the configuration, the compressed
  requests running and the preempted ones saved, the decode pool (:class:`DecodePool`), the cache tensor of each
  layer, the paged layout, and what drivers read back (the run log, step timings, counters). The builder
  (:class:`slake.engines.vllm.plugin.backend.SlakeCPUAttentionMetadataBuilder`) creates it and owns it; two engines
  in one process have two, and share nothing.
* :class:`StepPlan` is what one step does (made by :meth:`PluginState.plan_step` inside the builder's ``build``),
  attached to the step's metadata (``metadata.slake``) with a reference to its :class:`PluginState`; the backend's
  ``forward`` and ``do_kv_cache_update`` reach the state only through it.

Request lifecycle events that vLLM gives only to its model runner (finished and preempted requests, the request ids
of the step's rows) reach the state through :mod:`slake.engines.vllm.plugin.worker`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata

from slake.cache.compressed import CompressedKV, resolve_kernels
from slake.engines.vllm.plugin.config import SlakeVllmConfig
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.layer_facts import vllm_layer_contexts
from slake.engines.vllm.plugin.paged import PagedLayout, slot_blocks
from slake.methods.base import LayerContext

__all__ = ["DecodeBatch", "PluginState", "RequestState", "StepPlan"]

logger = init_logger(f"vllm.plugins.{__name__}")  # under vLLM's logging configuration


def _copy_bytes(value: Any) -> int:
    """Bytes of the tensors in a saved preemption copy (``{"meta": ..., "kv": {layer: (keys, values)}}``, nested
    dicts, lists and tuples; other values count nothing)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_copy_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_copy_bytes(v) for v in value)
    return 0


@dataclass
class RequestState:
    """One compressed request in this worker.

    ``prompt_len`` is the sequence its prefill compressed: the prompt, or, for a preempted request recomputed
    without a saved copy, the prompt plus the tokens it had generated. ``prompt_tokens`` is the prompt alone
    (vLLM's ``num_prompt_tokens``): it decided that the request is compressed and sizes its blocks, as in the
    scheduler (:class:`slake.engines.vllm.plugin.scheduler.BlockPolicy`). ``cache`` is the engine object of its
    prefill (dropped once every layer is in the decode pool); ``row`` its :class:`DecodePool` row while it runs;
    ``saved`` its row's metadata and kept keys/values while it is preempted.
    """

    req_id: str
    prompt_len: int
    cache: CompressedKV | None
    #: the prompt's tokens (vLLM's ``num_prompt_tokens``); 0: ``prompt_len``
    prompt_tokens: int = 0
    row: int | None = None
    #: layer -> (backend impl, layer, kv_cache, block ids) of layers whose kept entries are written at the end of the
    #: prefill step (CAKE's cascade re-evicts earlier layers while later ones are prefilled)
    pending: dict[int, tuple[Any, Any, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    layers_loaded: int = 0
    saved: dict[str, Any] | None = None
    final_kept: list[float] | None = None
    meta_bytes: int = 0
    lin_bytes: int = 0
    preemptions: int = 0

    def blocks(self, config: SlakeVllmConfig, block_size: int) -> int:
        """KV blocks the request holds while decoding: :meth:`SlakeVllmConfig.blocks` of its prompt, the number the
        scheduler leaves it (:meth:`slake.engines.vllm.plugin.scheduler.BlockPolicy.trim`)."""
        return config.blocks(block_size, self.prompt_tokens or self.prompt_len)


@dataclass
class DecodeBatch:
    """The batched decode of one step: the compressed requests that decode a token, in pool-row order."""

    #: (R,) pool rows
    rows: torch.Tensor
    #: ``rows`` as the slice ``a:a+R`` when they are contiguous (the pool then updates them in place), else ``rows``
    row_index: torch.Tensor | slice
    #: per layer, the slots to read (``DecodePool.layer_widths``)
    widths: list[int]
    #: (R,) the rows' token indices in the step's batch
    qidx: torch.Tensor
    #: (R, nb) block tables, (R, W) the block of every slot, (W,) in-block offsets
    table: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    #: (R, 1, 1) the new tokens' positions
    newest: torch.Tensor
    #: ``qidx`` as the slice ``a:a+R`` when the tokens are contiguous and in order (the usual case: every request
    #: of a decode-only step is compressed), else None; the layers then read and write the tokens through views
    qslice: slice | None = None


@dataclass
class StepPlan:
    """What the plugin does in one forward step (built once per step by the metadata builder)."""

    #: the engine's state (the step's layers read and update it)
    state: PluginState
    #: (state, query start, query end, block ids) of compressed requests whose prefill runs in this step
    prefills: list[tuple[RequestState, int, int, torch.Tensor]] = field(default_factory=list)
    #: (state, block ids) of preempted compressed requests recomputed in this step: their saved kept cache is
    #: written back into their new blocks before their last token decodes over it
    restores: list[tuple[RequestState, torch.Tensor]] = field(default_factory=list)
    #: the step's batched decode, or None
    decode: DecodeBatch | None = None
    #: token indices whose K/V vLLM must not write (the decode tokens of compressed requests)
    masked_tokens: torch.Tensor | None = None
    #: requests in the step (all kinds), and the plugin's decode time of this step summed over layers (timing on)
    num_reqs: int = 0
    decode_s: float = 0.0

    @property
    def active(self) -> bool:
        """True when the step has compressed prefills or decodes (otherwise the layers run vLLM's kernel only)."""
        return bool(self.prefills) or self.decode is not None


class PluginState:
    """Everything the plugin keeps across steps for one engine in this worker process.

    Parameters
    ----------
    config : SlakeVllmConfig
        The engine's configuration (method, budget, profile, kernels). Its ``kernels`` is resolved here, when the
        engine starts (:func:`slake.cache.compressed.resolve_kernels` for the pool's device, the CPU): a choice that
        cannot run here (``"triton"`` without Triton, or on the CPU without ``TRITON_INTERPRET=1``) fails now, in one
        line starting ``slake:``, not at the first compressed request.
    num_layers, kv_heads, head_dim : int
        The model's attention layers and this worker's KV heads and head size.
    block_size : int
        vLLM's KV block size.
    max_rows : int
        Decode-pool rows made at first (the pool doubles when more compressed requests run at once).
    layout : PagedLayout
        How this backend's cache tensors store keys and values (the decode pool and the preemption copy read and
        write through it).
    """

    #: most preempted requests whose kept cache is saved (kept keys/values of every layer, 5.9 to 269 MB each in
    #: docs/vllm.md's examples), and most bytes the saved copies hold together (host memory on the CPU); a request
    #: preempted beyond either is compressed afresh when recomputed
    save_max = 64
    save_max_bytes = 4 << 30
    #: most requests kept in the run log (one record per request id, the oldest dropped first; a driver sizes it to
    #: its run's requests with :func:`slake.engines.vllm.plugin.worker.configure`), and step timings kept
    run_log_max = 256
    step_times_max = 4096
    #: where the decode pool's tensors live (vLLM's CPU backend)
    device = torch.device("cpu")

    def __init__(
        self,
        config: SlakeVllmConfig,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        max_rows: int,
        layout: PagedLayout,
    ) -> None:
        self.config = config
        try:
            #: the decode step's implementation the pool runs (``"torch"`` or ``"triton"``), resolved from
            #: ``config.kernels`` for the pool's device
            self.kernels = resolve_kernels(config.kernels, self.device)
        except ValueError as exc:
            raise ValueError(f"slake: {exc}") from None
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size = block_size
        self.max_rows = max_rows
        self.layout = layout
        #: whether the layout was checked against what vLLM's cache-write op stores (at the first write)
        self.layout_checked = False
        #: request id -> state of the running compressed requests
        self.requests: dict[str, RequestState] = {}
        #: preempted compressed requests waiting to be recomputed: request id -> state with ``saved``
        self.saved: dict[str, RequestState] = {}
        #: bytes the copies in :attr:`saved` hold together
        self.saved_bytes = 0
        self.pool: DecodePool | None = None
        #: layer index -> its KV cache tensor (recorded by the backend; read when a request is preempted)
        self.caches: dict[int, torch.Tensor] = {}
        #: request ids of the step's batch rows, in row order, and their prompts' lengths (vLLM's
        #: ``num_prompt_tokens``; set by the model runner's hook before each step)
        self.step_req_ids: list[str] = []
        self.step_prompt_lens: list[int] = []
        #: preempted requests saved, and recomputed requests restored
        self.counters = {"saved": 0, "restored": 0}
        #: when True, every compressed request started is recorded in :attr:`runs` (drivers turn it on): request
        #: id -> its latest state (a request compressed afresh after a preemption replaces its earlier record), at
        #: most :attr:`run_log_max` requests, the oldest dropped first
        self.record_runs = False
        self.runs: dict[str, RequestState] = {}
        #: when True, every step with compressed decode rows appends ``(compressed decode rows, requests in the
        #: step, layers, plugin seconds summed over layers)`` to :attr:`step_times`
        self.timing = False
        self.step_times: list[tuple[int, int, int, float]] = []
        #: per layer, the model facts the method reads (:meth:`attach_model`); None until read, or when none needed
        self.layer_context: list[LayerContext] | None = None

    # ------------------------------------------------------------------ the model's facts
    @property
    def needs_model(self) -> bool:
        """True until the model facts the method reads have been read (:meth:`attach_model`)."""
        return bool(self.config.method.layer_facts()) and self.layer_context is None

    def attach_model(self, model: Any) -> None:
        """Read the model facts the method needs (``method.layer_facts()``: the rotary embedding, the output
        projection; :func:`slake.engines.vllm.plugin.layer_facts.vllm_layer_contexts`) from vLLM's ``model``, once.
        The worker hook calls it before a step while :attr:`needs_model`."""
        if self.needs_model:
            self.layer_context = vllm_layer_contexts(model, self.num_layers, self.config.method.layer_facts())

    def _contexts(self) -> list[LayerContext] | None:
        if self.needs_model:
            raise RuntimeError(
                f"slake: {self.config.method.name} needs the model's {' and '.join(self.config.method.layer_facts())}, "
                "which the worker hook reads from vLLM's model before the first step (is the plugin's worker hook "
                "installed? slake.engines.vllm.plugin.worker.install)"
            )
        return self.layer_context

    # ------------------------------------------------------------------ requests
    def _new_cache(self, prompt_tokens: int, seq_len: int) -> CompressedKV:
        """The transformers engine's compressor for one request's prefill of ``seq_len`` tokens (with the model facts
        the method reads). When a recomputed request is compressed afresh (``seq_len`` longer than its prompt of
        ``prompt_tokens``), CAKE/SLAKE's layer cap is lowered to the prompt where it exceeds it, so that no layer
        keeps more slots than the blocks the scheduler leaves the request (:meth:`SlakeVllmConfig.blocks` of the
        prompt)."""
        cfg = self.config
        method = cfg.method
        cap = getattr(method, "max_layer_budget", None)
        if seq_len > prompt_tokens and method.layer_budgets == "preference" and cap is not None and cap > prompt_tokens:
            capped: dict[str, Any] = {"max_layer_budget": prompt_tokens}
            method = dataclasses.replace(method, **capped)
        cache = CompressedKV(method, cfg.budget, self.num_layers, defer_cascade=True)
        contexts = self._contexts()
        if contexts is not None:
            cache.layer_context = list(contexts)
        return cache

    def decode_pool(self) -> DecodePool:
        """The engine's decode pool (made at the first compressed request)."""
        if self.pool is None:
            self.pool = DecodePool(
                self.config.method,
                self.num_layers,
                self.kv_heads,
                self.head_dim,
                self.config.slots(),
                self.block_size,
                rows=self.max_rows,
                layout=self.layout,
                device=self.device,
                # the choice as asked (checked above): the pool resolves it again and keeps why "auto" chose torch
                kernels=self.config.kernels,
                layer_context=self._contexts(),
            )
        return self.pool

    def kernels_ran(self) -> str:
        """Which implementation ran the pool's decode steps (:meth:`slake.cache.fused_step.KernelReport.summary`:
        ``"triton"``, ``"torch"``, or ``"torch (fallback: why)"`` where the fused kernels were asked for and did not
        cover a step), or, before any compressed decode step, the implementation chosen (:attr:`kernels`), as the
        transformers engine's benchmark rows say it."""
        ran = "none" if self.pool is None else self.pool.report.summary()
        if ran != "none":
            return ran
        auto = None if self.pool is None else self.pool.report.auto
        return self.kernels if auto is None else f"{self.kernels} (auto: {auto})"

    def kept_tokens_per_layer(self, st: RequestState) -> list[float]:
        """Mean kept tokens per KV head, per layer (valid slots), now or when the request finished."""
        if st.row is not None and self.pool is not None:
            return self.pool.kept(st.row)
        if st.final_kept is not None:
            return list(st.final_kept)
        if st.cache is None:
            return []
        return [float(s.valid.sum(-1).float().mean()) if s is not None else 0.0 for s in st.cache.layers]

    def release(self, st: RequestState) -> None:
        """Give a request's pool row back, remembering what it kept (for the run log)."""
        if st.row is not None and self.pool is not None:
            st.final_kept = self.pool.kept(st.row)
            self.pool.release(st.row)
        st.row = None

    def request_finished(self, req_id: str) -> None:
        """Drop a finished (or aborted) request's state: its pool row and any saved preemption copy."""
        st = self.requests.pop(req_id, None)
        if st is not None:
            self.release(st)
        st = self._unsave(req_id)
        if st is not None:
            st.saved = None

    def _unsave(self, req_id: str) -> RequestState | None:
        """Take a preempted request's state out of :attr:`saved` (None when it has none), its copy's bytes out of
        :attr:`saved_bytes`; the copy itself stays on the state (a restore writes it back layer by layer)."""
        st = self.saved.pop(req_id, None)
        if st is not None and st.saved is not None:
            self.saved_bytes -= _copy_bytes(st.saved)
        return st

    def request_preempted(self, req_id: str, block_ids: list[int] | None) -> None:
        """Save a preempted request's row and kept keys/values (its blocks are still intact: no step has run since
        the scheduler freed them), and release its row."""
        st = self.requests.pop(req_id, None)
        if st is None:
            return
        st.preemptions += 1
        pool = self.pool
        full = len(self.saved) >= self.save_max
        if st.row is None or pool is None or st.pending or full or not block_ids or not self.caches:
            if st.row is not None:
                why = f": {self.save_max} saved copies are the most kept (PluginState.save_max)" if full else ""
                logger.warning("slake: preempted request %s will be compressed afresh when recomputed%s", req_id, why)
            self.release(st)
            return
        held = torch.tensor(block_ids[: st.blocks(self.config, self.block_size)], dtype=torch.int64)
        n = min(pool.width, held.numel() * pool.block_size)
        kv = {li: pool.layout.read(cache, held, n) for li, cache in self.caches.items()}
        copy = {"meta": pool.row_state(st.row), "kv": kv}
        nbytes = _copy_bytes(copy)
        if self.saved_bytes + nbytes > self.save_max_bytes:
            logger.warning(
                "slake: preempted request %s will be compressed afresh when recomputed: its kept cache (%.1f MiB) "
                "would take the saved copies past %.0f MiB",
                req_id, nbytes / 2**20, self.save_max_bytes / 2**20,
            )  # fmt: skip
            self.release(st)
            return
        st.saved = copy
        self.saved_bytes += nbytes
        self.release(st)
        self.saved[req_id] = st
        self.counters["saved"] += 1

    def record_run(self, st: RequestState) -> None:
        """Record a compressed request in the run log (:attr:`runs`), replacing an earlier record of its id (a
        preempted request compressed afresh: its preemptions carry over) and dropping the oldest records beyond
        :attr:`run_log_max`."""
        prev = self.runs.pop(st.req_id, None)
        if prev is not None and prev is not st:
            st.preemptions = max(st.preemptions, prev.preemptions)
        self.runs[st.req_id] = st
        while len(self.runs) > max(int(self.run_log_max), 0):
            del self.runs[next(iter(self.runs))]

    def record_step_time(self, plan: StepPlan) -> None:
        """Append a step's plugin time (timing on) to :attr:`step_times`."""
        if plan.decode is None:
            return
        self.step_times.append((int(plan.decode.qidx.numel()), plan.num_reqs, self.num_layers, plan.decode_s))
        del self.step_times[: -self.step_times_max]

    # ------------------------------------------------------------------ the step
    def plan_step(self, cm: CommonAttentionMetadata) -> tuple[StepPlan, CommonAttentionMetadata]:
        """The step's plan, and vLLM's common metadata with each compressed decode row's sequence length set to one
        slot (vLLM's kernel still runs over that row, but the pool's output replaces it).

        A row whose query starts at position 0 is a prefill: a new request (compressed when its prompt is longer
        than the budget) or a preempted one recomputed (its saved kept cache is restored, and its last token decodes
        over it). The decision is the prompt's (vLLM's ``num_prompt_tokens``), as in the scheduler: a recomputed
        request's prefill also holds the tokens it had generated, and a prompt within the budget stays uncompressed
        however long the recomputation is. A row of one token of a running compressed request is a decode.
        """
        cfg, bs = self.config, self.block_size
        plan = StepPlan(state=self, num_reqs=int(cm.num_reqs))
        qsl = cm.query_start_loc_cpu.tolist() if cm.query_start_loc_cpu is not None else cm.query_start_loc.tolist()
        seq_lens = cm.seq_lens.cpu().clone()
        table = cm.block_table_tensor
        req_ids, prompt_lens = self.step_req_ids, self.step_prompt_lens
        decodes: list[tuple[RequestState, int, int, int]] = []  # (state, token index, batch row, blocks held)
        for i in range(cm.num_reqs):
            qs, qe = qsl[i], qsl[i + 1]
            qlen, slen = qe - qs, int(seq_lens[i])
            if qlen == 0:
                continue
            first = int(table[i, 0])
            if first == 0:  # vLLM's null block: dummy/profiling rows
                continue
            rid = req_ids[i] if i < len(req_ids) else f"block-{first}"
            if qlen == slen:  # a prefill from position 0: a new or recomputed request
                old = self.requests.pop(rid, None)
                if old is not None:
                    self.release(old)
                st = self._unsave(rid)
                if st is not None and st.saved is not None:  # recomputed after preemption: restore
                    pool = self.decode_pool()
                    st.row = pool.allocate(st.prompt_len, cfg.budget)
                    pool.restore_row(st.row, st.saved["meta"])
                    held = st.blocks(cfg, bs)
                    plan.restores.append((st, table[i, :held].clone()))
                    self.counters["restored"] += 1
                    self.requests[rid] = st
                    decodes.append((st, qe - 1, i, held))  # the last token decodes over the restored cache
                    continue
                prompt = int(prompt_lens[i]) if i < len(prompt_lens) and prompt_lens[i] else slen  # 0: unknown
                if cfg.compresses(prompt):
                    st = RequestState(rid, slen, self._new_cache(prompt, slen), prompt_tokens=prompt)
                    pool = self.decode_pool()
                    st.row = pool.allocate(slen, cfg.budget)
                    st.meta_bytes, st.lin_bytes = pool.row_bytes()
                    self.requests[rid] = st
                    if self.record_runs:
                        self.record_run(st)
                    held = min(st.blocks(cfg, bs), math.ceil(slen / bs))  # kept entries fit the prompt's blocks
                    plan.prefills.append((st, qs, qe, table[i, :held].clone()))
                continue
            running = self.requests.get(rid)
            if running is None:
                continue
            if qlen != 1:
                raise RuntimeError(
                    f"slake: a compressed request was scheduled {qlen} tokens in one step; the plugin "
                    f"supports one token per decode step (no speculative decoding, no chunked prefill)"
                )
            decodes.append((running, qs, i, running.blocks(cfg, bs)))
            # vLLM's kernel still runs over this row, but the pool's output replaces it: let it read one slot
            # (never past the request's blocks, and no wasted pass over the kept cache)
            seq_lens[i] = 1
        if decodes:
            self._plan_decodes(plan, decodes, table)
            cm = dataclasses.replace(
                cm, seq_lens=seq_lens.to(cm.seq_lens.device), max_seq_len=int(seq_lens[: cm.num_reqs].max())
            )
        return plan, cm

    def _plan_decodes(
        self, plan: StepPlan, decodes: list[tuple[RequestState, int, int, int]], table: torch.Tensor
    ) -> None:
        """Fill ``plan``'s batched decode: the rows in pool-row order, their block tables and slots."""
        bs = self.block_size
        decodes = sorted(decodes, key=lambda d: d[0].row or 0)  # row order: usually one contiguous run of rows
        pool = self.decode_pool()
        W = pool.width
        nb = -(-W // bs)
        idx = torch.tensor([d[2] for d in decodes], dtype=torch.int64)
        held = torch.tensor([d[3] for d in decodes], dtype=torch.int64)
        tbl = table[idx, :nb].to(torch.int64)
        if tbl.shape[1] < nb:
            # vLLM's block table holds ceil(max_model_len / block_size) blocks rounded up to 128 tokens, and the pool's
            # width can be one slot more (min(layer_tokens, max_model_len) + 1: CAKE/SLAKE whose cap reaches
            # max_model_len); the missing columns are past every request's own blocks, replaced just below
            tbl = torch.cat([tbl, tbl[:, :1].expand(-1, nb - tbl.shape[1])], dim=1)
        # slots past a request's own blocks (CAKE/SLAKE prompts below the layer cap) are never valid: point them at
        # its first block so that the gather stays inside its own data
        tbl = torch.where(torch.arange(nb)[None, :] < held[:, None], tbl, tbl[:, :1])
        blocks, offsets = slot_blocks(tbl, W, bs)
        rows = [int(d[0].row or 0) for d in decodes]  # every decoding request holds a row
        row_tensor = torch.tensor(rows, dtype=torch.int64)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        tokens = [d[1] for d in decodes]  # the rows' token indices in the step's batch
        qslice = slice(tokens[0], tokens[0] + len(tokens)) if tokens == list(range(tokens[0], tokens[-1] + 1)) else None
        newest = pool.seen.index_select(0, row_tensor).view(-1, 1, 1)
        pool.seen.index_add_(0, row_tensor, torch.ones_like(row_tensor))
        plan.decode = DecodeBatch(
            rows=row_tensor,
            row_index=slice(rows[0], rows[0] + len(rows)) if contiguous else row_tensor,
            widths=pool.layer_widths(rows),
            qidx=torch.tensor(tokens, dtype=torch.int64),
            table=tbl,
            blocks=blocks,
            offsets=offsets,
            newest=newest,
            qslice=qslice,
        )
        restored = {id(st) for st, _ in plan.restores}
        masked = [d[1] for d in decodes if id(d[0]) not in restored]
        plan.masked_tokens = torch.tensor(masked, dtype=torch.int64) if masked else None

    # ------------------------------------------------------------------ what drivers read
    def report(self) -> dict[str, Any]:
        """What a driver reads back (plain data, so that it crosses vLLM's process boundary): the method and profile
        the engine runs, the decode step's implementation (``kernels_asked``: the configuration's ``kernels``;
        ``kernels``: :meth:`kernels_ran`; ``kernel_steps`` and ``kernel_fallbacks``: the pool's
        :class:`~slake.cache.fused_step.KernelReport`, layer-steps per implementation and, per reason, the steps the
        fused kernels were asked for and did not cover), the recorded runs, the step timings, counters and the pool's
        size. ``running`` counts the compressed requests whose rows the plugin holds, which includes those finished
        in the last step: vLLM names a step's finished requests to the worker with the next step's scheduler output,
        so after the last step of a run they are released only when another request comes."""
        report = None if self.pool is None else self.pool.report
        return {
            "method": self.config.method.name,
            "budget": self.config.budget,
            "hyperparameters": self.config.method.hyperparameters(),
            "profile": self.config.profile,
            "kernels_asked": self.config.kernels,
            "kernels": self.kernels_ran(),
            "kernel_steps": {} if report is None else dict(report.steps),
            "kernel_fallbacks": {} if report is None else dict(report.fallbacks),
            "runs": [
                {
                    "req_id": st.req_id,
                    "prompt_len": st.prompt_len,
                    "kept_tokens_per_layer": self.kept_tokens_per_layer(st),
                    "metadata_bytes": st.meta_bytes,
                    "linear_state_bytes": st.lin_bytes,
                    "preemptions": st.preemptions,
                }
                for st in self.runs.values()
            ],
            "step_times": list(self.step_times),
            "counters": dict(self.counters),
            "pool_rows": 0 if self.pool is None else self.pool.rows,
            "running": len(self.requests),
            "saved": len(self.saved),
            "saved_bytes": self.saved_bytes,
        }
