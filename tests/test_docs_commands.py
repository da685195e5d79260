"""The documentation's ``slake`` command lines run: every ``slake <subcommand> ...`` written in the README and
``docs/`` (fenced code blocks, continued over lines with a trailing backslash or an indented line, and inline code
spans) parses with the real argument parser and passes :func:`slake.cli.validation.validate_args`, and every
``--flag`` it names exists on that subcommand. Nothing is loaded or run. A flag renamed in the code otherwise leaves
commands in the docs that exit with code 2, or, shortened to a prefix of another flag, silently mean that one.

Synopsis lines (``docs/cli.md``) are checked as what they are: every flag in their ``[--optional ...]`` parts must
exist on the subcommand, every ``{a,b}`` choice list must hold choices of its option, and what is left outside the
brackets (the first choice standing for a list) must parse and validate, and so must it with each optional
``[--set NAME=VALUE ...]`` part added (hyperparameters of the method it names). ``eval``, ``calibrate``, ``demo`` and
``make-prompt``, whose checks ``validate_args`` leaves to the command, also run their command up to its first model
or tokenizer load (patched to stop there; outputs redirected to a temporary folder). A command that leaves out
what the parser requires (an inline mention such as ``slake eval --question-agnostic``, or a line shortened with
``...``; a quoted ``"..."`` is a value) is a fragment: it is completed with placeholder values for the missing
required options before it is parsed, and only ``validate_args`` checks it.
Validation needing what this machine has not got is skipped: a file the docs only name (``--prompt-file doc.txt``),
CUDA, vLLM. ``docs/results/`` holds recorded outputs and is not read."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from slake.cli import build_parser
from slake.cli.validation import validate_args

ROOT = Path(__file__).resolve().parents[1]

_PARSER = build_parser()
#: subcommand name -> its parser
SUBPARSERS: dict[str, argparse.ArgumentParser] = next(
    a for a in _PARSER._actions if isinstance(a, argparse._SubParsersAction)
).choices
_SUBS = "|".join(sorted((re.escape(s) for s in SUBPARSERS), key=len, reverse=True))
#: a command's start: environment assignments, then ``slake`` (or ``.venv-vllm/bin/slake``), then a subcommand
_START = re.compile(rf"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:[\w./-]*/)?slake\s+({_SUBS})(?=\s|$)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: an optional part of a synopsis, ``[--flag VALUE]``: its ``[`` opens a word (a method variant's does not)
_OPTIONAL = re.compile(r"(?:(?<=\s)|^)\[[^\[\]]*\]")
_CHOICES = re.compile(r"\{([\w,.-]+)\}")
#: stands for more; a command holding it is a fragment
_ELLIPSIS = "..."
#: "..." in quotes: a value written out as an ellipsis, and what stands for it when parsed
_QUOTED_ELLIPSIS = re.compile(r"([\"'])\.\.\.\1")
_VALUE = "written-out-value"
#: a value's placeholder: N, DIR, F, SHAPE...
_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
#: values that complete a fragment for the parser when it misses a required option
_FILL = {
    "--out": "runs/docs-check",
    "--methods": "snapkv",
    "--prompt": "Where is the needle?",
    "--task": "needle",
    "--length": "2048",
}


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: int
    text: str  # the command from ``slake`` on, continuation lines joined, comments removed
    inline: bool

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def _strip_comment(line: str) -> str:
    """``line`` without a shell comment (a ``#`` opening a word outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _from_slake(text: str) -> str:
    """The command from ``slake`` on (environment assignments and the path to the script dropped)."""
    m = _START.match(text)
    assert m is not None
    return "slake " + text[m.start(1) :].strip()


def commands_in(text: str, file: str) -> list[DocCommand]:
    """The ``slake`` commands of one Markdown text: code block lines and inline code spans."""
    found: list[DocCommand] = []
    lines = text.splitlines()
    prose = list(lines)  # the text outside fenced blocks, fenced lines blanked (line numbers kept)
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose[i] = ""
            i += 1
            continue
        if not fenced:
            i += 1
            continue
        prose[i] = ""
        start = i
        if not _START.match(line):
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        parts = [_strip_comment(line)]
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            nxt = lines[i]
            backslash = parts[-1].endswith("\\")
            indented = nxt.strip() and len(nxt) - len(nxt.lstrip()) > indent and not _START.match(nxt)
            if not (backslash or indented):
                break
            if backslash:
                parts[-1] = parts[-1][:-1].rstrip()
            prose[i] = ""
            parts.append(_strip_comment(nxt).strip())
            i += 1
        found.append(DocCommand(file, start + 1, _from_slake(" ".join(parts)), inline=False))
    body = "\n".join(prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", body):
        span = m.group(1)
        if "\n\n" in span or not _START.match(span):
            continue
        line = body.count("\n", 0, m.start()) + 1
        found.append(DocCommand(file, line, _from_slake(" ".join(span.split())), inline=True))
    return found


def _markdown_files() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "results" not in p.relative_to(ROOT / "docs").parts]
    return [ROOT / "README.md", *docs]


def documented_commands() -> list[DocCommand]:
    out = []
    for path in _markdown_files():
        out += commands_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return out


def _options(sub: str) -> dict[str, argparse.Action]:
    return SUBPARSERS[sub]._option_string_actions


def _parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """The parsed arguments, or None and argparse's error message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _PARSER.parse_args(argv), ""
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"


#: validation errors that say what this machine lacks, not what the command gets wrong
_UNAVAILABLE = ("not found", "No such file", "CUDA is not available", "CUDA device", "needs vLLM")
#: the commands whose checks ``validate_args`` leaves to the command itself, before its first model load
_CHECKED_BY_COMMAND = ("eval", "calibrate", "demo", "make-prompt")


class _ModelNeeded(Exception):
    """Raised where a command would load a model or a tokenizer: its checks are done."""


def _no_model(*args: object, **kwargs: object) -> None:
    raise _ModelNeeded


def _checks_before_the_model(args: argparse.Namespace) -> None:
    """Run the command of ``args`` up to its first model or tokenizer load, its outputs in a temporary folder."""
    from slake.cli import COMMANDS as RUN

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for name in ("out", "out_dir"):  # read nothing of the docs' own result folders, write nothing there
            if getattr(args, name, None) not in (None, "-"):
                setattr(args, name, str(tmp / name))
        stack.enter_context(mock.patch("slake.engines.transformers.models.load_model", _no_model))
        stack.enter_context(mock.patch("slake.engines.transformers.models.load_tokenizer", _no_model))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        try:
            RUN[args.command](args)
        except _ModelNeeded:
            return
    raise AssertionError(f"slake {args.command} ran to its end without loading a model")


def _check_choices(words: list[str], opts: dict[str, argparse.Action]) -> list[str]:
    """A ``{a,b}`` choice list after an option names only choices of that option (where it has a fixed set)."""
    problems = []
    for k in range(1, len(words)):
        m = _CHOICES.search(words[k])
        action = opts.get(words[k - 1].lstrip("["))
        if m and action is not None and action.choices is not None:
            flag = words[k - 1].lstrip("[")
            problems += [f"{flag} has no choice {c!r}" for c in m.group(1).split(",") if c not in action.choices]
    return problems


def _argv(cmd: DocCommand) -> tuple[list[str], bool]:
    """The arguments to parse (after ``slake``): the synopsis's optional parts and remarks left out, a choice list's
    first choice standing for it, "..." dropped, a number's placeholder replaced by 1; and whether the command is a
    fragment (an inline mention, or a line shortened with "...")."""
    sub = cmd.text.split()[1]
    required = _OPTIONAL.sub("", cmd.text)
    words = [_CHOICES.sub(lambda m: m.group(1).split(",")[0], w) for w in required.split()]
    if required != cmd.text:  # a synopsis's remark after its options, "(docs/kvpress-protocol.md)", is prose
        words = [w for w in words if not re.fullmatch(r"\(\S*\)", w)]
    # a quoted "..." is a value (a prompt written as `--prompt "..."`), not a shortened line: it stays an argument,
    # so that one standing alone (`slake generate ... "..."`, a positional prompt) fails to parse
    argv = shlex.split(_QUOTED_ELLIPSIS.sub(_VALUE, " ".join(words)))[1:]
    fragment = cmd.inline or any(_ELLIPSIS in a for a in argv)
    # "..." stands for more: a word of it is dropped, and so is the end of a list "transformers,..."
    argv = [a.replace("," + _ELLIPSIS, "") for a in argv if a != _ELLIPSIS]
    for k in range(1, len(argv)):  # a number's placeholder (--profile-steps N) stands for a valid number
        action = _options(sub).get(argv[k - 1])
        if action is not None and action.type in (int, float) and _PLACEHOLDER.fullmatch(argv[k]):
            argv[k] = "1"
    return argv, fragment


def _check_set_parts(cmd: DocCommand, argv: list[str]) -> list[str]:
    """A synopsis's optional ``[--set NAME=VALUE ...]`` parts, each added to the command: its hyperparameters must
    belong to the command's method (checked before the prompt file, which the docs only name, is read)."""
    problems = []
    for part in _OPTIONAL.findall(cmd.text):
        words = shlex.split(part[1:-1])
        if words[:1] != ["--set"] or "|" in words:
            continue
        args, error = _parse(argv + words)
        if args is None:
            problems.append(f"with {part}: does not parse: {error}")
            continue
        try:
            validate_args(args)
        except ValueError as e:
            if not any(s in str(e) for s in _UNAVAILABLE):
                problems.append(f"with {part}: fails validation: {e}")
    return problems


def check_command(cmd: DocCommand) -> tuple[list[str], str | None]:
    """The problems of one documented command, and why its validation was skipped (None when it ran)."""
    sub = cmd.text.split()[1]
    opts = _options(sub)
    problems = [f"{f} is no option of slake {sub}" for f in _FLAG.findall(cmd.text) if f not in opts]
    problems += _check_choices(cmd.text.split(), opts)
    if problems:
        return problems, None
    try:
        argv, fragment = _argv(cmd)
    except ValueError as e:
        return [f"not a shell command line: {e}"], None
    args, error = _parse(argv)
    completed = False
    if args is None and fragment and "required" in error:
        missing = set(_FLAG.findall(error)) & set(_FILL)
        if "--prompt-file" in argv:
            missing.discard("--prompt")
        argv += [a for flag in sorted(missing) for a in (flag, _FILL[flag])]
        args, error = _parse(argv)
        completed = True
    if args is None and cmd.inline and "expected" in error and "argument" in error:
        return [], None  # prose naming an option without its value (`slake eval --kv-dtype`): the flag exists
    if args is None:
        return [f"does not parse: {error}"], None
    if any("$" in a for a in argv):
        return [], "a shell variable's value is not known here"
    stdin = sys.stdin
    sys.stdin = io.StringIO("Where is the needle?")  # --prompt-file - reads standard input
    try:
        problems = _check_set_parts(cmd, argv)
        if problems:
            return problems, None
        validate_args(args)
        if sub in _CHECKED_BY_COMMAND and not completed and not fragment:
            if getattr(args, "suite", None) == "longbench":
                return [], "the longbench suite reads its data from a folder or the network"
            _checks_before_the_model(args)
    except ValueError as e:
        if any(s in str(e) for s in _UNAVAILABLE):
            return [], str(e)
        return [f"fails validation: {e}"], None
    except ImportError as e:
        if "vllm" in str(e):
            return [], f"needs vLLM: {e}"
        raise
    finally:
        sys.stdin = stdin
    return [], None


COMMANDS = documented_commands()


def test_commands_are_found():
    """The extraction itself, on a made-up page."""
    page = (
        "Run `slake generate --method snapkv --budget 128 --prompt-file doc.txt` or `slake.generate`;\n"
        "`slake generate/eval` is no command, `OMP_NUM_THREADS=1 slake eval --protocol kvpress\n"
        "--out DIR` is.\n\n"
        "```bash\n"
        "slake eval --suite ruler --methods 'slake[vabs=false]' \\\n"
        "    --budgets 128 --out DIR   # a comment\n"
        "slake demo [--budget 128]\n"
        "           [--json]          # a synopsis continued\n"
        ".venv-vllm/bin/slake bench --engine vllm --serve --out DIR\n"
        "make demo\n"
        "```\n"
    )
    found = [(c.line, c.text, c.inline) for c in commands_in(page, "page.md")]
    assert found == [
        (6, "slake eval --suite ruler --methods 'slake[vabs=false]' --budgets 128 --out DIR", False),
        (8, "slake demo [--budget 128] [--json]", False),
        (10, "slake bench --engine vllm --serve --out DIR", False),
        (1, "slake generate --method snapkv --budget 128 --prompt-file doc.txt", True),
        (2, "slake eval --protocol kvpress --out DIR", True),
    ]


@pytest.mark.parametrize(
    "text, problem",
    [
        ("slake eval --suite ruler --methods snapkv --budget 128 --out DIR", "--budget is no option of slake eval"),
        ("slake generate --method nosuch --budget 128 --prompt x", "fails validation"),
        ("slake bench --methods full --out DIR --decode-timing {auto,nosuch}", "has no choice 'nosuch'"),
        ("slake demo [--budget 128] [--kernels triton]", "--kernels is no option of slake demo"),
        ("slake eval --suite ruler --methods all", "does not parse"),
        ("slake fidelity --methods cake --steps 0", "fails validation"),
        ("slake eval --suite ruler --methods snapkv --budgets 128 --depths 10 --out DIR", "--depths applies"),
        ("slake make-prompt --task nosuch --length 2048 --out doc.txt", "unknown task 'nosuch'"),
        ("slake calibrate --methods snapkv --budgets 128", "tunes cake, slake"),
        # a quoted "..." is a value: standing alone it is a positional argument generate does not take
        ('slake generate --method slake --budget 128 --compile "..."', "does not parse"),
        # a synopsis's optional hyperparameters belong to its method (gamma is CAKE's and SLAKE's)
        ("slake generate --method snapkv --budget 128 --prompt-file doc.txt [--set window=16 gamma=100]", "gamma"),
    ],
)
def test_a_bad_command_is_reported(text, problem):
    problems, _ = check_command(DocCommand("page.md", 1, text, inline=False))
    assert any(problem in p for p in problems), problems


def test_fragments_and_missing_files_pass():
    for text, inline in [
        ("slake eval --question-agnostic", True),
        ("slake eval --suite ruler ... --methods slake --budgets 128,256 ...", False),
        ("slake generate --method snapkv --budget 128 --prompt-file no-such-doc.txt", False),
        ('slake generate --method snapkv --budget 128 --prompt "..."', False),
        ("slake generate --method snapkv --budget 128 --prompt-file doc.txt [--set window=16 kernel=7]", False),
        ("slake eval --protocol kvpress --methods snapkv --out DIR [--tasks T1,T2]  (docs/kvpress-protocol.md)", False),
    ]:
        assert check_command(DocCommand("page.md", 1, text, inline))[0] == [], text


def test_commands_of_the_docs_are_found():
    files = {c.file for c in COMMANDS}
    assert {"README.md", "docs/cli.md"} <= files
    assert len(COMMANDS) > 50


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.file}:{c.line}" for c in COMMANDS])
def test_documented_command_parses_and_validates(cmd: DocCommand):
    problems, skipped = check_command(cmd)
    assert not problems, f"{cmd}\n  " + "\n  ".join(problems)
    if skipped:
        pytest.skip(f"validation needs what this machine lacks: {skipped}")


def test_every_flag_cli_md_names_exists():
    """Every ``--flag`` in backticks in docs/cli.md (code spans and blocks) is an option of some subcommand."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    known = {o for sub in SUBPARSERS for o in _options(sub)} | set(_PARSER._option_string_actions)  # --version
    bad = []
    for span in re.finditer(r"```.*?```|`[^`]+`", text, re.S):
        for f in _FLAG.finditer(span.group(0)):
            if f.group(0) not in known:
                bad.append(f"docs/cli.md:{text.count(chr(10), 0, span.start() + f.start()) + 1}: {f.group(0)}")
    assert not bad, bad
