"""The load sweep of ``slake bench --engine vllm --serve``: one server per configuration (plain vLLM and each
method x budget of the plugin, all with the same KV memory and flags), and through it one level per concurrency.

Per level: ``requests`` streaming completion requests (the same prompts for every configuration and level: random
token ids, lengths drawn uniformly from the plan's range, seeded), at most C in flight, each generating exactly
``max_tokens`` tokens; ``/metrics`` is sampled every ``metrics_interval_s`` meanwhile. Before the first level a
short request warms the server up. Rows are appended to ``OUT/bench_serve.jsonl`` as levels finish; this run's
table goes to ``OUT/bench_serve.md``, rewritten after every level and marked incomplete until the run ends (with
the error that stopped it, if one did), with notes on failed requests and scrapes (:func:`report.table_notes`); the
plot to ``OUT/serve_throughput.png``, each server's log to ``OUT/server-<engine>.log`` (its path is in the rows).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from slake.engines.base import BenchPlan, BenchReport, ServePlan, load_avg
from slake.engines.vllm.runner import model_limits
from slake.engines.vllm.serve import report
from slake.engines.vllm.serve.metrics import MetricsWatch, kv_pool_blocks, parse_prometheus, server_state
from slake.engines.vllm.serve.server import ServerConfig, VllmServer, has_tokenizer
from slake.optional_plots import draw_if_possible

__all__ = ["prompt_set", "run_level_watched", "run_serve_bench"]

#: ``(method, budget) -> the plugin's additional_config["slake"]`` (None for plain vLLM)
PluginConfig = Callable[[str, int], "dict | None"]
#: the warm-up request: the first prompt cut to this many tokens (longer than the budgets people measure, so that
#: the plugin's compression runs in it too), generating this many tokens
WARMUP_PROMPT, WARMUP_TOKENS = 1024, 4


def prompt_set(n: int, lens: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids in [10, min(vocab, 1000)) (ids every tokenizer of interest has, as the
    offline vLLM benchmark uses), lengths uniform in ``lens`` (inclusive); the same for the same arguments."""
    rng = random.Random(seed)
    hi = min(vocab, 1000)
    out = []
    for _ in range(n):
        k = rng.randint(lens[0], lens[1])
        out.append([rng.randrange(10, hi) for _ in range(k)])
    return out


