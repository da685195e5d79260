"""``slake demo``: one question about a long document, answered with the full cache and with a compressed cache.

It prints both answers as text a person reads (one line, line breaks collapsed, cut near 90 characters), whether each is
correct (the expected answer is known: the document is a generated needle-in-a-haystack prompt, RULER's
niah_single_1 by default), the time each took, and the KV memory each cache holds (every byte: kept entries, padding,
slack, slot metadata, a linear state, a hybrid model's sliding-window layers;
:func:`slake.engines.result.held_bytes`), in MiB and as a percent of the full cache's. A wrong compressed answer is
printed as wrong, with a hint, never as the product's best. It runs on the engine ``--engine`` names (transformers
by default).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from slake.cli.options import add_engine_arg, add_model_args, engine_from_args
from slake.engines.result import STORED_PARTS, held_bytes

__all__ = ["DEMO_BUDGET", "DEMO_METHOD", "add_demo_parser", "answer_excerpt", "cmd_demo"]

DEMO_METHOD = "slake"
#: RULER's niah_single_1 (a number hidden in filler text): on the default model, compression keeps this needle at
#: small budgets, while on the essay needle every method loses all digits but the first
#: (``docs/results-needle.md#what-this-shows``)
DEMO_TASK = "niah_single_1"
#: chosen by measurement on the default model (``README.md#set-up-two-commands``): SLAKE with the shipped profile
#: answers the demo question at 128 tokens per layer and KV head (7% of the 2K-token document's cache)
DEMO_BUDGET = "128"


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``slake demo``."""
    p = sub.add_parser(
        "demo",
        help="answer a question about a long document with the full cache and with SLAKE",
        description="Build a needle-in-a-haystack document (by default RULER's niah_single_1: a number in a "
        "repeated filler text; --task needle hides it in real essays), ask for the needle, and answer with the full "
        "cache and with a compressed cache; print both answers, their correctness and the KV memory kept.",
    )
    p.add_argument("--method", default=DEMO_METHOD, help="compression method (default: slake)")
    p.add_argument(
        "--budget",
        default=DEMO_BUDGET,
        help="tokens per layer and KV head, or a ratio of the prompt in (0, 1) (default: 128)",
    )
    p.add_argument(
        "--task",
        default=DEMO_TASK,
        help="'needle' (a number in essays) or a RULER task such as niah_single_1 (a number in a "
        "repeated filler text; default)",
    )
    p.add_argument("--length", type=int, default=2048, help="document length in tokens")
    p.add_argument(
        "--depth", type=float, default=None, help="needle depth in percent (needle and niah_* tasks; default 50)"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the document and its needle")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens each cache answers with at most")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--allow-long-context",
        action="store_true",
        help="run a document longer than the model's context (its answers then measure the model past its training)",
    )
    add_engine_arg(p, "answer")
    add_model_args(p)


