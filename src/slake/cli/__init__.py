"""The ``slake`` command.

Sub-commands, one module each: ``methods`` (list the methods), ``generate`` (compressed-cache generation with cache
statistics), ``fidelity`` (attention and output fidelity), ``eval`` (evaluation suites), ``make-prompt``, ``bench``
(latency and memory vs context length), ``calibrate`` (per-model VABS/CAKE exponents) and ``demo`` (full cache vs
SLAKE on one question). ``generate``, ``eval``, ``bench`` and ``demo`` run on the engine ``--engine`` names
(:mod:`slake.engines`). Every sub-command but ``make-prompt`` (which writes a prompt file) accepts ``--json`` for
machine-readable output; errors go to stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from slake import __version__
from slake.cli.bench import add_bench_parser, cmd_bench
from slake.cli.calibrate import add_calibrate_parser, cmd_calibrate
from slake.cli.demo import add_demo_parser, cmd_demo
from slake.cli.eval import add_eval_parser, cmd_eval
from slake.cli.fidelity import add_fidelity_parser, cmd_fidelity
from slake.cli.generate import add_generate_parser, cmd_generate
from slake.cli.make_prompt import add_make_prompt_parser, cmd_make_prompt
from slake.cli.methods import add_methods_parser, cmd_methods
from slake.cli.options import DefaultsShownFormatter
from slake.cli.validation import validate_args

__all__ = ["COMMANDS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``slake`` command."""
    parser = argparse.ArgumentParser(prog="slake", description="KV-cache compression for transformers models")
    parser.add_argument("--version", action="version", version=f"slake {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        add_methods_parser,
        add_generate_parser,
        add_fidelity_parser,
        add_eval_parser,
        add_make_prompt_parser,
        add_bench_parser,
        add_calibrate_parser,
        add_demo_parser,
    ):
        add(sub)
    for sub_parser in sub.choices.values():
        sub_parser.formatter_class = DefaultsShownFormatter  # every option's default in its help
    return parser


COMMANDS = {
    "methods": cmd_methods,
    "generate": cmd_generate,
    "fidelity": cmd_fidelity,
    "eval": cmd_eval,
    "make-prompt": cmd_make_prompt,
    "bench": cmd_bench,
    "calibrate": cmd_calibrate,
    "demo": cmd_demo,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slake`` console script.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``slake`` (``["eval", "--suite", "ruler", ...]``); ``sys.argv[1:]`` when None.

    Returns
    -------
    int
        The command's exit status; 2 when it refused its arguments or failed with ``ValueError`` or ``OSError``
        (the message goes to stderr); 141, without a message, when standard output's reader left before the output
        ended (``slake methods | head``). A parse error exits through argparse (``SystemExit``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)  # every argument, before any model load or file write
        return COMMANDS[args.command](args)
    except BrokenPipeError as e:
        if not _stdout_gone():  # another pipe (a socket): an error like any other
            print(f"slake {args.command}: error: {e}", file=sys.stderr)
            return 2
        return 141  # the reader of standard output left (slake methods | head): as a shell reports SIGPIPE
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"slake {args.command}: error: {e}", file=sys.stderr)
        return 2


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has left (``poll`` reports an error on it); if so, standard
    output is pointed at the null device, so that what is still buffered is not written again, with a second error,
    when Python exits. False where that cannot be told (no ``poll``, no file descriptor)."""
    import os
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
