"""``slake bench``: prefill time, time to first token, decode latency, peak memory and KV bytes per method and
context length, measured by the engine ``--engine`` names.

``slake bench --methods full,snapkv,cake,slake --budget 128 --lengths 1024,2048,4096,8192 --out runs/bench`` writes
``runs/bench/bench.jsonl`` (one row per configuration, appended), ``bench.md`` (table of this run) and
``decode_latency.png`` / ``peak_memory.png`` (:mod:`slake.engines.transformers.bench`). ``--random-model llama3-8b``
measures a randomly initialised model of that shape (:mod:`slake.hf.shapes`) instead of a checkpoint. ``--engine
vllm`` measures vLLM with the plugin: per length, ``--batch`` requests of random tokens submitted at once, each
generating ``--warmup`` + ``--decode-steps`` tokens; throughput, decode time per step and KV blocks held
(``bench_vllm.jsonl``, ``bench_vllm.md``; :mod:`slake.engines.vllm.bench`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slake.cli.options import add_engine_arg, engine_from_args, split_list

__all__ = ["add_bench_parser", "bench_plan", "cmd_bench"]


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``subparsers``."""
    p = subparsers.add_parser(
        "bench",
        help="latency and peak memory vs context length per method",
        description="Per method and context length: prefill time, time to first token, decode "
        "ms/token (median, min, max over --decode-steps steps after warm-up), peak memory "
        "(CPU: process RSS high-water mark, reset per configuration; CUDA: "
        "max_memory_allocated) and KV bytes. Prompts are random token ids.",
    )
    p.add_argument(
        "--methods",
        default="full,snapkv,cake,slake",
        help="comma-separated methods; variants as name[key=value,...], e.g. slake[vabs=false]",
    )
    p.add_argument(
        "--budget",
        default="128",
        help="budget (or comma-separated budgets) in tokens per layer and KV head, or ratios in (0, 1)",
    )
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated context lengths")
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="comma-separated storage of kept keys/values: auto (model "
        "dtype), int8, fp8_e4m3 (8-bit with per-token scales); e.g. auto,int8",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size (identical-length random prompts)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (after --warmup steps)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps before timing")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="chunked prefill with chunks of this many tokens (bounded prefill memory)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", default=None, help="'smollm2' (default), 'gemma3-270m', a hub id, a local directory or a .gguf file"
    )
    src.add_argument(
        "--random-model",
        default=None,
        metavar="SHAPE",
        help="randomly initialised model of a named shape (llama3-8b, llama2-7b, mistral-7b, "
        "qwen2.5-7b, smollm2-135m, tiny), optionally with overrides: llama3-8b:num_hidden_layers=4",
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (auto-detected)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (fp32 on CPU, bf16 on CUDA by default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and random weights")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also measure every configuration with compiled decoding (one torch.compile graph per step, "
        "fixed shapes; CUDA graphs on CUDA), paired with its eager run: decode_vs_eager and "
        "compile_s in bench.jsonl (docs/compile.md)",
    )
    p.add_argument("--isolate", action="store_true", help="run every configuration in a fresh process")
    p.add_argument(
        "--decode-timing",
        choices=["auto", "interleaved", "sequential"],
        default="auto",
        help="interleaved: after measuring the configurations of one context length, open them again "
        "together and time their decode steps in turn, so that machine drift cannot bias a "
        "comparison (needs all their caches in memory at once; one more prefill each); "
        "sequential: time each configuration during its own run; auto (default): interleaved on "
        "CPU, sequential on CUDA and with --isolate",
    )
    add_engine_arg(p, "measure")
    p.add_argument("--out", required=True, help="output directory (bench.jsonl, bench.md, PNG plots)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} to stdout')
    return p


def bench_plan(args: argparse.Namespace) -> Any:
    """The :class:`slake.engines.base.BenchPlan` of a parsed ``slake bench`` command line (validated)."""
    from slake.budgets.budget import Budget
    from slake.cache.quant import parse_kv_dtype
    from slake.engines.base import BenchPlan
    from slake.methods.base import parse_method_list

    methods = parse_method_list(args.methods)
    kv_dtypes = tuple(parse_kv_dtype(k) for k in split_list(getattr(args, "kv_dtype", None) or "auto", "--kv-dtype"))
    budgets = tuple(Budget(b) for b in split_list(args.budget, "--budget"))
    lengths = tuple(int(x) for x in split_list(args.lengths, "--lengths"))
    if any(n < 2 for n in lengths):
        raise ValueError("--lengths must be >= 2")
    if args.batch < 1 or args.decode_steps < 1 or args.warmup < 0:
        raise ValueError("--batch and --decode-steps must be >= 1 and --warmup >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be >= 1")
    return BenchPlan(
        methods=tuple(methods),
        budgets=budgets,
        lengths=lengths,
        out=Path(args.out),
        batch=args.batch,
        decode_steps=args.decode_steps,
        warmup=args.warmup,
        seed=args.seed,
        prefill_chunk=args.prefill_chunk,
        kv_dtypes=kv_dtypes,
        isolate=args.isolate,
        decode_timing=getattr(args, "decode_timing", "auto"),
        threads=args.threads,
        plots=not args.no_plots,
        progress=not args.no_progress,
        compile=bool(getattr(args, "compile", False)),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark on the chosen engine; print the table (or ``{"rows": [...]}`` with ``--json``)."""
    from slake.methods.base import check_compileable, make_method

    engine = engine_from_args(args)
    plan = bench_plan(args)
    engine.check(
        random_model=args.random_model,
        isolate=plan.isolate,
        prefill_chunk=plan.prefill_chunk,
        decode_timing=plan.decode_timing,
        compile=plan.compile,
        kv_dtype=None if set(plan.kv_dtypes) <= {None} else ",".join(map(str, plan.kv_dtypes)),
    )
    for m in plan.methods:
        for b in plan.budgets:
            if m != "full":
                engine.check_pair(m, b.value)
            if plan.compile:
                check_compileable(make_method(m))
    report = engine.bench(plan)
    print(json.dumps({"rows": report.rows}) if args.json else report.table)
    return 0
