"""``slake make-prompt``: the plain prompt of one generated sample.

``slake make-prompt --task needle --length 2048 --seed 1 --out runs/demo_document.txt`` writes the plain prompt
of one generated sample, as the evaluation builds it without a chat template (context + question + the task's answer
prefix, :func:`slake.eval.sample.plain_prompt`: the text ``--length`` measures), and prints its expected answers to
stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_make_prompt_parser", "cmd_make_prompt"]


def add_make_prompt_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``make-prompt`` sub-command to ``subparsers``."""
    p = subparsers.add_parser(
        "make-prompt",
        help="write the plain prompt of one generated needle/RULER sample",
        description="Write the plain prompt of one generated sample (context + question + answer prefix, as the "
        "evaluation builds it without a chat template) to a file; the expected answers go to stderr.",
    )
    p.add_argument("--task", required=True, help="'needle' or a RULER task (e.g. niah_single_2, vt, qa_1)")
    p.add_argument("--length", type=int, required=True, help="prompt length in the model's tokens")
    p.add_argument(
        "--depth",
        type=float,
        default=None,
        help="needle depth in percent (needle: default 50; RULER NIAH tasks: random by default; no other task)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated prompt")
    p.add_argument("--model", default="smollm2", help="model whose tokenizer measures the length")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--out", required=True, help="output text file ('-' for standard output)")
    return p


def cmd_make_prompt(args: argparse.Namespace, tokenizer: Any = None) -> int:
    """Run ``slake make-prompt``; ``tokenizer`` overrides loading ``args.model``'s tokenizer (tests)."""
    from slake.cli.validation import refuse_empty
    from slake.eval.ruler import NIAH_TASKS, RULER_TASKS

    refuse_empty(args, ("out", "model", "gguf_file"))  # an empty --out names no file: refused before the tokenizer
    if args.out != "-" and Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; name the prompt file to write (or - for standard output)")
    if args.out != "-":
        from slake.cli.options import check_out_folder

        # the folder the file goes in (made when it is written): below a file, it failed after the prompt was built
        check_out_folder(Path(args.out).parent, "--out")
    if args.task != "needle" and args.task not in RULER_TASKS:
        raise ValueError(f"unknown task {args.task!r}; expected 'needle' or one of {', '.join(RULER_TASKS)}")
    if args.length < 1:
        raise ValueError(f"--length must be >= 1, got {args.length}")
    if args.depth is not None and args.task != "needle" and args.task not in NIAH_TASKS:
        raise ValueError(f"--depth places a needle: task {args.task} has none (needle and the niah_* tasks do)")
    if args.depth is not None and not 0.0 <= args.depth <= 100.0:
        raise ValueError(f"--depth must lie in [0, 100], got {args.depth}")
    from slake.engines.transformers.models import load_tokenizer

    tok = tokenizer if tokenizer is not None else load_tokenizer(args.model, args.gguf_file)
    if args.task == "needle":
        from slake.eval.needle import needle_sample

        sample = needle_sample(tok, args.length, 50.0 if args.depth is None else args.depth, seed=args.seed)
    else:
        from slake.eval.ruler import ruler_sample

        sample = ruler_sample(args.task, tok, args.length, seed=args.seed, depth=args.depth)
    from slake.eval.sample import plain_prompt

    # context + question + answer prefix: the evaluation's prompt without a chat template, whose tokens sample.length
    # counts
    text = plain_prompt(sample.context, sample.question, sample.answer_prefix)
    if args.out == "-":
        # no newline of our own: `generate --no-chat-template --prompt-file -` sends what it reads, and a RULER prompt
        # ends with the answer prefix that the model's answer continues
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({sample.length} tokens, task {sample.task}, sample {sample.sample_id})", file=sys.stderr)
    print(f"expected answer: {' | '.join(sample.answers)}", file=sys.stderr)
    return 0
