"""``slake bench``: prefill time, time to first token, decode latency, peak memory and KV bytes per method and
context length.

``slake bench --methods full,snapkv,cake,slake --budget 128 --lengths 1024,2048,4096,8192 --out runs/bench`` writes
``runs/bench/bench.jsonl`` (one row per configuration, appended), ``bench.md`` (table of this run) and
``decode_latency.png`` / ``peak_memory.png``. ``--random-model llama3-8b`` measures a randomly initialised model of
that shape (:mod:`slake.bench.shapes`) instead of a checkpoint. ``--isolate`` runs every configuration in a fresh
process (exact per-configuration peak memory, at the cost of reloading the model). On CPU the decode steps of the
configurations of one length are timed again in turn (``--decode-timing``, :func:`slake.bench.runner.
time_decode_interleaved`), so that comparisons between methods do not depend on when each one ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_bench_parser", "cmd_bench"]


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``subparsers``."""
    p = subparsers.add_parser("bench", help="latency and peak memory vs context length per method",
                              description="Per method and context length: prefill time, time to first token, decode "
                              "ms/token (median, min, max over --decode-steps steps after warm-up), peak memory "
                              "(CPU: process RSS high-water mark, reset per configuration; CUDA: "
                              "max_memory_allocated) and KV bytes. Prompts are random token ids.")
    p.add_argument("--methods", default="full,snapkv,cake,slake", help="comma-separated methods; variants as name[key=value,...], e.g. slake[vabs=false]")
    p.add_argument("--budget", default="128", help="budget (or comma-separated budgets) in tokens per layer and KV "
                   "head, or ratios in (0, 1)")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated context lengths")
    p.add_argument("--kv-dtype", default=None, help="comma-separated storage of kept keys/values: auto (model "
                   "dtype), int8, fp8_e4m3 (8-bit with per-token scales); e.g. auto,int8")
    p.add_argument("--batch", type=int, default=1, help="batch size (identical-length random prompts)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (after --warmup steps)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps before timing")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="chunked prefill with chunks of this many tokens (bounded prefill memory)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="'smollm2' (default), a hub id, a local directory or a .gguf file")
    src.add_argument("--random-model", default=None, metavar="SHAPE",
                     help="randomly initialised model of a named shape (llama3-8b, llama2-7b, mistral-7b, "
                          "qwen2.5-7b, smollm2-135m, tiny), optionally with overrides: llama3-8b:num_hidden_layers=4")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (auto-detected)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (fp32 on CPU, bf16 on CUDA by default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and random weights")
    p.add_argument("--isolate", action="store_true", help="run every configuration in a fresh process")
    p.add_argument("--decode-timing", choices=["auto", "interleaved", "sequential"], default="auto",
                   help="interleaved: after measuring the configurations of one context length, open them again "
                        "together and time their decode steps in turn, so that machine drift cannot bias a "
                        "comparison (needs all their caches in memory at once; one more prefill each); "
                        "sequential: time each configuration during its own run; auto (default): interleaved on "
                        "CPU, sequential on CUDA and with --isolate")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="measure transformers (default) or vLLM with the slake plugin (needs slake[vllm]): per "
                        "length, --batch requests of random tokens submitted at once, each generating --warmup + "
                        "--decode-steps tokens; throughput, decode time per step and KV blocks held "
                        "(OUT/bench_vllm.jsonl, bench_vllm.md)")
    p.add_argument("--out", required=True, help="output directory (bench.jsonl, bench.md, PNG plots)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} to stdout')
    return p


def _split(text: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return items


def _load(args: argparse.Namespace):
    import torch

    from ..models import _parse_dtype, default_device, load_model

    device = args.device or default_device()
    if args.random_model:
        from .shapes import random_model

        return random_model(args.random_model, device=device, dtype=_parse_dtype(args.dtype, device), seed=args.seed)
    model, _ = load_model(args.model or "smollm2", device=device, dtype=args.dtype, gguf_file=args.gguf_file)
    del torch
    return model


def _configs(args: argparse.Namespace) -> list:
    from ..budget_spec import Budget
    from ..methods.spec import parse_method_list
    from .runner import BenchConfig

    from ..cache.quant import parse_kv_dtype

    methods = parse_method_list(args.methods)
    kv_dtypes = [parse_kv_dtype(k) for k in _split(getattr(args, "kv_dtype", None) or "auto")]
    budgets = [Budget(b).value for b in _split(args.budget)]
    lengths = [int(x) for x in _split(args.lengths)]
    if any(n < 2 for n in lengths):
        raise ValueError("--lengths must be >= 2")
    if args.batch < 1 or args.decode_steps < 1 or args.warmup < 0:
        raise ValueError("--batch and --decode-steps must be >= 1 and --warmup >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be >= 1")
    out = []
    for n in lengths:
        for m in methods:
            for kvd in kv_dtypes:
                for b in (budgets[:1] if m == "full" else budgets):
                    out.append(BenchConfig(method=m, budget=b, length=n, batch=args.batch,
                                           decode_steps=args.decode_steps, warmup=args.warmup,
                                           prefill_chunk=args.prefill_chunk, seed=args.seed, kv_dtype=kvd))
    return out


def _isolated(args: argparse.Namespace, cfg) -> dict:
    argv = [sys.executable, "-m", "slake.cli", "bench", "--methods", cfg.method, "--budget", str(cfg.budget),
            "--lengths", str(cfg.length), "--batch", str(cfg.batch), "--decode-steps", str(cfg.decode_steps),
            "--warmup", str(cfg.warmup), "--seed", str(args.seed), "--no-plots", "--no-progress", "--json",
            "--kv-dtype", cfg.kv_dtype or "auto",
            "--out", str(Path(args.out) / "isolated")]
    for flag, value in (("--prefill-chunk", args.prefill_chunk), ("--model", args.model),
                        ("--random-model", args.random_model), ("--gguf-file", args.gguf_file),
                        ("--device", args.device), ("--dtype", args.dtype), ("--threads", args.threads)):
        if value is not None:
            argv += [flag, str(value)]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"isolated run of {cfg} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["rows"][0]


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    """``slake bench --engine vllm``: :func:`slake.vllm.bench.bench` per length and budget; OUT/bench_vllm.jsonl,
    OUT/bench_vllm.md. Options the vLLM engine cannot honour are refused before anything is loaded."""
    from ..budget_spec import Budget
    from ..methods.spec import parse_method_list
    from ..vllm.config import check_cli_options, resolve_plugin_method, vllm_dtype

    methods = [m for m in parse_method_list(args.methods) if m != "full"]  # plain vLLM is always measured
    budgets = [Budget(b) for b in _split(args.budget)]
    if any(b.is_ratio for b in budgets):
        raise ValueError("--engine vllm needs token budgets (e.g. 128), not ratios")
    lengths = [int(x) for x in _split(args.lengths)]
    if any(n < 2 for n in lengths) or args.batch < 1 or args.decode_steps < 1 or args.warmup < 0:
        raise ValueError("--lengths must be >= 2, --batch and --decode-steps >= 1 and --warmup >= 0")
    for m in methods:
        for b in budgets:
            resolve_plugin_method(m, b)  # raises for what the plugin cannot run
    check_cli_options([("--random-model", bool(args.random_model)), ("--isolate", args.isolate),
                       ("--prefill-chunk", args.prefill_chunk is not None),
                       ("--kv-dtype", (args.kv_dtype or "auto") != "auto"),
                       ("--decode-timing", getattr(args, "decode_timing", "auto") != "auto")], args.device)
    from ..vllm.bench import bench, markdown
    from ..vllm.engine import local_model_dir

    dtype = vllm_dtype(args.dtype)
    model_dir = local_model_dir(args.model, args.gguf_file, dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out / "bench_vllm.jsonl", "a", encoding="utf-8") as f:
        for n in lengths:
            for i, b in enumerate(budgets):
                print(f"slake bench (vllm): length {n}, budget {int(b.value)}", file=sys.stderr)
                for row in bench(model_dir, requests=args.batch, prompt_len=n,
                                 new_tokens=args.warmup + args.decode_steps, methods=methods, budget=int(b.value),
                                 dtype=dtype, seed=args.seed, include_plain=i == 0):
                    row.update({"engine": "vllm", "model": args.model or "smollm2", "load_avg_1m": _load_avg()})
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
    table = markdown(rows)
    (out / "bench_vllm.md").write_text("# slake bench --engine vllm\n\n" + table + "\n", encoding="utf-8")
    print(json.dumps({"rows": rows}) if args.json else table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; write OUT/bench.jsonl, OUT/bench.md and the plots (``--engine vllm``:
    :func:`cmd_bench_vllm`)."""
    if getattr(args, "engine", "transformers") == "vllm":
        return cmd_bench_vllm(args)
    import torch

    from .report import markdown_table, plot_rows
    from .runner import measure, time_decode_interleaved

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = _configs(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = None if args.isolate else _load(args)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs), desc="slake bench", unit="config", file=sys.stderr)
    model_name = args.random_model and f"random:{args.random_model}" or (args.model or "smollm2")
    env = {"model": model_name, "device": str(model.device) if model is not None else (args.device or "auto"),
           "dtype": str(model.dtype).replace("torch.", "") if model is not None else (args.dtype or "auto"),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "load_avg_1m": _load_avg()}
    interleave = _interleaved_timing(args, model)
    rows = []
    with open(out / "bench.jsonl", "a", encoding="utf-8") as f:
        for group in _length_groups(configs):
            group_rows = []
            for cfg in group:
                if bar is not None:
                    bar.set_postfix_str(f"{cfg.method} {cfg.length}")
                row = _isolated(args, cfg) if args.isolate else measure(model, cfg)
                row.update({k: v for k, v in env.items() if k not in row})
                row["load_avg_1m_after"] = _load_avg()
                group_rows.append(row)
                if not interleave:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                if bar is not None:
                    bar.update(1)
            if interleave and len(group) > 1:
                if bar is not None:
                    bar.set_postfix_str(f"interleaved decode timing, length {group[0].length}")
                _apply_interleaved(group_rows, time_decode_interleaved(model, group, args.decode_steps, args.warmup))
            if interleave:
                for row in group_rows:
                    f.write(json.dumps(row) + "\n")
                f.flush()
            rows += group_rows
    if bar is not None:
        bar.close()
    notes = [f"model {env['model']}, device {env['device']}, dtype {env['dtype']}, {env['threads']} torch threads, "
             f"torch {env['torch']}, load average at start {env['load_avg_1m']}",
             f"batch {args.batch}, {args.decode_steps} timed decode steps after {args.warmup} warm-up steps; "
             "prompts are random token ids",
             "decode ms/token: " + ("medians of steps timed in turn across the configurations of each length "
                                    "(interleaved; the medians of each configuration's own run are "
                                    "decode_ms_sequential in bench.jsonl); decode vs first: median over those "
                                    "rounds of the step-time ratio to the length's first configuration, the "
                                    "number to compare methods by" if interleave else
                                    "medians of each configuration's own run (sequential)"),
             "peak memory: " + ("CUDA max_memory_allocated (reset per configuration)" if rows and
                                rows[0]["peak_mem_kind"].startswith("cuda") else
                                "process RSS high-water mark (VmHWM, reset per configuration via "
                                "/proc/self/clear_refs; includes the model weights)")]
    (out / "bench.md").write_text(markdown_table(rows, "slake bench", notes), encoding="utf-8")
    if not args.no_plots and rows:
        plot_rows(rows, str(out))
    keys = ("method", "budget", "length", "batch", "prefill_s", "decode_ms_per_token", "peak_mem_bytes", "kv_bytes")
    if args.json:
        print(json.dumps({"rows": [{**{k: r[k] for k in keys}, **{k: v for k, v in r.items() if k not in keys}}
                                   for r in rows]}))
    else:
        print(markdown_table(rows))
    return 0


def _interleaved_timing(args: argparse.Namespace, model) -> bool:
    """Whether decode steps are timed interleaved (``--decode-timing``; auto: on CPU without ``--isolate``)."""
    mode = getattr(args, "decode_timing", "auto")
    if mode == "interleaved" and args.isolate:
        raise ValueError("--decode-timing interleaved needs the configurations in one process; drop --isolate")
    if mode == "auto":
        return not args.isolate and model is not None and model.device.type == "cpu"
    return mode == "interleaved"


def _length_groups(configs: list) -> list[list]:
    """Consecutive configurations of one context length (the order of :func:`_configs`)."""
    groups: list[list] = []
    for cfg in configs:
        if groups and groups[-1][0].length == cfg.length:
            groups[-1].append(cfg)
        else:
            groups.append([cfg])
    return groups


def _apply_interleaved(rows: list[dict], times: list[list[float]]) -> None:
    """Replace each row's decode statistics by its interleaved step times, keeping the sequential median, and add
    ``decode_vs_first``: the median over rounds of the step-time ratio to the length's first configuration.

    A round's steps run back to back, so a slowdown of the machine that lasts longer than a round cancels in its
    ratio; a shorter one makes that round's ratio an outlier up or down, which the median ignores. On a noisy
    machine this ratio is far steadier than the ratio of two medians."""
    ref = times[0]
    for row, t in zip(rows, times):
        row["decode_ms_sequential"] = row["decode_ms_per_token"]
        row.update({"decode_ms_per_token": statistics.median(t), "decode_ms_min": min(t), "decode_ms_max": max(t),
                    "decode_steps": len(t), "decode_timing": "interleaved",
                    "decode_vs_first": statistics.median(a / b for a, b in zip(t, ref)),
                    "decode_first": _label(rows[0])})


def _label(row: dict) -> str:
    """``method[@budget][ kv_dtype]`` of a result row (names the reference of ``decode_vs_first``)."""
    return f"{row['method']}@{row['budget']}" + (f" {row['kv_dtype']}" if row.get("kv_dtype") else "")


def _load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None
