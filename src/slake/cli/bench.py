"""``slake bench``: prefill time, time to first token, decode latency, peak memory and KV bytes per method and
context length, measured by the engine ``--engine`` names.

``slake bench --methods full,snapkv,cake,slake --budget 128 --lengths 1024,2048,4096,8192 --out runs/bench`` writes
``runs/bench/bench.jsonl`` (one row per configuration, appended), ``bench.md`` (table of this run) and
``decode_latency.png`` / ``peak_memory.png`` (:mod:`slake.engines.transformers.bench`). ``--random-model llama3-8b``
measures a randomly initialised model of that shape (:mod:`slake.engines.transformers.shapes`) instead of a checkpoint.
``--engine vllm`` measures vLLM with the plugin: per length, ``--batch`` requests of random tokens prefilled in
one step, each generating the prefill's token, ``--warmup`` untimed decode steps and ``--decode-steps`` timed ones;
throughput, decode time per step and KV blocks held
(``bench_vllm.jsonl``, ``bench_vllm.md``; :mod:`slake.engines.vllm.bench`).

``--serve`` is the load benchmark through the engine's OpenAI-compatible server (``--engine vllm``;
:mod:`slake.engines.vllm.serve`, ``docs/serving-load.md``): per configuration a server with ``--kv-memory`` GiB of
KV cache, per ``--concurrency`` level ``--requests`` streaming requests of random prompts (``--lengths LO-HI``)
generating ``--max-tokens`` tokens each; requests/s, output tokens/s, TTFT and TPOT percentiles, the most requests
running at once and the most KV blocks held (``bench_serve.jsonl``, ``bench_serve.md``, ``serve_throughput.png``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from slake.cli.options import add_engine_arg, check_out_folder, engine_from_args, refuse_duplicates, split_list

__all__ = [
    "add_bench_parser", "add_serve_args", "bench_lengths", "bench_methods", "bench_plan", "check_serve_options",
    "check_threads", "cmd_bench",
]  # fmt: skip


DEFAULT_LENGTHS = "1024,2048,4096,8192"
DEFAULT_SERVE_LENGTHS = "2048-6144"
DEFAULT_CONCURRENCY = "1,4,16"
DEFAULT_REQUESTS = 32
DEFAULT_MAX_TOKENS = 128
DEFAULT_KV_GIB = 1.0
#: options of the load benchmark only -> their flag
SERVE_ONLY = {
    "concurrency": "--concurrency",
    "requests": "--requests",
    "max_tokens": "--max-tokens",
    "kv_memory": "--kv-memory",
    "max_num_seqs": "--max-num-seqs",
}
#: options the load benchmark has no use for -> their flag (given with --serve: refused)
NOT_SERVE = {
    "batch": "--batch (use --concurrency)",
    "decode_steps": "--decode-steps (use --max-tokens)",
    "warmup": "--warmup",
    "kv_dtype": "--kv-dtype",
    "prefill_chunk": "--prefill-chunk",
    "threads": "--threads (the server's threads are vLLM's)",
    "random_model": "--random-model",
    "compile": "--compile",
    "isolate": "--isolate",
    "kernels": "--kernels",
    "profile_steps": "--profile-steps",
}


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
        help="comma-separated methods; variants as name[key=value,...], e.g. slake[vabs=false]; and the engine's own "
        "baselines (the transformers engine's 'transformers': its own DynamicCache, eager, the decode without slake)",
    )
    p.add_argument(
        "--budget",
        default="128",
        help="budget (or comma-separated budgets) in tokens per layer and KV head, or ratios in (0, 1)",
    )
    p.add_argument(
        "--lengths",
        default=None,
        help=f"comma-separated context lengths (default: {DEFAULT_LENGTHS}); with --serve the prompt lengths: one "
        f"length or a range LO-HI, each request's length drawn uniformly from it (default: {DEFAULT_SERVE_LENGTHS})",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="comma-separated storage of kept keys/values: auto (model "
        "dtype), int8, fp8_e4m3 (8-bit with per-token scales); e.g. auto,int8",
    )
    p.add_argument("--batch", type=int, default=None, help="batch size (identical-length random prompts; default 1)")
    p.add_argument(
        "--decode-steps", type=int, default=None, help="timed decode steps (after --warmup steps; default 32)"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed decode steps before timing (default: 3)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="chunked prefill with chunks of this many tokens (bounded prefill memory)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help="'smollm2' (default), 'gemma3-270m', 'qwen2.5-coder-0.5b', a hub id, a local directory or a .gguf file",
    )
    src.add_argument(
        "--random-model",
        default=None,
        metavar="SHAPE",
        help="randomly initialised model of a named shape (llama3-8b, llama2-7b, mistral-7b, "
        "qwen2.5-7b, smollm2-135m, tiny; hybrid: gemma3-4b, gemma3-270m, tiny-hybrid), optionally with "
        "overrides: llama3-8b:num_hidden_layers=4",
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (auto-detected)")
    p.add_argument(
        "--dtype",
        default=None,
        help="fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA, fp16 on GPUs before the A100)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and random weights")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also measure every configuration with compiled decoding (one torch.compile graph per step, "
        "fixed shapes; CUDA graphs on CUDA), paired with its eager run: decode_vs_eager (over interleaved "
        "rounds, or the ratio of the two medians where decode_timing is sequential) and compile_s in bench.jsonl "
        "(docs/compile.md)",
    )
    p.add_argument(
        "--kernels",
        choices=["auto", "torch", "triton"],
        default=None,
        help="the decode step's implementation (default: auto, Triton's fused kernels on NVIDIA GPUs, torch "
        "elsewhere); the rows record which ran",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        metavar="N",
        help="after its timed steps, run N more decode steps of every configuration under torch.profiler and "
        "report where they spend their time: per kernel (CUDA, CUDA-graph replays included) or operator (CPU), "
        "and by category (slake's fused step, matmuls, attention, the rest); the step_profile field of "
        "bench.jsonl and step_profile.md",
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
        "CPU, and on CUDA for a length whose configurations are eager and whose caches fit in the GPU's "
        "free memory together; sequential otherwise and with --isolate",
    )
    add_engine_arg(p, "measure")
    add_serve_args(p)
    p.add_argument("--out", required=True, help="output directory (bench.jsonl, bench.md, PNG plots)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} to stdout')
    return p


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add ``--serve`` and the load benchmark's options (they need ``--serve``) to the ``bench`` parser."""
    g = p.add_argument_group("load benchmark through the OpenAI-compatible server (--serve; --engine vllm)")
    g.add_argument(
        "--serve",
        action="store_true",
        help="start the engine's OpenAI-compatible server per configuration and measure it under load: "
        "requests/s, output tokens/s, TTFT and TPOT (p50, p99), most requests running, most KV blocks held",
    )
    g.add_argument(
        "--concurrency",
        default=None,
        help=f"comma-separated numbers of requests in flight, one level each (default: {DEFAULT_CONCURRENCY})",
    )
    g.add_argument(
        "--requests", type=int, default=None, help=f"requests per concurrency level (default: {DEFAULT_REQUESTS})"
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens each request generates, end-of-sequence ignored (default: {DEFAULT_MAX_TOKENS})",
    )
    g.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        help=f"KV cache memory of the server in GiB, the same for every configuration (default: {DEFAULT_KV_GIB})",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=None, help="requests the server runs at once (default: most --concurrency)"
    )


