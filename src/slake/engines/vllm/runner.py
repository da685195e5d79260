"""Running vLLM in-process with (or without) the plugin: ``slake generate --engine vllm`` and the vLLM tests.

:func:`run_vllm` starts one engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that the scheduler's
block statistics can be read back), generates greedily from token ids, and returns tokens, timings, KV blocks held
after prefill and at the end, the kept tokens per layer, and the method and profile the plugin ran (read from the
worker with ``LLM.collective_rpc``, :mod:`slake.engines.vllm.plugin.worker`).
:func:`local_model_dir` (:mod:`slake.engines.vllm.converted`) converts a GGUF model (the packaged default model)
once to a safetensors directory that vLLM loads without the hub.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slake.engines.vllm.converted import CACHE_ENV, cache_dir, local_model_dir, save_dequantized  # noqa: F401

#: vLLM's legacy CPU KV-cache size (whole GiB); when set, its CPU platform lets it override every engine's
#: ``kv_cache_memory_bytes``, so :func:`new_llm` hides it while an engine is built
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def model_len(prompt_len: int, new_tokens: int, limit: int | None = None) -> int:
    """``max_model_len`` for prompts of up to ``prompt_len`` tokens and ``new_tokens`` more, rounded up to 256, and
    no more than the model's context ``limit`` when they fit in it (vLLM refuses a ``max_model_len`` beyond the
    model's unless told otherwise, see :func:`run_vllm`'s ``allow_long_context``)."""
    rounded = int(math.ceil((prompt_len + new_tokens + 1) / 256) * 256)
    if limit is not None and prompt_len + new_tokens <= limit:
        return min(rounded, limit)
    return rounded


def dtype_itemsize(dtype: str) -> int:
    """Bytes per value of the model dtype ``dtype`` (any spelling :func:`slake.engines.vllm.plugin.config.vllm_dtype`
    reads, or a ``torch.`` name), for the KV bytes a run reports.

    Raises
    ------
    ValueError
        For a dtype that is none of float32, float16 and bfloat16 (never counted as some default size).
    """
    from slake.engines.vllm.plugin.config import vllm_dtype

    name = vllm_dtype(str(dtype).replace("torch.", ""))
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2}
    if name not in sizes:
        raise ValueError(f"slake: unknown model dtype {dtype!r}; use float32, float16 or bfloat16")
    return sizes[name]


def _config_json(model_dir: str) -> dict:
    """A model folder's ``config.json``."""
    return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))


def model_limits(model_dir: str) -> tuple[int, int | None]:
    """``(vocab_size, max_position_embeddings)`` from the model folder's ``config.json`` (the text model's, for
    multimodal configs); the second is None when the config has none."""
    from slake.engines.context import context_limit

    cfg = _config_json(model_dir)
    return int((cfg.get("text_config") or cfg)["vocab_size"]), context_limit(cfg)


def model_context_limit(model_dir: str) -> int | None:
    """The context (``max_position_embeddings``) of a model folder's ``config.json``; None without one."""
    from slake.engines.context import context_limit

    return context_limit(_config_json(model_dir))