def _ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.0f}"


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def answer_excerpt(text: str, width: int = 90) -> str:
    """An answer as a person reads it on one line: line breaks and runs of spaces collapsed, the punctuation a
    continuation opens with (``": "`` after a prompt that ends mid-sentence) dropped, and cut at a word boundary near
    ``width`` characters with `` ...``; ``(empty answer)`` when nothing is left."""
    flat = " ".join(text.split()).lstrip(":;,.-– ")
    if not flat:
        return "(empty answer)"
    if len(flat) <= width:
        return flat
    cut = flat[:width].rsplit(" ", 1)[0] or flat[:width]
    return cut.rstrip(" ,;:") + " ..."


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 even when the compressed answer is wrong (it says so), 2 for bad input."""
    import time

    from slake.budgets.budget import Budget
    from slake.cli.generate import timed_decode_ms
    from slake.engines.context import check_lengths
    from slake.eval.metrics import score_prediction
    from slake.eval.needle import needle_sample
    from slake.eval.prompts import build_prompt
    from slake.eval.ruler import RULER_TASKS, ruler_sample
    from slake.eval.ruler_niah import NIAH_TASKS
    from slake.methods import make_method
    from slake.methods.budget_check import check_budget_at_length

    budget = Budget(args.budget)
    if args.task != "needle" and args.task not in RULER_TASKS:
        raise ValueError(f"unknown task {args.task!r}; expected 'needle' or one of {', '.join(RULER_TASKS)}")
    if make_method(args.method).name == "full":  # any spelling: FULL, full[]
        raise ValueError("--method full: the demo compares a compressed cache with the full cache; name a method")
    has_needle = args.task == "needle" or args.task in NIAH_TASKS
    if args.depth is not None and not has_needle:
        raise ValueError(f"--depth places a needle: task {args.task} has none (needle and the niah_* tasks do)")
    depth = 50.0 if args.depth is None and has_needle else args.depth
    if args.length < 256 or args.max_new_tokens < 1 or (depth is not None and not 0 <= depth <= 100):
        raise ValueError("need --length >= 256, --max-new-tokens >= 1 and --depth in [0, 100]")
    check_budget_at_length(args.method, budget, args.length)  # a ratio of the document, before the model loads
    engine = engine_from_args(args)
    # the flag too, as generate and eval check it: vLLM refused it only in its generate, after the model was converted
    # (to read its context) and the document built
    engine.check(allow_long_context=args.allow_long_context)
    engine.check_pair(args.method, budget)
    check_lengths(engine.context_limit, [args.length], flag="--length", allow_long_context=args.allow_long_context)
    tokenizer = engine.tokenizer
    if args.task == "needle":
        sample = needle_sample(tokenizer, args.length, depth, kind="number", seed=args.seed)
    else:
        sample = ruler_sample(args.task, tokenizer, args.length, seed=args.seed, depth=depth)
    # the prompt exactly as the evaluation builds it: chat template, question last, and for RULER tasks the answer
    # prefix ("The special magic number for X mentioned in the text above is") opening the assistant turn
    prompt = build_prompt(sample, tokenizer)
    assert isinstance(prompt, str)  # query-aware prompts are one string
    runs: dict[str, dict[str, Any]] = {}
    for name, method, b in (("full cache", "full", 1), (args.method, args.method, budget)):
        start = time.perf_counter()
        res = engine.generate(
            prompt,
            method=method,
            budget=b,
            max_new_tokens=args.max_new_tokens,
            chat_template=False,
            allow_long_context=args.allow_long_context,
        )
        runs[name] = {
            "text": res.text,
            "correct": bool(score_prediction(sample, res.text) >= 1.0),
            "kv_bytes": res.kv_bytes,
            "prompt_tokens": res.prompt_tokens[0],
            "new_tokens": res.new_tokens[0],
            "profile": res.profile,
            "stored_bytes": held_bytes(res.kv_bytes),
            "seconds": round(time.perf_counter() - start, 2),
            "prefill_s": round(res.prefill_s, 3),
            # None (n/a) where no decode step was timed (one new token); the vLLM engine's NaN is not JSON
            "decode_ms_per_token": timed_decode_ms(res.decode_ms_per_token),
        }
    full, comp = runs["full cache"], runs[args.method]
    kept_pct = 100.0 * comp["stored_bytes"] / max(full["stored_bytes"], 1)
    out = {
        "question": sample.question.strip(),
        "expected": list(sample.answers),
        "method": args.method,
        "budget": budget.value,
        "prompt_tokens": full["prompt_tokens"],
        "full": full,
        "compressed": comp,
        "kept_percent": round(kept_pct, 2),
        # what stored_bytes adds up, and what each part is (the rest of kv_bytes: "full", what an uncompressed cache
        # would hold; the vLLM engine's "blocks_held", its block-granular total of kept and padding)
        "stored_parts": dict(STORED_PARTS),
        "engine": engine.name,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    mark = {True: "correct", False: "WRONG"}
    label = f"{args.method} @ {budget.value}"
    width = max(len("full cache"), len(label))
    print(f"Document: {full['prompt_tokens']} tokens{_what_it_hides(args.task)} ({args.task}).")
    print(f"Question: {sample.question.strip()}")
    print(f"Expected: {', '.join(sample.answers)}\n")
    for name, run in ((f"{'full cache':<{width}}", full), (f"{label:<{width}}", comp)):
        print(f'  {name}  {mark[run["correct"]]:<7}  "{answer_excerpt(run["text"])}"')
    print()
    for name, run in ((f"{'full cache':<{width}}", full), (f"{label:<{width}}", comp)):
        pct = "" if run is full else f"  ({kept_pct:.1f}% of the full cache)"
        print(
            f"  {name}  KV memory {_fmt_bytes(run['stored_bytes']):>9}{pct}   time {run['seconds']:.1f} s "
            f"(prefill {run['prefill_s']:.1f} s, decode {_ms(run['decode_ms_per_token'])} ms/token)"
        )
    kv = comp["kv_bytes"]
    bookkeeping = sum(kv.get(k, 0) for k in ("padding", "slack", "metadata"))
    sliding = f", and its sliding-window layers hold {_fmt_bytes(kv['sliding'])}" if kv.get("sliding") else ""
    print(
        f"\n  {args.method} keeps {_fmt_bytes(kv['kept'])} of entries, a linear state of "
        f"{_fmt_bytes(kv.get('linear_state', 0))} and {_fmt_bytes(bookkeeping)} of bookkeeping (padding, free "
        f"slots, slot metadata){sliding}."
    )
    if not full["correct"] and full["new_tokens"] >= args.max_new_tokens:
        # cut before it could finish: the length of the answer, not the model, may be what failed
        print(
            f"\nThe full cache did not answer correctly either, and its answer was cut at --max-new-tokens "
            f"{args.max_new_tokens}: try a larger --max-new-tokens (then a shorter --length, another --task, or a "
            "larger --model; docs/results.md lists what was measured).",
            file=sys.stderr,
        )
    elif not full["correct"]:  # no budget does better than the full cache
        print(
            "\nThe full cache did not answer correctly either: this model misses this task at this length, whatever "
            "the budget; try a shorter --length, another --task, or a larger --model (docs/results.md lists what was "
            "measured).",
            file=sys.stderr,
        )
    elif not comp["correct"]:
        cut = comp["new_tokens"] >= args.max_new_tokens
        also = f", or a larger --max-new-tokens (its answer was cut at {args.max_new_tokens} tokens)" if cut else ""
        print(
            f"\n{args.method} did not answer correctly at budget {budget.value} on this document: try a larger "
            f"--budget{also} (docs/results.md lists what was measured).",
            file=sys.stderr,
        )
    return 0


def _what_it_hides(task: str) -> str:
    """What the demo's document hides, as its first line says it: one fact for a single needle, several facts for
    the other needle tasks, nothing said for the tasks without a needle (counting, tracking, QA)."""
    if task == "needle" or task.startswith("niah_single"):
        return " with one hidden fact"
    if task.startswith("niah_"):
        return " with hidden facts"
    return ""