async def _watch_metrics(
    server: VllmServer,
    watch: MetricsWatch,
    stop: asyncio.Event,
    interval: float,
    started: asyncio.Event | None = None,
) -> None:
    """Sample ``/metrics`` into ``watch`` until ``stop`` is set, then once more (the counters' final values).
    ``started`` is set once the first scrape has ended: the level's requests must wait for it, or the counters'
    baseline may already include some of their tokens."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as http:
        while True:
            last = stop.is_set()
            try:
                r = await http.get(server.url + "/metrics")
                r.raise_for_status()
                watch.add(server_state(parse_prometheus(r.text)))
            except Exception as e:  # noqa: BLE001 - a failed scrape is counted, the level goes on
                watch.miss(f"{type(e).__name__}: {e}")
            if started is not None:
                started.set()
            if last:
                return
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


async def run_level_watched(
    server: VllmServer,
    client: Any,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    concurrency: int,
    max_tokens: int,
    pool_blocks: int | None,
    metrics_interval_s: float = 0.25,
    on_done: Callable[[report.RequestResult], None] | None = None,
) -> dict:
    """One level through ``server`` with ``/metrics`` watched: the client's columns
    (:func:`report.level_stats`) and the server's (:meth:`MetricsWatch.summary`)."""
    from slake.engines.vllm.serve.client import run_level

    watch, stop, started = MetricsWatch(pool_blocks=pool_blocks), asyncio.Event(), asyncio.Event()
    sampler = asyncio.create_task(_watch_metrics(server, watch, stop, metrics_interval_s, started))
    try:
        # the counters' baseline before the first request (or the sampler's end, should it fail before scraping)
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({waiter, sampler}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()  # still pending when the sampler ended first
        level = await run_level(client, model, prompts, concurrency=concurrency, max_tokens=max_tokens, on_done=on_done)
    finally:
        stop.set()
        await sampler
    return {**report.level_stats(level.results, level.duration_s), **watch.summary()}


def _configs(plan: BenchPlan, plugin_config: PluginConfig) -> list[tuple[str, int | None, dict | None]]:
    out: list[tuple[str, int | None, dict | None]] = []
    if "full" in plan.methods:
        out.append(("full", None, None))
    for m in plan.methods:
        if m == "full":
            continue
        for b in plan.budgets:
            out.append((m, int(b.value), plugin_config(m, int(b.value))))
    return out


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-").lower()


def _server_settings(sp: ServePlan, model_dir: str, block_size: int) -> dict:
    vocab, max_pos = model_limits(model_dir)
    need = sp.prompt_lens[1] + sp.max_tokens
    if max_pos is not None and need > int(max_pos):
        raise ValueError(
            f"prompts of up to {sp.prompt_lens[1]} tokens plus --max-tokens {sp.max_tokens} exceed the model's "
            f"context of {max_pos} tokens"
        )
    max_model_len = -(-need // block_size) * block_size
    if max_pos is not None:
        max_model_len = min(max_model_len, int(max_pos))
    return {
        "vocab": vocab,
        "max_model_len": max_model_len,
        "max_num_seqs": sp.max_num_seqs or max(sp.concurrency),
    }


async def _sweep(
    server: VllmServer, plan: BenchPlan, sp: ServePlan, prompts: list[list[int]], label: str, emit: Callable
) -> None:
    from slake.engines.vllm.serve.client import make_client, stream_completion

    model = server.model_id()
    pool = kv_pool_blocks(parse_prometheus(server.get("/metrics")[1]))
    client = make_client(server.url)
    try:
        warm = await stream_completion(client, model, prompts[0][:WARMUP_PROMPT], WARMUP_TOKENS)
        if not warm.ok:
            raise RuntimeError(f"{label}: the warm-up request failed ({warm.error}); log: {server.cfg.log_path}")
        for c in sp.concurrency:
            bar = None
            if plan.progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(prompts), desc=f"{label} C={c}", unit="req", file=sys.stderr)
            failed = 0

            def done(r: report.RequestResult, bar: Any = bar) -> None:
                nonlocal failed
                failed += not r.ok
                if bar is not None:
                    bar.update(1)
                    if failed:
                        bar.set_postfix_str(f"failed {failed}")

            try:
                stats = await run_level_watched(
                    server,
                    client,
                    model,
                    prompts,
                    concurrency=c,
                    max_tokens=sp.max_tokens,
                    pool_blocks=pool,
                    on_done=done,
                )
            finally:
                if bar is not None:
                    bar.close()
            if not server.alive():
                raise RuntimeError(
                    f"{label}: vLLM's server died at concurrency {c}; its log ends:\n{server.log_tail()}"
                )
            emit(c, stats, server.rss_bytes(), server.pss_bytes())
    finally:
        await client.close()


def _emit(f: Any, rows: list[dict], fixed: dict, c: int, stats: dict, rss: int, pss: int | None) -> None:
    """Append one level's row to ``rows`` and the JSONL file ``f``; one line on stderr. ``rss``: the summed RSS of the
    server's processes (shared pages counted in each); ``pss``: their PSS (shared pages counted once), None where the
    kernel does not give it."""
    row = {
        **fixed,
        "concurrency": c,
        **stats,
        "server_rss_mib": round(rss / 2**20, 1),
        "server_pss_mib": None if pss is None else round(pss / 2**20, 1),
        "load_avg_1m": load_avg(),
    }
    rows.append(row)
    f.write(json.dumps(row) + "\n")
    f.flush()
    print(
        f"slake bench (vllm serve): {row['label']} C={c}: {row['output_tok_s']} output tok/s, "
        f"{row['completed']}/{row['requests']} completed, max running {row['max_running']}, "
        f"max KV blocks held {row['max_kv_blocks']}",
        file=sys.stderr,
    )


def run_serve_bench(
    plan: BenchPlan,
    model_dir: str,
    dtype: str,
    model_name: str,
    plugin_config: PluginConfig,
    *,
    block_size: int = 32,
) -> BenchReport:
    """Run the sweep (module docstring) for every configuration of ``plan`` (``plan.serve`` set);
    ``plugin_config(method, budget)`` gives the plugin's configuration of a pair as ``vllm serve`` users write it
    (the server's plugin applies the model's profile; each row's ``plugin_log`` holds what the plugin logged at
    start-up: the method it runs and the profile entry it applied)."""
    from slake.engines.vllm.bench import new_run_id
    from slake.engines.vllm.runner import dtype_itemsize

    sp = plan.serve
    if sp is None:
        raise ValueError("run_serve_bench needs a plan with serve settings (--serve)")
    dtype_itemsize(dtype)  # a dtype vLLM's CPU backend does not run: refused before any server starts
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        **_server_settings(sp, model_dir, block_size),
        "block_size": block_size,
        "model_dir": model_dir,
        "dtype": dtype,
        "model_name": model_name,
        "skip_tokenizer_init": not has_tokenizer(model_dir),
        "run_id": new_run_id(),  # the rows of this run, among those of earlier runs appended to the JSONL file
    }
    prompts = prompt_set(sp.requests, sp.prompt_lens, settings["vocab"], plan.seed)
    rows: list[dict] = []
    configs = _configs(plan, plugin_config)
    lo, hi = sp.prompt_lens
    header = (
        "# slake bench --engine vllm --serve\n\n"
        f"Model {model_name} ({dtype}), KV memory {sp.kv_memory_gib} GiB, block size {block_size}, prompts of "
        f"{lo}-{hi} random tokens, {sp.max_tokens} output tokens each (ignore_eos), {sp.requests} requests per "
        f"concurrency level, max_num_seqs {settings['max_num_seqs']}; run {settings['run_id']} (run_id in "
        f"{report.JSONL}).\n\n"
    )
    levels = len(configs) * len(sp.concurrency)

    def write_table(status: str | None) -> str:
        # this run's rows so far, rewritten after every level: a run that stops leaves its own finished levels
        # marked as such, never an earlier run's table or a table that looks complete
        table = report.markdown_table(rows) + report.table_notes(rows)
        (out / report.TABLE).write_text(header + (f"**{status}**\n\n" if status else "") + table, encoding="utf-8")
        return table

    write_table(f"Incomplete: the run is going on or stopped (0 of {levels} levels finished).")
    try:
        _run_configs(plan, configs, prompts, settings, rows, write_table)
    except BaseException as e:
        write_table(
            f"Incomplete: the run stopped before its end ({len(rows)} of {levels} levels finished): "
            + type(e).__name__
            + (f": {str(e).splitlines()[0]}" if str(e).strip() else "")
        )
        raise
    table = write_table(None)
    files = [out / report.JSONL, out / report.TABLE]
    if plan.plots and rows:
        plot = draw_if_possible("slake bench", lambda: report.plot_throughput(rows, out / report.PLOT))
        if plot is not None:  # None: matplotlib, an optional dependency, is missing
            files.append(plot)
    return BenchReport(rows=rows, table=table, files=files)


