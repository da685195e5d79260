"""Throughput, KV memory and step times of vLLM with and without the plugin: ``slake bench --engine vllm``.

Per length and budget (:func:`run_bench`): a batch of ``--batch`` prompts of random tokens is submitted at once
(offline ``vllm.LLM``, as ``vllm bench throughput`` does, all prefilled in one step) and each request generates
exactly ``1 + --warmup + --decode-steps`` tokens (:func:`bench`): the prefill's token, ``--warmup`` untimed decode
steps, then ``--decode-steps`` timed ones; for each configuration (plain vLLM, then each method at the budget) a row
holds wall time, output tokens/s, total tokens/s (both over the whole run, prefill included), the mean time of the
timed decode steps (:func:`timed_decode_steps`), the KV blocks one request holds after prefill and at the end, and
how many such requests one GiB of KV cache holds at once (blocks per GiB divided by the blocks a request holds at the
end). Lengths whose prompt and generated tokens exceed the model's context are refused before any engine starts
(:func:`check_lengths`). Before that, in the same process and plain vLLM first, the engine's steps are timed one by one
(:func:`step_bench`): the prefill step, decode-only steps and mixed steps, with their ratios to plain vLLM's and the
plugin's own time per compressed request and layer. Every engine's KV cache is sized for its own length: room for
each request's full sequence, 1.5x (:func:`bench_kv_cache_bytes`, passed as vLLM's ``kv_cache_memory_bytes``), so
that plain vLLM holds the whole batch at every length. Rows record the run's settings (``run_id``, ``dtype``,
``block_size``, ``seed``, ``warmup``, ``decode_steps``): ``bench_vllm.jsonl`` is appended to, run after run.

Each method runs as ``vllm serve`` users get it (``{"method", "budget"}``): the plugin applies the model's profile,
and the rows' ``profile`` is the entry it reports it applied. ``--kernels`` other than ``auto`` goes into that
configuration (``"kernels"``); each row records the choice (``kernels_asked``) and, as the transformers engine's rows
do, which implementation ran the plugin's decode steps (``kernels``: ``torch``, ``triton``, or ``torch (fallback:
why)`` where the fused kernels were asked for and did not cover a step; None for plain vLLM), as the plugin reports
it (:meth:`slake.engines.vllm.plugin.state.PluginState.report`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import uuid

from slake.engines.base import BenchPlan, BenchReport, load_avg

#: mixed steps :func:`step_bench` times per configuration
MIXED_STEPS = 2


def _plugin_config(method: str, budget: int, kernels: str = "auto") -> dict | None:
    """The plugin configuration of ``method`` at ``budget`` as ``vllm serve`` users write it (None for ``"full"``,
    plain vLLM): the plugin applies the model's profile itself, and reports the entry it applied; ``kernels`` other
    than ``"auto"`` is the configuration's ``"kernels"``."""
    from slake.budgets.budget import Budget
    from slake.engines.vllm.plugin.config import plugin_config

    return plugin_config(method, Budget(budget), kernels=kernels)


def token_range(model_dir: str) -> int:
    """The upper bound of the random prompts' token ids: ``min(1000, vocab_size)`` of the model folder's
    ``config.json`` (ids every tokenizer of interest has, and every id within a small vocabulary)."""
    from slake.engines.vllm.runner import model_limits

    return min(1000, model_limits(model_dir)[0])


def step_new_tokens(decode_steps: int, mixed: int) -> int:
    """Tokens each request of :func:`step_times` generates (none finishes while steps are timed)."""
    return decode_steps + 4 * (mixed + 1) + 8


def check_lengths(plan: BenchPlan, limit: int | None) -> None:
    """Raise a one-line ValueError for a ``--lengths`` entry whose prompt plus the tokens generated after it (the
    throughput run's ``1 + --warmup + --decode-steps``, the step timing's :func:`step_new_tokens`) exceed the model's
    context ``limit``: vLLM refuses such an engine (its ``max_model_len`` beyond ``max_position_embeddings``)."""
    if limit is None:
        return
    new = max(1 + plan.warmup + plan.decode_steps, step_new_tokens(max(plan.decode_steps, 2), MIXED_STEPS))
    over = [n for n in plan.lengths if n + new > limit]
    if over:
        raise ValueError(
            f"--lengths {','.join(map(str, over))}: a prompt of {over[0]} tokens plus the {new} generated after it "
            f"exceeds the model's context of {limit} tokens (max_position_embeddings), which vLLM refuses; "
            f"use lengths up to {limit - new}"
        )