def bench_lengths(args: argparse.Namespace) -> tuple[int, ...]:
    """The lengths of ``--lengths``: context lengths (each >= 2), or with ``--serve`` the prompt range
    ``(low, high)`` of ``LO-HI`` or of one length (each >= 1)."""
    text = getattr(args, "lengths", None)
    if not getattr(args, "serve", False):
        out = []
        for n in split_list(DEFAULT_LENGTHS if text is None else text, "--lengths"):
            try:
                if int(n) < 2:
                    raise ValueError
            except ValueError:
                raise ValueError(f"--lengths: every length must be an integer >= 2, got {n!r}") from None
            out.append(int(n))
        refuse_duplicates("--lengths", out)
        return tuple(out)
    text = str(DEFAULT_SERVE_LENGTHS if text is None else text).strip()
    lo, sep, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(
            f"--lengths with --serve: one length or a range LO-HI such as 2048-6144, got {text!r}"
        ) from None
    if not 1 <= low <= high:
        raise ValueError(f"--lengths with --serve: need 1 <= LO <= HI, got {text!r}")
    return (low, high)


def check_serve_options(args: argparse.Namespace) -> None:
    """Refuse load-benchmark options without ``--serve`` and the options it has no use for with it (one line)."""
    serve = bool(getattr(args, "serve", False))
    if not serve:
        given = [flag for k, flag in SERVE_ONLY.items() if getattr(args, k, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} belong(s) to the load benchmark: add --serve")
        return
    refused = [flag for k, flag in NOT_SERVE.items() if getattr(args, k, None) not in (None, False)]
    if getattr(args, "decode_timing", "auto") != "auto":
        refused.append("--decode-timing")
    if refused:
        raise ValueError(f"--serve does not use {', '.join(refused)}")


def _serve_plan(args: argparse.Namespace, lengths: tuple[int, ...]) -> Any:
    from slake.engines.base import ServePlan

    given = DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency
    try:
        concurrency = tuple(int(x) for x in split_list(given, "--concurrency"))
    except ValueError:  # int('x') named no option
        raise ValueError(f"--concurrency: every level must be an integer >= 1, got {given!r}") from None
    requests = DEFAULT_REQUESTS if args.requests is None else args.requests
    max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    kv = DEFAULT_KV_GIB if args.kv_memory is None else args.kv_memory
    if min(concurrency) < 1:
        raise ValueError(f"--concurrency: every level must be >= 1, got {args.concurrency!r}")
    if requests < 1 or max_tokens < 1:
        raise ValueError("--requests and --max-tokens must be >= 1")
    if not (math.isfinite(kv) and kv > 0):  # inf passed `kv > 0` and went to vLLM's server as its memory
        raise ValueError(f"--kv-memory must be > 0 GiB and finite, got {kv}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be >= 1")
    return ServePlan(
        concurrency=concurrency,
        requests=requests,
        prompt_lens=(lengths[0], lengths[-1]),
        max_tokens=max_tokens,
        kv_memory_gib=kv,
        max_num_seqs=args.max_num_seqs,
    )


def check_threads(threads: int | None) -> None:
    """Refuse (ValueError naming ``--threads``) a thread count below 1 or above this machine's CPUs
    (``os.cpu_count()``): torch would start that many threads (100000 crashed the process), and more threads than
    CPUs time the contention between them, not the method."""
    import os

    if threads is None:
        return
    cpus = os.cpu_count() or 1
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if threads > cpus:
        raise ValueError(
            f"--threads {threads} is more than this machine's {cpus} CPUs (os.cpu_count()); use 1 to {cpus}"
        )


def bench_methods(text: str, baselines: tuple[str, ...] = ()) -> list[str]:
    """The methods of ``--methods``, validated as :func:`slake.methods.base.parse_method_list` does, but for the
    engine's own baselines (``baselines``: :attr:`slake.engines.base.Engine.bench_baselines`), taken as they are.
    A method given twice (the same canonical spec: ``slake[alpha=1]`` and ``slake[alpha=1.0]``) is refused."""
    from slake.methods.base import canonical_method_spec, parse_method_list
    from slake.methods.spec import split_method_list

    methods = split_method_list(text)
    others = [m for m in methods if m not in baselines]
    if len(others) == len(methods):
        methods = parse_method_list(text)
    elif others:  # the baselines alone (``--methods transformers``) need no method of slake's beside them
        parse_method_list(",".join(others))
    refuse_duplicates("--methods", methods, [m if m in baselines else canonical_method_spec(m) for m in methods])
    return methods


def bench_plan(args: argparse.Namespace, baselines: tuple[str, ...] = ()) -> Any:
    """The :class:`slake.engines.base.BenchPlan` of a parsed ``slake bench`` command line (validated; ``baselines``:
    the engine's rows besides slake's methods, :func:`bench_methods`)."""
    from slake.budgets.budget import Budget
    from slake.cache.quant import parse_kv_dtype
    from slake.engines.base import BenchPlan

    check_serve_options(args)
    if getattr(args, "random_model", None) is not None and getattr(args, "gguf_file", None) is not None:
        raise ValueError("--gguf-file names a file of --model; a --random-model has none (drop one of them)")
    check_threads(args.threads)
    check_out_folder(args.out)
    methods = bench_methods(args.methods, baselines)
    kv_dtype = getattr(args, "kv_dtype", None)
    kv_texts = split_list("auto" if kv_dtype is None else kv_dtype, "--kv-dtype")
    kv_dtypes = tuple(parse_kv_dtype(k) for k in kv_texts)
    refuse_duplicates("--kv-dtype", kv_texts, list(kv_dtypes))
    budget_texts = split_list(args.budget, "--budget")
    budgets = tuple(Budget(b) for b in budget_texts)
    refuse_duplicates("--budget", budget_texts, [b.value for b in budgets])
    lengths = bench_lengths(args)
    batch = 1 if args.batch is None else args.batch
    decode_steps = 32 if args.decode_steps is None else args.decode_steps
    warmup = 3 if args.warmup is None else args.warmup
    profile_steps = getattr(args, "profile_steps", None) or 0
    if batch < 1 or decode_steps < 1 or warmup < 0 or profile_steps < 0:
        raise ValueError("--batch and --decode-steps must be >= 1, --warmup and --profile-steps >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be >= 1")
    return BenchPlan(
        methods=tuple(methods),
        budgets=budgets,
        lengths=lengths,
        out=Path(args.out),
        batch=batch,
        decode_steps=decode_steps,
        warmup=warmup,
        seed=args.seed,
        prefill_chunk=args.prefill_chunk,
        kv_dtypes=kv_dtypes,
        isolate=args.isolate,
        decode_timing=getattr(args, "decode_timing", "auto"),
        threads=args.threads,
        plots=not args.no_plots,
        progress=not args.no_progress,
        compile=bool(getattr(args, "compile", False)),
        kernels=getattr(args, "kernels", None) or "auto",
        profile_steps=profile_steps,
        serve=_serve_plan(args, lengths) if getattr(args, "serve", False) else None,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark on the chosen engine; print the table (or ``{"rows": [...]}`` with ``--json``)."""
    from slake.methods.base import check_compileable, make_method

    engine = engine_from_args(args)
    plan = bench_plan(args, engine.bench_baselines)
    engine.check(
        random_model=args.random_model,
        isolate=plan.isolate,
        prefill_chunk=plan.prefill_chunk,
        decode_timing=plan.decode_timing,
        compile=plan.compile,
        kv_dtype=None if set(plan.kv_dtypes) <= {None} else ",".join(map(str, plan.kv_dtypes)),
        kernels=None if plan.kernels == "auto" else plan.kernels,
        profile_steps=plan.profile_steps or None,
        serve=plan.serve is not None,
        methods=plan.methods,
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
