"""``slake fidelity``: relative error of attention outputs and output-level distance to the full cache
(:mod:`slake.quality.fidelity`, :mod:`slake.quality.output_fidelity`); transformers models only."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from slake.cli.options import add_model_args, check_out_folder
from slake.cli.validation import fidelity_grid, read_prompt
from slake.optional_plots import draw_if_possible

__all__ = ["add_fidelity_parser", "cmd_fidelity", "refuse_unsupported"]


def add_fidelity_parser(sub: Any) -> None:
    """Register ``slake fidelity``."""
    p = sub.add_parser("fidelity", help="relative error of attention outputs vs the full cache, per layer")
    p.add_argument(
        "--methods",
        default="cake,slake",
        help="comma-separated methods; variants as name[key=value,...], e.g. slake[vabs=false]",
    )
    p.add_argument("--budgets", default="64,128,256", help="comma-separated budgets")
    p.add_argument("--length", type=int, default=4096, help="prompt length in tokens (generated needle document)")
    p.add_argument("--prompt-file", help="use this prompt instead of a generated document")
    p.add_argument("--steps", type=int, default=16, help="decode steps whose queries are measured")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated documents")
    p.add_argument(
        "--linear-cache",
        choices=["default", "on", "off", "both"],
        default="default",
        help="force the PTAA linear cache on/off for every method, or measure both (default: each method's own)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="comma-separated storage of kept keys/values to measure: auto "
        "(model dtype), int8, fp8_e4m3; e.g. auto,int8",
    )
    p.add_argument(
        "--output-tokens",
        type=int,
        default=32,
        help="output-level fidelity: continuation tokens per prompt, teacher-forced (0: skip)",
    )
    p.add_argument(
        "--output-samples",
        type=int,
        default=2,
        help="output-level fidelity: prompts of each kind (essay continuation, full cache's answer)",
    )
    p.add_argument(
        "--out", help="folder for fidelity.json, fidelity.md, fidelity_per_layer.png and output_kl_vs_budget.png"
    )
    p.add_argument("--json", action="store_true", help='print {"rows": [...]}')
    p.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_args(p)


def cmd_fidelity(args: argparse.Namespace) -> int:
    """Run ``slake fidelity`` (``docs/cli.md``, ``docs/results-fidelity.md``): each method's attention error
    against the full cache per layer, and its output-level distance; writes ``fidelity.md`` and ``fidelity.json``
    (and a plot) to ``--out``. Returns the exit code."""
    from slake.engines.context import check_context, check_lengths, context_limit
    from slake.engines.transformers.generate import format_prompt, uses_chat_template
    from slake.engines.transformers.models import load_model
    from slake.methods.budget_check import check_budget_at_length
    from slake.quality import fidelity

    methods, budgets, kv_dtypes = fidelity_grid(args)
    modes: dict[str, list[bool | None]] = {"default": [None], "on": [True], "off": [False], "both": [False, True]}
    lin_modes = modes[args.linear_cache]
    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.output_tokens < 0 or args.output_tokens == 1 or args.output_samples < 1:
        raise ValueError("--output-tokens must be 0 (skip) or >= 2, and --output-samples >= 1")
    refuse_unsupported(methods)
    if args.out is not None:
        check_out_folder(args.out)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file)
    limit = context_limit(model.config)
    if args.prompt_file is None or args.output_tokens:  # --length builds a prompt: refused past the context first
        check_lengths(limit, [args.length], flag="--length", can_allow=False)
    if args.prompt_file is not None:
        text = getattr(args, "prompt_text", None) or read_prompt(None, args.prompt_file)
    else:
        from slake.eval.needle import needle_sample

        sample = needle_sample(tokenizer, args.length, 50.0, kind="number", seed=args.seed)
        text = sample.context + sample.question
    plain = not uses_chat_template(tokenizer)
    ids = tokenizer(format_prompt(tokenizer, text), return_tensors="pt", add_special_tokens=plain).input_ids
    ids = ids.to(model.device)
    check_context(limit, int(ids.shape[1]), args.steps, what="the prompt has", can_allow=False)
    for m in methods:  # a ratio of this prompt (--prompt-file's length is known now), before the full-cache recording
        for b in budgets:
            check_budget_at_length(m, b, int(ids.shape[1]))
    if args.output_tokens:
        check_context(
            limit, args.length, args.output_tokens, what="each output-level prompt (--length) has", can_allow=False
        )
    print(f"recording the full-cache run ({ids.shape[1]} prompt tokens, {args.steps} decode steps)...", file=sys.stderr)
    rec = fidelity.record(model, ids, args.steps)
    settings = len(methods) * len(kv_dtypes) * len(lin_modes) * len(budgets)
    bar = _progress_bar(args, settings * (2 if args.output_tokens else 1))
    rows = []
    for m in methods:
        for kvd in kv_dtypes:
            for lin in lin_modes:
                for b in budgets:
                    bar.set_postfix_str(f"attention level: {m} @ {b}", refresh=False)
                    rows += fidelity.measure(rec, m, b, linear_cache=lin, kv_dtype=kvd, profile_model=model)
                    bar.update(1)
    for r in rows:
        r["prompt_tokens"] = int(ids.shape[1])
    output_rows = (
        _output_fidelity(args, model, tokenizer, methods, budgets, lin_modes, kv_dtypes, bar)
        if args.output_tokens
        else []
    )
    bar.close()
    named = args.model if args.gguf_file is None else f"{args.model} ({args.gguf_file})"
    for r in rows + output_rows:  # as evaluation rows name theirs: a results folder says what it measured
        r["model"] = named
    output_md = ""
    if output_rows:
        from slake.quality import output_fidelity

        output_md = (
            f"\n\n## Output level ({args.length}-token prompts, {args.output_tokens} teacher-forced tokens, "
            f"{args.output_samples} essay continuations + {args.output_samples} answers)\n\n"
            + output_fidelity.summary_table(output_rows)
        )
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fidelity.json").write_text(json.dumps(_json_safe({"rows": rows, "output_rows": output_rows}), indent=1))
        (out / "fidelity.md").write_text(
            f"# Attention fidelity ({named}, {ids.shape[1]} prompt tokens, {args.steps} decode steps)\n\n"
            + fidelity.summary_table(rows)
            + output_md
            + "\n\n## Per layer (decode queries)\n\n"
            + fidelity.per_layer_table(rows)
            + "\n"
        )
        if not args.no_plots:  # matplotlib is optional: without it the tables alone, and a line saying so
            per_layer = str(out / "fidelity_per_layer.png")
            draw_if_possible("slake fidelity", lambda: fidelity.plot_per_layer(rows, per_layer))
            if output_rows:
                draw_if_possible(
                    "slake fidelity",
                    lambda: output_fidelity.plot_kl_vs_budget(output_rows, str(out / "output_kl_vs_budget.png")),
                )
    if args.json:
        print(json.dumps(_json_safe({"rows": rows, "output_rows": output_rows})))
    else:
        print(fidelity.summary_table(rows) + output_md)
        print()
        print(fidelity.per_layer_table(rows))
    return 0


def _json_safe(value: Any) -> Any:
    """``value`` with every float that is not a finite number (an overflowed fp16 cache's KL or error) as None:
    ``json.dumps`` wrote ``NaN`` and ``Infinity``, which are not JSON, and strict parsers (``jq``) refused the whole
    output. ``null``, as ``slake eval --fidelity`` rows and ``slake calibrate`` profiles write it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _progress_bar(args: argparse.Namespace, total: int) -> Any:
    """The run's progress bar on standard error: one unit per setting measured (method, kv dtype, linear cache,
    budget), at the attention level and again at the output level; a bar that shows nothing with ``--no-progress``."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc="slake fidelity", unit="setting", file=sys.stderr, disable=getattr(args, "no_progress", False)
    )


def refuse_unsupported(methods: list[str]) -> None:
    """Refuse, before the model loads, a method ``slake fidelity`` cannot measure: one that needs a second pass over
    the prompt (``Method.second_pass``, KVzip's reconstruction), which the attention level's replay of the recorded
    prompt does not run.

    Raises
    ------
    ValueError
        Naming the method and what to use instead.
    """
    from slake.methods.base import make_method

    for m in methods:
        built = make_method(m)
        if built.second_pass is not None:
            raise ValueError(
                f"slake fidelity cannot measure {m}: it scores the prompt with a second pass "
                f"({built.second_pass}) that the attention level's replay of the recorded prompt does not run; "
                f"measure its output-level distance with `slake eval --fidelity` instead"
            )


def _output_fidelity(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    methods: list[str],
    budgets: list,
    lin_modes: list[bool | None],
    kv_dtypes: list[str | None],
    bar: Any,
) -> list[dict]:
    """Output-level rows (:mod:`slake.quality.output_fidelity`) for every (method, kv dtype, linear cache, budget),
    labelled as the attention level labels them: ``method`` carries the storage (``snapkv@int8``) and
    ``linear_cache`` the setting measured."""
    from slake.methods.base import canonical_method_spec
    from slake.quality import fidelity, output_fidelity
    from slake.quality.continuations import (
        EVALUATION_QUESTIONS,
        answer_continuations,
        evaluation_text,
        text_continuations,
    )

    text = evaluation_text()
    bar.write(
        f"output level: {2 * args.output_samples} prompts of {args.length} tokens, "
        f"{args.output_tokens} continuation tokens each...",
        file=sys.stderr,
    )
    conts = text_continuations(
        tokenizer, text, args.length, args.output_tokens, args.output_samples, seed=args.seed, name="essay"
    )
    conts += answer_continuations(
        model,
        tokenizer,
        text,
        args.length,
        args.output_tokens,
        args.output_samples,
        EVALUATION_QUESTIONS,
        seed=args.seed,
        name="answer",
    )
    ref = output_fidelity.prepare_reference(model, conts)
    rows: list[dict] = []
    for m in methods:
        label = canonical_method_spec(m, drop=("linear_cache",))
        for kvd in kv_dtypes:
            for lin in lin_modes:
                for b in budgets:
                    bar.set_postfix_str(f"output level: {m} @ {b}", refresh=False)
                    built, profile = fidelity.resolve_setting(m, b, model, lin)
                    for r in output_fidelity.measure_outputs(model, ref, built, b, label=label, kv_dtype=kvd):
                        r["linear_cache"] = built.linear_cache
                        r["profile"] = profile
                        rows.append(r)
                    bar.update(1)
    return rows
