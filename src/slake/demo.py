"""``slake demo``: one question about a long document, answered with the full cache and with a compressed cache.

It prints both answers, whether each is correct (the expected answer is known: the document is a generated
needle-in-a-haystack prompt, RULER's niah_single_1 by default), and the KV memory each cache holds, in bytes and as a percent of the
full cache. A wrong compressed answer is printed as wrong, with a hint, never as the product's best.
"""

from __future__ import annotations

import argparse
import json
import sys

from .cli_args import add_model_args

__all__ = ["DEMO_METHOD", "DEMO_BUDGET", "add_demo_parser", "cmd_demo"]

DEMO_METHOD = "slake"
#: RULER's niah_single_1 (a number hidden in filler text): on the default model, compression keeps this needle at
#: small budgets, while on the essay needle every method loses all digits but the first (README, "Needle retrieval")
DEMO_TASK = "niah_single_1"
#: chosen by measurement on the default model (README, "The demo"): SLAKE with the shipped profile answers the demo
#: question at 128 tokens per layer and KV head (7% of the 2K-token document's cache)
DEMO_BUDGET = "128"


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``slake demo``."""
    p = sub.add_parser("demo", help="answer a question about a long document with the full cache and with SLAKE",
                       description="Build a needle-in-a-haystack document from real essays, ask for the needle, and "
                                   "answer with the full cache and with a compressed cache; print both answers, "
                                   "their correctness and the KV memory kept.")
    p.add_argument("--method", default=DEMO_METHOD, help="compression method (default slake)")
    p.add_argument("--budget", default=DEMO_BUDGET,
                   help="tokens per layer and KV head, or a ratio of the prompt in (0, 1) (default 128)")
    p.add_argument("--task", default=DEMO_TASK,
                   help="'needle' (a number in essays) or a RULER task such as niah_single_1 (a number in a "
                        "repeated filler text; default)")
    p.add_argument("--length", type=int, default=2048, help="document length in tokens")
    p.add_argument("--depth", type=float, default=50.0, help="needle depth in percent")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 even when the compressed answer is wrong (it says so), 2 for bad input."""
    from .budget_spec import Budget
    from .eval.metrics import score_prediction
    from .eval.needle import needle_sample
    from .hf.generate import generate
    from .methods import make_method
    from .models import load_model

    from .eval.ruler import RULER_TASKS

    make_method(args.method)
    budget = Budget(args.budget)
    if args.task != "needle" and args.task not in RULER_TASKS:
        raise ValueError(f"unknown task {args.task!r}; expected 'needle' or one of {', '.join(RULER_TASKS)}")
    if args.length < 256 or args.max_new_tokens < 1 or not 0 <= args.depth <= 100:
        raise ValueError("need --length >= 256, --max-new-tokens >= 1 and --depth in [0, 100]")
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file)
    if args.task == "needle":
        sample = needle_sample(tokenizer, args.length, args.depth, kind="number", seed=args.seed)
    else:
        from .eval.ruler import ruler_sample

        sample = ruler_sample(args.task, tokenizer, args.length, seed=args.seed, depth=args.depth)
    from .eval.prompts import build_prompt

    # the prompt exactly as the evaluation builds it: chat template, question last, and for RULER tasks the answer
    # prefix ("The special magic number for X mentioned in the provided text is") opening the assistant turn
    prompt = build_prompt(sample, tokenizer)
    runs = {}
    for name, method, b in (("full cache", "full", 1), (args.method, args.method, budget)):
        res = generate(model, tokenizer, prompt, method=method, budget=b, max_new_tokens=args.max_new_tokens,
                       chat_template=False)
        runs[name] = {"text": res.text, "correct": bool(score_prediction(sample, res.text) >= 1.0),
                      "kv_bytes": res.kv_bytes, "prompt_tokens": res.prompt_tokens[0], "profile": res.profile,
                      "stored_bytes": sum(v for k, v in res.kv_bytes.items() if k != "full")}
    full, comp = runs["full cache"], runs[args.method]
    kept_pct = 100.0 * comp["stored_bytes"] / max(full["stored_bytes"], 1)
    out = {"question": sample.question.strip(), "expected": list(sample.answers), "method": args.method,
           "budget": budget.value, "prompt_tokens": full["prompt_tokens"], "full": full, "compressed": comp,
           "kept_percent": round(kept_pct, 2)}
    if args.json:
        print(json.dumps(out))
        return 0
    mark = {True: "correct", False: "WRONG"}
    print(f"Document: {full['prompt_tokens']} tokens with one hidden fact ({args.task}). Question: "
          f"{sample.question.strip()}")
    print(f"Expected answer: {', '.join(sample.answers)}\n")
    print(f"[full cache]  {mark[full['correct']]}: {full['text']!r}")
    print(f"[{args.method} @ {budget.value}]  {mark[comp['correct']]}: {comp['text']!r}\n")
    print(f"KV memory, full cache: {_fmt_bytes(full['stored_bytes'])}")
    print(f"KV memory, {args.method}:    {_fmt_bytes(comp['stored_bytes'])} ({kept_pct:.1f}% of the full cache: "
          f"kept entries {_fmt_bytes(comp['kv_bytes']['kept'])}, linear state "
          f"{_fmt_bytes(comp['kv_bytes'].get('linear_state', 0))}, bookkeeping "
          f"{_fmt_bytes(comp['kv_bytes'].get('metadata', 0) + comp['kv_bytes'].get('padding', 0))})")
    if not comp["correct"]:
        print(f"\n{args.method} did not answer correctly at budget {budget.value} on this document: try a larger "
              "--budget (the README's demo section lists what was measured).", file=sys.stderr)
    return 0