@dataclass
class VllmRun:
    """What :func:`run_vllm` returns (one entry per prompt where lists)."""

    tokens: list[list[int]]
    prompt_tokens: list[int]
    blocks_after_prefill: list[int | None]
    blocks_end: list[int | None]
    block_size: int
    compressed: list[bool]
    kept_tokens_per_layer: list[list[float] | None]
    kv_bytes: list[dict]
    #: times vLLM preempted each request (and recomputed it)
    preemptions: list[int]
    prefill_s: list[float]
    decode_ms_per_token: list[float]
    wall_s: float
    config: dict | None = None
    model_info: dict = field(default_factory=dict)
    #: what the plugin reports of the engine (:meth:`slake.engines.vllm.plugin.state.PluginState.report`, without
    #: its runs and step times): ``method``, ``budget``, ``hyperparameters`` and ``profile`` (the model's profile
    #: entry it applied) it ran with, ``kernels_asked`` and ``kernels`` (the decode step's implementation asked for,
    #: and which ran: ``torch``, ``triton`` or ``torch (fallback: why)``), ``kernel_steps`` and ``kernel_fallbacks``
    #: (the decode pool's counts), ``counters`` (preempted requests saved and restored), ``pool_rows``, ``running``
    #: and ``saved`` requests at the end (``running``: rows held, the last step's finished requests included, which
    #: vLLM names to the worker only with a next step); None for plain vLLM
    plugin: dict | None = None
    #: with ``timing``: per step with compressed decodes, (compressed rows, requests in the step, layers, plugin
    #: seconds summed over layers)
    step_times: list[tuple[int, int, int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def engine_kwargs(
    model_dir: str,
    *,
    slake: dict | None,
    block_size: int,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int = 16,
    num_blocks: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_bytes: int | None = None,
) -> dict:
    """``vllm.LLM`` keyword arguments the plugin needs: whole-prompt prefill, no prefix caching, eager mode.
    ``num_blocks``: a fixed number of KV blocks (vLLM's ``num_gpu_blocks_override``), e.g. to force preemption;
    ``max_num_batched_tokens``: tokens one step may hold, at least ``max(max_model_len, 2048)``;
    ``kv_cache_bytes``: this engine's KV-cache size (vLLM's ``kv_cache_memory_bytes``; build the engine with
    :func:`new_llm`, which keeps ``VLLM_CPU_KVCACHE_SPACE`` from overriding it).

    The configuration is always stated: ``additional_config={"slake": slake}``, with ``None`` for plain vLLM, which
    the plugin reads as plain whatever the ``SLAKE_VLLM`` variable holds (it reads the variable only when the key is
    missing, as ``vllm serve`` users rely on)."""
    kw = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        block_size=block_size,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(max_model_len, 2048, max_num_batched_tokens or 0),
        max_num_seqs=max_num_seqs,
        disable_log_stats=False,
        additional_config={"slake": slake or None},
    )
    if num_blocks is not None:
        kw["num_gpu_blocks_override"] = int(num_blocks)
    if kv_cache_bytes is not None:
        kw["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    return kw


def kv_cache_bytes_for(kv_cache_gib: float | None = None) -> int:
    """An engine's KV-cache size in bytes: ``kv_cache_gib`` GiB when given, else ``VLLM_CPU_KVCACHE_SPACE`` (whole
    GiB) when set and not empty, else 1 GiB."""
    if kv_cache_gib is None:
        env = os.environ.get(KV_SPACE_ENV, "").strip()
        kv_cache_gib = float(env) if env else 1.0
    if not kv_cache_gib > 0:
        raise ValueError(f"the KV cache size must be positive, not {kv_cache_gib} GiB")
    return int(float(kv_cache_gib) * 2**30)


def new_llm(kw: dict):
    """``vllm.LLM(**kw)``, with ``kw["kv_cache_memory_bytes"]`` (when given) as this engine's KV-cache size.

    vLLM's CPU platform replaces ``kv_cache_memory_bytes`` with the process-wide ``VLLM_CPU_KVCACHE_SPACE`` when
    that variable is set (``CpuPlatform.check_and_update_config``, run while the engine is built), so the variable is
    removed from the environment while the engine is built (its engine-core process, if any, starts then too) and
    put back after: every engine of a process gets the size it is given."""
    from vllm import LLM

    if kw.get("kv_cache_memory_bytes") is None:
        return LLM(**kw)
    saved = os.environ.pop(KV_SPACE_ENV, None)
    try:
        return LLM(**kw)
    finally:
        if saved is not None:
            os.environ[KV_SPACE_ENV] = saved


def run_vllm(
    model_dir: str,
    prompts: list[list[int]],
    *,
    slake: dict | None,
    max_new_tokens: int,
    block_size: int = 32,
    dtype: str = "float32",
    max_model_len: int = 4096,
    stop_token_ids=None,
    ignore_eos: bool = False,
    kv_cache_gib: float | None = None,
    max_num_seqs: int = 16,
    num_blocks: int | None = None,
    max_tokens: list[int] | None = None,
    timing: bool = False,
    step_log: list[tuple[float, list[int]]] | None = None,
    max_num_batched_tokens: int | None = None,
) -> VllmRun:
    """Generate greedily with vLLM in this process.

    Parameters
    ----------
    model_dir : str
        A model directory vLLM can load (see :func:`local_model_dir`).
    prompts : list[list[int]]
        Prompt token ids, run as one batch (vLLM schedules them concurrently).
    slake : dict | None
        The plugin configuration (``{"method": "snapkv", "budget": 128}``) or None for plain vLLM.
    max_new_tokens : int
        Tokens to generate per prompt (fewer when a stop token comes first).
    block_size : int
        vLLM KV block size (a multiple of 32 on CPU).
    stop_token_ids : list[int] | None
        End-of-sequence ids (the model's EOS), as ``model.generate`` stops on them.
    ignore_eos : bool
        Generate exactly ``max_new_tokens``.
    kv_cache_gib : float | None
        This engine's KV-cache size in GiB (vLLM's ``kv_cache_memory_bytes``; it takes effect for every engine of
        the process); None: ``VLLM_CPU_KVCACHE_SPACE`` when set, else 1 GiB (:func:`kv_cache_bytes_for`).
    max_num_seqs : int
        Requests vLLM runs at once (the others wait in its queue).
    num_blocks : int | None
        A fixed number of KV blocks (small enough, it makes vLLM preempt requests).
    max_tokens : list[int] | None
        Tokens to generate per prompt, overriding ``max_new_tokens`` prompt by prompt.
    timing : bool
        Record the plugin's time in each step (``VllmRun.step_times``).
    step_log : list | None
        When a list, the engine is stepped here (``LLMEngine.step``) instead of by ``LLM.generate``, and each step
        appends ``(wall seconds, tokens generated so far by each prompt)`` to it (:func:`generate_stepwise`).
    max_num_batched_tokens : int | None
        Tokens one step may hold, at least the default (``max(max_model_len, 2048)``): the sum of the prompts
        prefills them all in one step.
    """
    itemsize = dtype_itemsize(dtype)  # an unknown dtype is refused before the engine starts
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for --json
    from vllm import SamplingParams

    from slake.engines.vllm.plugin import worker
    from slake.engines.vllm.plugin.scheduler import BlockPolicy

    llm = new_llm(
        engine_kwargs(
            model_dir,
            slake=slake,
            block_size=block_size,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            num_blocks=num_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_bytes=kv_cache_bytes_for(kv_cache_gib),
        )
    )
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    policy = getattr(manager, "slake_policy", None)
    if policy is None:  # plain vLLM: record the blocks held, change nothing else
        policy = manager.slake_policy = BlockPolicy(None)
    policy.stats = {}
    # the run log keeps one record per request: room for every prompt of this run, none dropped
    llm.collective_rpc(
        worker.configure,
        kwargs={"record_runs": True, "timing": timing, "clear": True, "run_log_max": max(len(prompts), 1)},
    )
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=list(stop_token_ids or []),
        detokenize=False,
    )
    t0 = time.perf_counter()
    params = sp if max_tokens is None else [sp.clone() for _ in prompts]
    if max_tokens is not None:
        for p, n in zip(params, max_tokens):
            p.max_tokens = int(n)
    if step_log is None:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    else:
        outs = generate_stepwise(llm, prompts, params, step_log)
    wall = time.perf_counter() - t0
    model_config = llm.llm_engine.model_config
    layers = int(model_config.hf_text_config.num_hidden_layers)
    # the cache vLLM allocated (the ranks' heads summed); vLLM's reading of the config where none is reported
    shapes = [s for s in llm.collective_rpc(worker.kv_cache_heads) if s is not None]
    if shapes:
        kv_heads, head_dim = sum(h for h, _ in shapes), shapes[0][1]
    else:
        kv_heads, head_dim = int(model_config.get_total_num_kv_heads()), int(model_config.get_head_size())
    per_token = 2 * kv_heads * head_dim * itemsize  # one token of one layer, keys + values
    reports = [r for r in llm.collective_rpc(worker.report) if r is not None]
    plugin = reports[0] if reports else None
    runs = plugin.pop("runs") if plugin is not None else []
    step_times = plugin.pop("step_times") if plugin is not None else []
    run = VllmRun(
        tokens=[],
        prompt_tokens=[],
        blocks_after_prefill=[],
        blocks_end=[],
        block_size=block_size,
        compressed=[],
        kept_tokens_per_layer=[],
        kv_bytes=[],
        preemptions=[],
        prefill_s=[],
        decode_ms_per_token=[],
        wall_s=wall,
        config=slake,
        model_info={"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype)},
        plugin=plugin,
        step_times=step_times,
    )
    records = _runs_by_request(runs)
    for out in outs:
        toks = list(out.outputs[0].token_ids)
        n = len(out.prompt_token_ids)
        stats = policy.stats_for(out.request_id)
        rec = records.get(out.request_id)
        # the configuration decides (a prompt longer than the budget, as the scheduler and the worker decide), not
        # the presence of a record: a compressed request without one would be reported as the full cache
        compressed = _compresses(policy, plugin, n)
        if compressed and rec is None:
            raise RuntimeError(
                f"slake: request {out.request_id} (a prompt of {n} tokens, longer than the budget) was compressed, "
                f"but the plugin returned no record of it ({len(runs)} records for {len(prompts)} prompts), so its "
                "kept tokens and KV bytes are unknown"
            )
        if not compressed and rec is not None:
            raise RuntimeError(
                f"slake: the plugin recorded request {out.request_id} (prompt of {n} tokens) as compressed, but the "
                "configuration does not compress it"
            )
        if rec is not None:
            kept = rec["kept_tokens_per_layer"]
        else:
            kept = [float(n + len(toks) - 1)] * layers  # the last token's K/V is never written
        run.tokens.append(toks)
        run.prompt_tokens.append(n)
        run.blocks_after_prefill.append(stats.get("after_prefill"))
        run.blocks_end.append(stats.get("end"))
        run.compressed.append(compressed)
        m = out.metrics
        # vLLM counts every request's preemptions (with its statistics on); the plugin only the compressed ones'
        run.preemptions.append(max(rec["preemptions"] if rec is not None else 0, int(getattr(m, "num_preemptions", 0))))
        run.kept_tokens_per_layer.append(kept)
        held = stats.get("end")
        kept_bytes = int(sum(kept) * per_token)
        run.kv_bytes.append(
            {
                "full": int((n + len(toks) - 1) * layers * per_token),
                "kept": kept_bytes,
                "padding": max(int(held * block_size * layers * per_token) - kept_bytes, 0) if held is not None else 0,
                "metadata": rec["metadata_bytes"] if rec is not None else 0,
                "linear_state": rec["linear_state_bytes"] if rec is not None else 0,
                "blocks_held": int(held * block_size * layers * per_token) if held is not None else None,
            }
        )
        if m is not None and getattr(m, "first_token_ts", None) and getattr(m, "scheduled_ts", None):
            run.prefill_s.append(round(m.first_token_ts - m.scheduled_ts, 4))
            steps = max(len(toks) - 1, 1)
            run.decode_ms_per_token.append(round((m.last_token_ts - m.first_token_ts) * 1000 / steps, 3))
        else:
            run.prefill_s.append(float("nan"))
            run.decode_ms_per_token.append(float("nan"))
    del llm
    return run


def generate_stepwise(llm, prompts: list[list[int]], params, log: list[tuple[float, list[int]]]) -> list:
    """``LLM.generate`` of ``prompts`` (greedy ``params``: one ``SamplingParams`` or one per prompt), stepping the
    engine here: after each step, ``(its wall seconds, tokens generated so far by each prompt)`` is appended to
    ``log``. Returns the finished ``RequestOutput`` of each prompt, in prompt order."""
    eng = llm.llm_engine
    plist = list(params) if isinstance(params, list) else [params] * len(prompts)
    ids = [f"stepwise-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, plist):
        eng.add_request(rid, {"prompt_token_ids": list(p)}, sp)  # cumulative outputs: every step reports each
    index = {rid: i for i, rid in enumerate(ids)}
    counts = [0] * len(prompts)
    done: dict[int, object] = {}
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        for out in outs:
            i = index[out.request_id.rsplit("-", 1)[0] if out.request_id not in index else out.request_id]
            counts[i] = len(out.outputs[0].token_ids)
            if out.finished:
                done[i] = out
        log.append((dt, list(counts)))
    return [done[i] for i in range(len(prompts))]


def _compresses(policy, plugin: dict | None, prompt_len: int) -> bool:
    """Whether the engine compresses a prompt of ``prompt_len`` tokens: the scheduler's configuration
    (:meth:`slake.engines.vllm.plugin.config.SlakeVllmConfig.compresses`, longer than the budget), or, without one,
    the budget the plugin reports; False for plain vLLM."""
    cfg = getattr(policy, "config", None)
    if cfg is not None:
        return bool(cfg.compresses(prompt_len))
    if plugin is not None and plugin.get("budget") is not None:
        return prompt_len > int(plugin["budget"])
    return False


def _runs_by_request(runs: list[dict]) -> dict[str, dict]:
    """The plugin's records by the id a request's ``RequestOutput`` carries (the engine core appends ``-<suffix>``
    to it; a record is found under its own id too), the latest one where a request was recorded twice."""
    out: dict[str, dict] = {}
    for run in runs:
        rid = run["req_id"]
        out[rid.rsplit("-", 1)[0]] = run
        out[rid] = run
    return out


def expected_blocks(
    prompt_len: int, new_tokens: int, budget: int | None, block_size: int, layer_tokens: int | None = None
) -> tuple[int, int]:
    """Blocks a request holds (after prefill, at the end) with the plugin at ``budget`` or, for None, without it.

    After prefill means at the first decode step (its slot included); at the end, when the last token is
    scheduled (the last token's own K/V is never written, so ``prompt_len + new_tokens - 1`` slots).
    ``layer_tokens``: the most tokens a layer keeps (``max_layer_budget`` of CAKE/SLAKE; default the budget).
    """
    if budget is not None and prompt_len > budget:
        b = math.ceil((min(layer_tokens or budget, prompt_len) + 1) / block_size)
        return b, b
    return math.ceil((prompt_len + 1) / block_size), math.ceil((prompt_len + new_tokens - 1) / block_size)
