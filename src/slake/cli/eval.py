"""``slake eval``: an evaluation suite on any engine (:func:`slake.eval.runner.evaluate_suite`).

``slake eval --suite ruler --tasks niah_single_1 --methods snapkv,h2o --budgets 128,256 --lengths 2048 --samples 5
--out runs/ruler`` runs the suite (full-cache reference included), appends rows to ``runs/ruler/results.jsonl``
(resumable), then writes ``summary.md``, ``summary.csv`` and the plots there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slake.cli.options import add_engine_arg, add_model_args, check_out_folder, engine_from_args, split_list
from slake.optional_plots import draw_if_possible

if TYPE_CHECKING:
    from slake.engines.base import Engine
    from slake.eval.protocol import Protocol

__all__ = ["add_eval_parser", "cmd_eval"]


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to ``subparsers`` (from ``parser.add_subparsers``)."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate methods x budgets on needle, RULER or LongBench",
        description="Generate every (method, budget) for each sample, greedily, and score "
        "(the transformers engine prefills each sample once and replays it into every cache). Rows go to "
        "OUT/results.jsonl (a rerun resumes); summary.md, summary.csv and PNG plots are written to OUT.",
    )
    p.add_argument(
        "--protocol",
        default=None,
        choices=("kvpress",),
        help="a leaderboard's protocol in one flag: 'kvpress' is NVIDIA kvpress's (RULER at 4096 tokens, "
        "question-agnostic compression, compression ratios 0.25/0.5/0.75/0.875 removed, i.e. budgets "
        "0.75/0.5/0.25/0.125 kept, scored as kvpress scores it); sets --suite, --lengths, --budgets and "
        "--question-agnostic, writes the token ids for kvpress's side (tools/kvpress_protocol/ in slake's "
        "repository) and merges its outputs found in --out; see docs/kvpress-protocol.md",
    )
    p.add_argument(
        "--suite", default=None, choices=("needle", "ruler", "longbench"), help="required without --protocol"
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="comma-separated tasks: RULER task names, LongBench datasets (default: every task; for "
        "LongBench every dataset file found)",
    )
    p.add_argument(
        "--methods",
        required=True,
        help="comma-separated methods (see 'slake methods') or 'all'; a variant is written "
        "name[key=value,...], e.g. slake[vabs=false] or snapkv[linear_cache=true], and gets its own "
        "rows; the full-cache reference is always included",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="comma-separated budgets: tokens per layer and KV head (e.g. 128,256) or ratios in (0, 1) of the "
        "prompt kept; required without --protocol, unless --methods is full alone",
    )
    p.add_argument(
        "--lengths",
        default=None,
        help="comma-separated context lengths in tokens (default: needle 1024,2048,4096; ruler 2048; "
        "longbench 4096, the middle-truncation maximum)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per (task, length), per (length, depth) cell for needle, first N records for "
        "LongBench (default: needle 1, ruler 5, longbench all)",
    )
    p.add_argument(
        "--depths", default=None, help="needle depths in percent (default: 0,25,50,75,100; --suite needle only)"
    )
    p.add_argument("--seed", type=int, default=0, help="sample seed")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on every task's generation length")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="measure chunked prefill (chunks of this many tokens) instead of exact prefill; "
        "use a separate --out directory",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="decode up to this many samples of a task together (each is still prefilled alone); "
        "about 5x faster per sample at 8 on CPU, same greedy outputs up to float rounding",
    )
    p.add_argument(
        "--question-agnostic",
        action="store_true",
        help="compress the context without the question, then ask (default: question in the prefill)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="plain prompts, no chat template")
    p.add_argument("--longbench-dir", default=None, help="directory with the official LongBench <dataset>.jsonl")
    p.add_argument(
        "--longbench-hub",
        action="store_true",
        help="read LongBench datasets missing from --longbench-dir from the data.zip of THUDM/LongBench "
        "on the Hugging Face hub (downloaded once into its cache; needs network)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="store kept keys/values in 8 bits: int8 or fp8_e4m3 (per-token "
        "scales); default: the model's dtype. Use a separate --out per value",
    )
    p.add_argument(
        "--prefill-cache",
        default=None,
        metavar="DIR",
        help="keep each prompt's prefill capture in DIR and reuse it in later runs (same prompt and model: the "
        "same rows, without prefilling again); about 108 KiB per token for Qwen2.5-0.5B in fp32, cleared by you",
    )
    p.add_argument(
        "--fidelity",
        action="store_true",
        help="also teacher-force the full cache's answer through every compressed cache and add the "
        "output-level distance to the full cache to each row (kl, delta_nll, top1, kl_tokens), as "
        "'slake fidelity' measures it; costs about one more decode per pair",
    )
    p.add_argument(
        "--allow-long-context",
        action="store_true",
        help="run prompts whose tokens plus --max-new-tokens reach past the model's context "
        "(max_position_embeddings), where answers degrade; refused otherwise, before anything runs",
    )
    add_engine_arg(p, "generate")
    p.add_argument("--out", required=True, help="output directory (results.jsonl, summary.md/csv, plots)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} (mean score per task) to stdout')
    add_model_args(p)
    return p


def cmd_eval(args: argparse.Namespace, engine: Engine | None = None) -> int:
    """Run ``slake eval``; every argument is validated before the model loads.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments of :func:`add_eval_parser`.
    engine : Engine, optional
        The engine to run; by default the one ``--engine`` names for ``--model`` (tests pass one over a tiny model).

    Returns
    -------
    int
        0 on success. Invalid arguments raise ValueError (the ``slake`` entry point prints them, exit code 2).
    """
    from slake.cache.quant import parse_kv_dtype
    from slake.cli.validation import refuse_empty, refuse_unchunkable
    from slake.engines.base import EvalOptions
    from slake.engines.context import check_lengths
    from slake.eval.protocol import resolve_protocol_args
    from slake.eval.results import read_results, row_key, scan_results
    from slake.eval.runner import evaluate_suite, parse_budgets, resolve_methods
    from slake.eval.suites import build_samples, parse_floats, parse_ints, plan_suite
    from slake.eval.summary import summary_rows, write_summary

    refuse_empty(args)  # an empty --tasks, --lengths, --out ... names nothing: refused, not read as left out
    methods = resolve_methods(args.methods)  # [] for the full cache alone, which needs no --budgets
    # fills --suite, --lengths, --budgets, --question-agnostic
    protocol = resolve_protocol_args(args, budgets_required=bool(methods))
    engine = engine or engine_from_args(args)
    if protocol is not None and "question_agnostic" in engine.unsupported:
        # named for the option given: the protocol, not the --question-agnostic it sets
        raise ValueError(
            f"--engine {engine.name} cannot run --protocol {protocol.name}, which compresses question-agnostic "
            f"prompts ({engine.unsupported['question_agnostic']})"
        )
    refuse_unchunkable(methods, args.prefill_chunk)
    # parsed with the full cache alone too, when given: a bad value is never ignored
    budgets = parse_budgets(args.budgets) if args.budgets is not None else []
    if not methods:
        budgets = []
    for m in methods:
        for b in budgets:
            engine.check_pair(m, b)
    lengths = parse_ints(args.lengths, "--lengths") if args.lengths is not None else None
    depths = parse_floats(args.depths, "--depths", 0.0, 100.0) if args.depths is not None else None
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prefill_chunk is not None and (args.prefill_chunk < 1 or args.question_agnostic):
        raise ValueError("--prefill-chunk must be >= 1 and cannot be combined with --question-agnostic")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    kv_dtype = parse_kv_dtype(getattr(args, "kv_dtype", None))
    if args.batch_size > 1 and (args.prefill_chunk is not None or args.question_agnostic):
        raise ValueError("--batch-size > 1 cannot be combined with --prefill-chunk or --question-agnostic")
    if args.fidelity and (args.prefill_chunk is not None or args.question_agnostic):
        raise ValueError("--fidelity cannot be combined with --prefill-chunk or --question-agnostic")
    engine.check(
        prefill_chunk=args.prefill_chunk,
        question_agnostic=args.question_agnostic,
        kv_dtype=kv_dtype,
        prefill_cache=args.prefill_cache,
        fidelity=args.fidelity,
        allow_long_context=args.allow_long_context,
    )
    tasks = split_list(args.tasks, "--tasks") if args.tasks is not None else None
    _refuse_longbench_options(args)
    check_out_folder(args.out, "--out")
    if args.prefill_cache is not None:
        check_out_folder(args.prefill_cache, "--prefill-cache")
    plan = plan_suite(
        args.suite, tasks, lengths, args.samples, args.seed, depths, args.longbench_dir, args.longbench_hub
    )
    # a generated sample has the length asked: one past the context is refused before the samples are built (a
    # LongBench length only caps its records, which check_requests_fit measures)
    synthetic = plan.lengths if plan.suite != "longbench" else []
    check_lengths(engine.context_limit, synthetic, flag="--lengths", allow_long_context=args.allow_long_context)
    out = Path(args.out)
    previous = scan_results(out)
    if previous.skipped:
        print(f"slake eval: {previous.describe_skipped()}", file=sys.stderr)
    samples = build_samples(plan, engine.tokenizer)
    if protocol is not None:
        samples = _protocol_start(args, protocol, samples, engine, out, methods, budgets)
    options = EvalOptions(
        query_aware=not args.question_agnostic,
        prefill_chunk=args.prefill_chunk,
        batch_size=args.batch_size,
        kv_dtype=kv_dtype,
        prefill_cache=args.prefill_cache,
        fidelity=args.fidelity,
        allow_long_context=args.allow_long_context,
    )
    evaluate_suite(
        engine,
        samples,
        methods,
        budgets,
        out,
        suite=plan.suite,
        model_name=args.model,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        chat_template=not args.no_chat_template,
        progress=not args.no_progress,
        options=options,
    )
    if protocol is not None:
        from slake.eval.protocol_outputs import merge_outputs

        not_merged: list[str] = []
        merged = merge_outputs(out, skipped=not_merged)
        for line in not_merged:
            print(f"slake eval: {line}", file=sys.stderr)
        if merged:
            print(f"slake eval: merged {merged} rows of kvpress's side", file=sys.stderr)
    all_rows = read_results(out)
    md, csv_path = write_summary(out, all_rows)
    plots = _plots(out, all_rows, args.no_plots)
    if protocol is not None:
        plots += _protocol_report(out, all_rows, protocol, args.no_plots)
    wanted = {
        (
            s.task,
            s.sample_id,
            m,
            b,
            int(s.metadata.get("target_length", s.length)),
            args.model,
            None if b is None else args.prefill_chunk,
        )
        for s in samples
        for m, b in [("full", None)] + [(m, b) for m in methods for b in budgets]
    }
    mine = [
        r
        for r in all_rows
        if r.get("suite") == plan.suite
        and row_key(r) in wanted
        and r.get("query_aware", True) == (not args.question_agnostic)
    ]
    if args.json:
        print(json.dumps({"rows": summary_rows(mine)}))
        return 0
    print(md.read_text(encoding="utf-8"))
    print(f"rows: {out / 'results.jsonl'}  summary: {md}, {csv_path}", file=sys.stderr)
    for p in plots:
        print(f"plot: {p}", file=sys.stderr)
    return 0


def _refuse_longbench_options(args: argparse.Namespace) -> None:
    """Refuse ``--longbench-dir`` and ``--longbench-hub`` with a suite other than longbench (as ``--depths`` is
    refused with a suite other than needle), rather than ignore them."""
    given = [
        flag
        for flag, value in (
            ("--longbench-dir", args.longbench_dir is not None),
            ("--longbench-hub", args.longbench_hub),
        )
        if value
    ]
    if given and args.suite != "longbench":
        raise ValueError(
            f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the longbench suite only, "
            f"not to {args.suite}"
        )


def _protocol_start(
    args: argparse.Namespace,
    protocol: Protocol,
    samples: list,
    engine: Engine,
    out: Path,
    methods: list[str],
    budgets: list,
) -> list:
    """The samples scored as ``protocol`` scores them; their token ids written for the kvpress side.

    A directory whose rows were made otherwise is refused first, as :func:`slake.eval.runner.evaluate_suite` would
    refuse it (:func:`slake.eval.runner.check_results_directory`): a refused run must not rewrite the requests (the
    kvpress side would answer them with this run's generation cap, and the next run merge those answers beside rows
    of the old one).
    """
    from slake.cache.quant import parse_kv_dtype
    from slake.engines.base import EvalOptions
    from slake.eval.protocol import model_location, protocol_samples, write_requests
    from slake.eval.results import RESULTS_FILE, ResultsWriter
    from slake.eval.runner import check_results_directory, run_settings

    samples = protocol_samples(samples, protocol, max_new_tokens=args.max_new_tokens)
    if (out / RESULTS_FILE).is_file():
        options = EvalOptions(
            query_aware=not args.question_agnostic, kv_dtype=parse_kv_dtype(getattr(args, "kv_dtype", None))
        )
        settings = run_settings(
            engine, options, chat_template=not args.no_chat_template, max_new_tokens=args.max_new_tokens
        )
        pairs = [("full", None)] + [(m, b) for m in methods for b in budgets]
        with ResultsWriter(out) as store:  # what evaluate_suite checks, checked before the requests are rewritten
            check_results_directory(store, engine, name=args.model, settings=settings, pairs=pairs, samples=samples)
    path = write_requests(
        out,
        samples,
        engine.tokenizer,
        protocol=protocol,
        model_name=args.model,
        model_location=model_location(args.model, getattr(args, "gguf_file", None)),
        eos_token_ids=engine.eos_token_ids(),
        seed=args.seed,
    )
    print(f"slake eval: token ids for kvpress's side in {path}", file=sys.stderr)
    return samples


def _protocol_report(out: Path, rows: list[dict[str, Any]], protocol: Protocol, skip_plots: bool) -> list[Path]:
    from slake.eval.protocol_report import write_protocol_report

    paths = draw_if_possible("slake eval", lambda: write_protocol_report(out, rows, protocol, plots=not skip_plots))
    if paths is None:  # matplotlib, an optional dependency, is missing: the table alone
        paths = write_protocol_report(out, rows, protocol, plots=False)
    print(f"protocol table: {paths[0]}", file=sys.stderr)
    return [p for p in paths if p.suffix == ".png"]


def _plots(out: Path, rows: list[dict[str, Any]], skip: bool) -> list[Path]:
    if skip:
        return []
    from slake.eval.plots import write_plots

    return draw_if_possible("slake eval", lambda: write_plots(out, rows)) or []