def _run_configs(
    plan: BenchPlan,
    configs: list[tuple[str, int | None, dict | None]],
    prompts: list[list[int]],
    settings: dict,
    rows: list[dict],
    write_table: Callable[[str | None], str],
) -> None:
    """One server per configuration (``settings``: the servers' and the rows' common settings, see
    :func:`run_serve_bench`) and through it its levels; every finished level's row is appended to ``rows`` and
    the JSONL file, and the table rewritten (``write_table``)."""
    sp = plan.serve
    assert sp is not None
    out, block_size = plan.out, int(settings["block_size"])
    model_dir, dtype, model_name = settings["model_dir"], settings["dtype"], settings["model_name"]
    levels = len(configs) * len(sp.concurrency)
    with open(out / report.JSONL, "a", encoding="utf-8") as f:
        for method, budget, slake_cfg in configs:
            label = report.engine_label(method, budget)
            log = out / f"server-{_slug(label)}.log"
            cfg = ServerConfig(
                model_dir=model_dir,
                log_path=log,
                slake=slake_cfg,
                kv_memory_bytes=int(sp.kv_memory_gib * 2**30),
                max_model_len=settings["max_model_len"],
                max_num_seqs=settings["max_num_seqs"],
                dtype=dtype,
                block_size=block_size,
                skip_tokenizer_init=settings["skip_tokenizer_init"],
            )
            print(f"slake bench (vllm serve): {label}: starting the server (log: {log})", file=sys.stderr)
            fixed = {
                "engine": "vllm",
                "bench": "serve",
                "model": model_name,
                "label": label,
                "method": method,
                "budget": budget,
                "max_tokens": sp.max_tokens,
                "prompt_lens": list(sp.prompt_lens),
                "kv_memory_gib": sp.kv_memory_gib,
                "max_num_seqs": settings["max_num_seqs"],
                "max_model_len": settings["max_model_len"],
                "block_size": block_size,
                "dtype": dtype,
                "slake_config": slake_cfg,
                "server_log": str(log),
                "seed": plan.seed,
                "run_id": settings["run_id"],
            }
            with VllmServer(cfg) as server:
                fixed["plugin_log"] = server.plugin_lines()

                def emit(c: int, stats: dict, rss: int, pss: int | None, fixed: dict = fixed) -> None:
                    _emit(f, rows, fixed, c, stats, rss, pss)
                    write_table(
                        f"Incomplete: the run is going on or stopped ({len(rows)} of {levels} levels finished)."
                    )

                asyncio.run(_sweep(server, plan, sp, prompts, label, emit))