def timed_decode_steps(log: list[tuple[float, list[int]]], warmup: int, decode_steps: int) -> list[float]:
    """The wall seconds of the timed decode steps in a step log (:func:`slake.engines.vllm.runner.generate_stepwise`):
    the first ``decode_steps`` steps in which every request, having generated its prefill token and ``warmup`` more
    before the step, generates one more token (decode-only steps of the whole batch, after the warm-up)."""
    out: list[float] = []
    prev: list[int] | None = None
    for dt, counts in log:
        if prev is not None and min(prev) >= 1 + warmup and all(c == p + 1 for c, p in zip(counts, prev)):
            out.append(dt)
        prev = counts
    return out[:decode_steps]


def bench(
    model_dir: str,
    *,
    requests: int,
    prompt_len: int,
    decode_steps: int,
    methods: list[str],
    budget: int,
    block_size: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    include_plain: bool = True,
    warmup: int = 0,
    kernels: str = "auto",
) -> list[dict]:
    """One row per configuration (``"full"`` = plain vLLM, first when ``include_plain``); see the module docstring
    for the columns. Every request generates ``1 + warmup + decode_steps`` tokens; ``decode_ms_per_step`` is the mean
    of the ``decode_steps`` decode steps after the ``warmup`` ones (``decode_steps_timed`` says how many were timed).
    Every configuration gets the same random prompts; each method runs as ``vllm serve`` users get it, with the
    model's profile (the row's ``profile`` is the entry the plugin applied), and with ``kernels`` (the plugin's
    decode-step implementation asked for: the row's ``kernels_asked``; ``kernels`` is which ran)."""
    import torch

    from slake.engines.vllm.runner import dtype_itemsize, model_context_limit, model_len, run_vllm

    g = torch.Generator().manual_seed(seed)
    hi = token_range(model_dir)
    prompts = [torch.randint(10, hi, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    new_tokens = 1 + warmup + decode_steps
    limit = model_context_limit(model_dir)
    rows = []
    for method in (["full"] if include_plain else []) + list(methods):
        cfg = _plugin_config(method, budget, kernels)
        log: list[tuple[float, list[int]]] = []
        run = run_vllm(
            model_dir,
            prompts,
            slake=cfg,
            max_new_tokens=new_tokens,
            ignore_eos=True,
            block_size=block_size,
            dtype=dtype,
            max_model_len=model_len(prompt_len, new_tokens, limit),
            max_num_seqs=max(requests, 1),
            step_log=log,
            max_num_batched_tokens=requests * prompt_len,  # every prompt prefilled in one step
            kv_cache_gib=bench_kv_cache_bytes(model_dir, dtype, requests, prompt_len + new_tokens) / 2**30,
        )
        timed = timed_decode_steps(log, warmup, decode_steps)
        info = run.model_info
        block_bytes = block_size * info["layers"] * 2 * info["kv_heads"] * info["head_dim"] * dtype_itemsize(dtype)
        end = max(b for b in run.blocks_end if b is not None)
        generated = sum(len(t) for t in run.tokens)
        rows.append(
            {
                "method": method,
                "budget": None if cfg is None else budget,
                "profile": run.plugin["profile"] if run.plugin else None,
                "kernels_asked": kernels,
                # which implementation ran the plugin's decode steps (PluginState.kernels_ran); None for plain vLLM
                "kernels": run.plugin["kernels"] if run.plugin else None,
                "dtype": dtype,
                "block_size": block_size,
                "seed": seed,
                "requests": requests,
                "prompt_len": prompt_len,
                "new_tokens": new_tokens,
                "warmup": warmup,
                "decode_steps": decode_steps,
                "wall_s": round(run.wall_s, 2),
                "output_tok_s": round(generated / run.wall_s, 2),
                "total_tok_s": round((generated + requests * prompt_len) / run.wall_s, 1),
                "blocks_after_prefill": max(b for b in run.blocks_after_prefill if b is not None),
                "blocks_end": end,
                "block_mib": round(block_bytes / 2**20, 3),
                "requests_per_gib": math.floor((2**30 // block_bytes) / end),
                "decode_ms_per_step": round(1000 * sum(timed) / len(timed), 1) if timed else None,
                "decode_steps_timed": len(timed),
            }
        )
    return rows


#: row fields the same for every row of a run: in ``bench_vllm.jsonl``, said once above the table
RUN_FIELDS = ("engine", "model", "run_id", "dtype", "block_size", "seed", "warmup", "decode_steps")


def new_run_id() -> str:
    """An id for the rows of one run (its start time, UTC, and a random suffix), so that runs appended to one
    JSONL file can be told apart, as the transformers engine's ``bench.jsonl`` rows are."""
    return time.strftime("%Y%m%dT%H%M%SZ-", time.gmtime()) + uuid.uuid4().hex[:8]


def markdown(rows: list[dict]) -> str:
    """The rows of :func:`bench` as a markdown table (the columns of the first row, less the run's own settings,
    :data:`RUN_FIELDS`, and the load averages, profile and ``kernels_asked``)."""
    if not rows:
        return ""
    cols = [c for c in rows[0] if c not in (*RUN_FIELDS, "load_avg_1m", "profile", "kernels_asked")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def run_bench(
    plan: BenchPlan, model_dir: str, dtype: str, model_name: str, kernels: str = "auto", block_size: int = 32
) -> BenchReport:
    """:func:`bench` per length and budget (plain vLLM once per length) on the model in ``model_dir``; rows appended
    to ``OUT/bench_vllm.jsonl``, this run's table in ``OUT/bench_vllm.md``. Each request generates
    ``1 + warmup + decode_steps`` tokens, and the ``decode_steps`` after the warm-up are timed. Lengths beyond the
    model's context are refused before anything starts (:func:`check_lengths`). Each row also carries
    :func:`step_bench`'s step timings, measured before the throughput run in the same process with plain vLLM first:
    the prefill step, the decode-only step (median of ``decode_steps``), the mixed step (one prefill plus the batch's
    decode), each with its ratio to plain vLLM's (``*_vs_plain``), and the plugin's own time per compressed request
    and layer. ``kernels``: the plugin's decode-step implementation (``--kernels``; rows: ``kernels_asked``, and
    ``kernels``, which ran). ``block_size``: vLLM's KV block size. Every row records the run's settings (``run_id``,
    ``dtype``, ``block_size``, ``seed``, ``warmup``, ``decode_steps``), so that runs appended to one JSONL file can be
    told apart; ``bench_vllm.md`` says them once above the table. A dtype other than float32, float16 and bfloat16 is
    refused before anything starts."""
    from slake.engines.vllm.runner import dtype_itemsize, model_context_limit

    dtype_itemsize(dtype)  # an unknown dtype: refused here, not after an engine has started
    check_lengths(plan, model_context_limit(model_dir))
    methods = [m for m in plan.methods if m != "full"]  # plain vLLM is always measured
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    run_id = new_run_id()
    with open(out / "bench_vllm.jsonl", "a", encoding="utf-8") as f:
        for n in plan.lengths:
            for i, b in enumerate(plan.budgets):
                print(f"slake bench (vllm): length {n}, budget {int(b.value)}", file=sys.stderr)
                steps = {
                    r["method"]: r
                    for r in step_bench(
                        model_dir,
                        requests=plan.batch,
                        prompt_len=n,
                        decode_steps=max(plan.decode_steps, 2),
                        mixed=MIXED_STEPS,
                        methods=methods,
                        budget=int(b.value),
                        block_size=block_size,
                        dtype=dtype,
                        seed=plan.seed,
                        kernels=kernels,
                    )
                }
                for row in bench(
                    model_dir,
                    requests=plan.batch,
                    prompt_len=n,
                    decode_steps=plan.decode_steps,
                    warmup=plan.warmup,
                    methods=methods,
                    budget=int(b.value),
                    block_size=block_size,
                    dtype=dtype,
                    seed=plan.seed,
                    include_plain=i == 0,
                    kernels=kernels,
                ):
                    st = steps.get(row["method"], {})
                    row.update({k: v for k, v in st.items() if k not in row and k != "load_avg_1m"})
                    row.update(
                        {
                            "engine": "vllm",
                            "model": model_name,
                            "run_id": run_id,
                            "load_avg_1m": load_avg(),
                            "steps_load_avg_1m": st.get("load_avg_1m"),
                        }
                    )
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
    table = markdown(rows)
    settings = (
        f"Model {model_name} ({dtype}), block size {block_size}, batch {plan.batch}, {plan.decode_steps} timed decode "
        f"steps after {plan.warmup} warm-up steps; prompts are random token ids of seed {plan.seed}; run {run_id} "
        "(run_id in bench_vllm.jsonl).\n\n"
    )
    (out / "bench_vllm.md").write_text("# slake bench --engine vllm\n\n" + settings + table + "\n", encoding="utf-8")
    return BenchReport(rows=rows, table=table, files=[out / "bench_vllm.jsonl", out / "bench_vllm.md"])


# ---------------------------------------------------------------------------------------------------------------
# Step timing: decode-only and mixed steps of plain vLLM and the plugin, measured in one process, one after another.


def _timed_steps(llm, n: int) -> list[float]:
    """Run ``n`` engine steps, returning each one's wall time (seconds)."""
    eng = llm.llm_engine
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        out.append(time.perf_counter() - t0)
    return out


def _kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """KV bytes of one token, all layers (from the model's ``config.json``), at the model dtype ``dtype`` (a dtype
    other than float32, float16 and bfloat16 is refused: :func:`slake.engines.vllm.runner.dtype_itemsize`)."""
    from transformers import AutoConfig

    from slake.engines.vllm.runner import dtype_itemsize

    itemsize = dtype_itemsize(dtype)

    c = AutoConfig.from_pretrained(model_dir)
    c = getattr(c, "text_config", None) or c
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kvh = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kvh * d * itemsize


def bench_kv_cache_bytes(model_dir: str, dtype: str, requests: int, tokens: int) -> int:
    """The KV-cache size of one benchmark engine (:func:`step_times`, :func:`bench`): room for every request's full
    sequence (``requests`` of ``tokens`` each: plain vLLM holds them all at once, so that every step runs the batch
    it says), 1.5x, in whole GiB, at least 1. Computed for each engine (each length gets its own) and passed to it as
    vLLM's ``kv_cache_memory_bytes``, not through the process-wide ``VLLM_CPU_KVCACHE_SPACE`` (which it
    overrides)."""
    need = 1.5 * requests * tokens * _kv_bytes_per_token(model_dir, dtype)
    return max(1, math.ceil(need / 2**30)) * 2**30


def step_times(
    model_dir: str,
    prompts: list[list[int]],
    extra: list[list[int]],
    *,
    slake: dict | None,
    decode_steps: int,
    block_size: int = 32,
    dtype: str = "float32",
) -> dict:
    """Time an engine's steps directly (``LLMEngine.step``), for one configuration.

    All of ``prompts`` are added at once and prefilled in one step (``max_num_batched_tokens`` holds them all);
    then ``decode_steps`` decode-only steps at batch ``len(prompts)`` are timed one by one; then each prompt of
    ``extra`` is added alone, so that the next step is a mixed one (its prefill plus the running requests' decode),
    followed by two decode steps. Returns medians in milliseconds, the plugin's own time per compressed request
    and layer (the engine's step timings, read with ``LLM.collective_rpc``,
    :func:`slake.engines.vllm.plugin.worker.report`), the profile entry the plugin applied, and which implementation
    ran its decode steps (``kernels``; None for plain vLLM).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm import SamplingParams

    from slake.engines.vllm.plugin import worker
    from slake.engines.vllm.runner import engine_kwargs, model_context_limit, model_len, new_llm

    n, p = len(prompts), max(len(x) for x in prompts + extra)
    total = step_new_tokens(decode_steps, len(extra))
    kw = engine_kwargs(
        model_dir,
        slake=slake,
        block_size=block_size,
        dtype=dtype,
        max_model_len=model_len(p, total, model_context_limit(model_dir)),
        max_num_seqs=n + len(extra),
        kv_cache_bytes=bench_kv_cache_bytes(model_dir, dtype, n + len(extra), p + total),
    )
    kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], sum(len(x) for x in prompts))
    llm = new_llm(kw)  # this engine's KV size, whatever an earlier engine of the process got
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True, detokenize=False)
    # warm-up: one short request through prefill and a few decode steps (first-call costs stay out of the timings)
    eng.add_request(
        "warm",
        {"prompt_token_ids": prompts[0][: min(len(prompts[0]), 4 * block_size)]},
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False),
    )
    while eng.has_unfinished_requests():
        eng.step()
    llm.collective_rpc(worker.configure, kwargs={"timing": True, "clear": True})
    try:
        for i, x in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": list(x)}, sp)
        prefill = _timed_steps(llm, 1)[0]
        decode = _timed_steps(llm, decode_steps)
        reports = [r for r in llm.collective_rpc(worker.report) if r is not None]
        times = reports[0]["step_times"] if reports else []
        plugin = [t for r, _, layers, t in times if r == n]
        plugin_per = [t / (r * layers) for r, _, layers, t in times if r == n]
        mixed = []
        for j, x in enumerate(extra):
            eng.add_request(f"x{j}", {"prompt_token_ids": list(x)}, sp)
            mixed.append(_timed_steps(llm, 1)[0])
            _timed_steps(llm, 2)
    finally:
        llm.collective_rpc(worker.configure, kwargs={"timing": False})
        for rid in [f"r{i}" for i in range(n)] + [f"x{j}" for j in range(len(extra))]:
            try:
                eng.abort_request([rid])
            except Exception:  # noqa: BLE001 - already finished
                pass
    del llm, eng
    med = statistics.median
    return {
        "prefill_step_ms": round(prefill * 1000, 1),
        "decode_step_ms": round(med(decode) * 1000, 2),
        "decode_step_ms_min": round(min(decode) * 1000, 2),
        "mixed_step_ms": round(med(mixed) * 1000, 1) if mixed else None,
        "plugin_ms_per_step": round(med(plugin) * 1000, 2) if plugin else 0.0,
        "plugin_us_per_request_layer": round(med(plugin_per) * 1e6, 1) if plugin_per else 0.0,
        "profile": reports[0]["profile"] if reports else None,
        "kernels": reports[0]["kernels"] if reports else None,
    }


def step_bench(
    model_dir: str,
    *,
    requests: int,
    prompt_len: int,
    decode_steps: int,
    methods: list[str],
    budget: int,
    mixed: int = MIXED_STEPS,
    block_size: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    kernels: str = "auto",
) -> list[dict]:
    """:func:`step_times` for plain vLLM and each method at ``budget``, in this process one after another, with
    each step's ratio to plain vLLM's and the load average next to every row.

    Each method runs as users get it, with the model's profile (the plugin applies it); the row's ``profile`` says
    which entry applied. ``mixed``: mixed steps timed (the median is reported; one varies by 5-10% on this CPU).
    ``kernels``: the plugin's decode-step implementation (``kernels_asked``; ``kernels`` is which ran)."""
    import torch

    hi = token_range(model_dir)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, hi, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    extra = [torch.randint(10, hi, (prompt_len,), generator=g).tolist() for _ in range(mixed)]
    rows, base = [], None
    for method in ["full", *methods]:
        cfg = _plugin_config(method, budget, kernels)
        print(f"slake bench (vllm steps): {method}, {requests} x {prompt_len}", file=sys.stderr)
        before = load_avg()
        t = step_times(
            model_dir, prompts, extra, slake=cfg, decode_steps=decode_steps, block_size=block_size, dtype=dtype
        )
        row = {
            "method": method,
            "budget": None if cfg is None else budget,
            "requests": requests,
            "prompt_len": prompt_len,
            "profile": t.pop("profile"),
            "kernels_asked": kernels,
            **t,
        }
        if base is None:
            base = t
        for key in ("prefill_step_ms", "decode_step_ms", "mixed_step_ms"):
            if t.get(key) and base.get(key):
                row[key.replace("_ms", "_vs_plain")] = round(t[key] / base[key], 3)
        row["load_avg_1m"] = [before, load_avg()]
        rows.append(row)
    return rows
