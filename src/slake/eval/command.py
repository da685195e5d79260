"""``slake eval`` and ``slake make-prompt``.

``slake eval --suite ruler --tasks niah_single_1 --methods snapkv,h2o --budgets 128,256 --lengths 2048 --samples 5
--out runs/ruler`` runs the suite (full-cache reference included), appends rows to ``runs/ruler/results.jsonl``
(resumable), then writes ``summary.md``, ``summary.csv`` and the plots there.

``slake make-prompt --task needle --length 2048 --seed 1 --out runs/demo_document.txt`` writes the plain prompt
(context + question, no chat template) of one generated sample and prints its expected answers to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from ..cli_args import add_model_args as _add_model_args

__all__ = ["add_eval_parser", "cmd_eval", "add_make_prompt_parser", "cmd_make_prompt", "load_tokenizer"]

Loader = Callable[[argparse.Namespace], tuple[Any, Any]]


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to ``subparsers`` (from ``parser.add_subparsers``)."""
    p = subparsers.add_parser("eval", help="evaluate methods x budgets on needle, RULER or LongBench",
                              description="Prefill each sample once, replay it into every (method, budget) cache, "
                              "decode greedily and score. Rows go to OUT/results.jsonl (a rerun resumes); "
                              "summary.md, summary.csv and PNG plots are written to OUT.")
    p.add_argument("--suite", required=True, choices=("needle", "ruler", "longbench"))
    p.add_argument("--tasks", default=None,
                   help="comma-separated tasks: RULER task names, LongBench datasets (default: every task; for "
                        "LongBench every dataset file found)")
    p.add_argument("--methods", required=True,
                   help="comma-separated methods (see 'slake methods') or 'all'; a variant is written "
                        "name[key=value,...], e.g. slake[vabs=false] or snapkv[linear_cache=true], and gets its own "
                        "rows; the full-cache reference is always included")
    p.add_argument("--budgets", required=True,
                   help="comma-separated budgets: tokens per layer and KV head (e.g. 128,256) or ratios in (0, 1)")
    p.add_argument("--lengths", default=None,
                   help="comma-separated context lengths in tokens (default: needle 1024,2048,4096; ruler 2048; "
                        "longbench 4096, the middle-truncation maximum)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per (task, length), per (length, depth) cell for needle, first N records for "
                        "LongBench (default: needle 1, ruler 5, longbench all)")
    p.add_argument("--depths", default=None, help="needle depths in percent (default 0,25,50,75,100)")
    p.add_argument("--seed", type=int, default=0, help="sample seed")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on every task's generation length")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="measure chunked prefill (chunks of this many tokens) instead of exact prefill; "
                        "use a separate --out directory")
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode up to this many samples of a task together (each is still prefilled alone); "
                        "about 5x faster per sample at 8 on CPU, same greedy outputs up to float rounding")
    p.add_argument("--question-agnostic", action="store_true",
                   help="compress the context without the question, then ask (default: question in the prefill)")
    p.add_argument("--no-chat-template", action="store_true", help="plain prompts, no chat template")
    p.add_argument("--longbench-dir", default=None, help="directory with the official LongBench <dataset>.jsonl")
    p.add_argument("--longbench-hub", action="store_true",
                   help="read LongBench datasets missing from --longbench-dir from the data.zip of THUDM/LongBench "
                        "on the Hugging Face hub (downloaded once into its cache; needs network)")
    p.add_argument("--kv-dtype", default=None, help="store kept keys/values in 8 bits: int8 or fp8_e4m3 (per-token "
                   "scales); default: the model's dtype. Use a separate --out per value")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="generate with transformers (default) or vLLM with the slake plugin (needs slake[vllm]; "
                        "every sample of a method and budget runs as one vLLM batch; use its own --out)")
    p.add_argument("--out", required=True, help="output directory (results.jsonl, summary.md/csv, plots)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} (mean score per task) to stdout')
    _add_model_args(p)
    return p


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    return items or None


def _default_loader(args: argparse.Namespace) -> tuple[Any, Any]:
    from ..models import load_model

    return load_model(args.model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file)


def cmd_eval(args: argparse.Namespace, loader: Loader | None = None) -> int:
    """Run ``slake eval``; every argument is validated before the model loads.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments of :func:`add_eval_parser`.
    loader : callable, optional
        ``loader(args) -> (model, tokenizer)``; :func:`slake.load_model` by default (tests pass a tiny model).

    Returns
    -------
    int
        0 on success. Invalid arguments raise ValueError (the ``slake`` entry point prints them, exit code 2).
    """
    from .results import read_results, row_key, scan_results
    from .runner import check_pairs, parse_budgets, resolve_methods, run_suite
    from .suites import build_samples, parse_floats, parse_ints, plan_suite
    from .summary import summary_rows, write_summary

    methods = resolve_methods(args.methods)
    budgets = parse_budgets(args.budgets) if methods else []
    check_pairs(methods, budgets)
    lengths = parse_ints(args.lengths, "--lengths") if args.lengths else None
    depths = parse_floats(args.depths, "--depths", 0.0, 100.0) if args.depths else None
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prefill_chunk is not None and (args.prefill_chunk < 1 or args.question_agnostic):
        raise ValueError("--prefill-chunk must be >= 1 and cannot be combined with --question-agnostic")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    from ..cache.quant import parse_kv_dtype

    kv_dtype = parse_kv_dtype(getattr(args, "kv_dtype", None))
    if args.batch_size > 1 and (args.prefill_chunk is not None or args.question_agnostic):
        raise ValueError("--batch-size > 1 cannot be combined with --prefill-chunk or --question-agnostic")
    plan = plan_suite(args.suite, _split(args.tasks), lengths, args.samples, args.seed, depths, args.longbench_dir,
                      args.longbench_hub)
    engine = getattr(args, "engine", "transformers")
    if engine == "vllm":
        _check_vllm_args(args, kv_dtype)
    out = Path(args.out)
    previous = scan_results(out)
    if previous.skipped:
        print(f"slake eval: {previous.describe_skipped()}", file=sys.stderr)
    if engine == "vllm":
        from ..vllm.eval import run_suite_vllm

        tokenizer = load_tokenizer(args.model, args.gguf_file)
        samples = build_samples(plan, tokenizer)
        run_suite_vllm(tokenizer, samples, methods, budgets, out, model=args.model, gguf_file=args.gguf_file,
                       dtype=args.dtype, suite=plan.suite, model_name=args.model, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, chat_template=not args.no_chat_template,
                       progress=not args.no_progress)
    else:
        model, tokenizer = (loader or _default_loader)(args)
        samples = build_samples(plan, tokenizer)
        run_suite(model, tokenizer, samples, methods, budgets, out, suite=plan.suite, model_name=args.model,
                  seed=args.seed, query_aware=not args.question_agnostic, max_new_tokens=args.max_new_tokens,
                  prefill_chunk=args.prefill_chunk, batch_size=args.batch_size,
                  chat_template=not args.no_chat_template, progress=not args.no_progress, kv_dtype=kv_dtype)
    all_rows = read_results(out)
    md, csv_path = write_summary(out, all_rows)
    plots = _plots(out, all_rows, args.no_plots)
    wanted = {(s.task, s.sample_id, m, b, int(s.metadata.get("target_length", s.length)), args.model,
               None if b is None else args.prefill_chunk)
              for s in samples for m, b in [("full", None)] + [(m, b) for m in methods for b in budgets]}
    mine = [r for r in all_rows if r.get("suite") == plan.suite and row_key(r) in wanted
            and r.get("query_aware", True) == (not args.question_agnostic)]
    if args.json:
        print(json.dumps({"rows": summary_rows(mine)}))
        return 0
    print(md.read_text(encoding="utf-8"))
    print(f"rows: {out / 'results.jsonl'}  summary: {md}, {csv_path}", file=sys.stderr)
    for p in plots:
        print(f"plot: {p}", file=sys.stderr)
    return 0


def _check_vllm_args(args: argparse.Namespace, kv_dtype: str | None) -> None:
    """Refuse the ``slake eval`` options that ``--engine vllm`` cannot honour (before anything is loaded)."""
    from ..vllm.config import check_cli_options

    check_cli_options([("--prefill-chunk", args.prefill_chunk is not None),
                       ("--question-agnostic", args.question_agnostic), ("--kv-dtype", kv_dtype is not None)],
                      args.device)


def _plots(out: Path, rows: list[dict[str, Any]], skip: bool) -> list[Path]:
    if skip:
        return []
    try:
        from .plots import write_plots

        return write_plots(out, rows)
    except ImportError as e:  # matplotlib is an optional dependency (slake[eval])
        print(f"slake eval: no plots ({e}); install matplotlib: pip install 'slake[eval]'", file=sys.stderr)
        return []


def add_make_prompt_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``make-prompt`` sub-command to ``subparsers``."""
    p = subparsers.add_parser("make-prompt", help="write the plain prompt of one generated needle/RULER sample",
                              description="Write context + question (no chat template) of one generated sample to "
                              "a file; the expected answers go to stderr.")
    p.add_argument("--task", required=True, help="'needle' or a RULER task (e.g. niah_single_2, vt, qa_1)")
    p.add_argument("--length", type=int, required=True, help="prompt length in the model's tokens")
    p.add_argument("--depth", type=float, default=None,
                   help="needle depth in percent (needle: default 50; RULER NIAH tasks: random by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2", help="model whose tokenizer measures the length")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--out", required=True, help="output text file ('-' for standard output)")
    return p


def load_tokenizer(name: str, gguf_file: str | None = None) -> Any:
    """The tokenizer of a model (no weights loaded): ``smollm2``, a hub id, a directory or a .gguf file."""
    import os

    from transformers import AutoTokenizer

    from ..models import DEFAULT_MODEL, resolve_model

    path, gguf = resolve_model(name, gguf_file)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    if name is None or name.lower() == DEFAULT_MODEL or os.path.isdir(path):
        kwargs["local_files_only"] = True
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as e:
        raise OSError(f"could not load the tokenizer of {name!r} ({path}): {e}") from e


def cmd_make_prompt(args: argparse.Namespace, tokenizer: Any = None) -> int:
    """Run ``slake make-prompt``; ``tokenizer`` overrides loading ``args.model``'s tokenizer (tests)."""
    from .ruler import RULER_TASKS

    if args.task != "needle" and args.task not in RULER_TASKS:
        raise ValueError(f"unknown task {args.task!r}; expected 'needle' or one of {', '.join(RULER_TASKS)}")
    if args.length < 1:
        raise ValueError(f"--length must be >= 1, got {args.length}")
    if args.depth is not None and not 0.0 <= args.depth <= 100.0:
        raise ValueError(f"--depth must lie in [0, 100], got {args.depth}")
    tok = tokenizer if tokenizer is not None else load_tokenizer(args.model, args.gguf_file)
    if args.task == "needle":
        from .needle import needle_sample

        sample = needle_sample(tok, args.length, 50.0 if args.depth is None else args.depth, seed=args.seed)
    else:
        from .ruler import ruler_sample

        sample = ruler_sample(args.task, tok, args.length, seed=args.seed, depth=args.depth)
    text = sample.context + sample.question
    if args.out == "-":
        sys.stdout.write(text + "\n")
    else:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({sample.length} tokens, task {sample.task}, sample {sample.sample_id})",
              file=sys.stderr)
    print(f"expected answer: {' | '.join(sample.answers)}", file=sys.stderr)
    return 0
