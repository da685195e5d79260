"""Argument checks of the ``slake`` command.

:func:`validate_args` is the command line's single validation pass: ``slake.cli.main`` calls it on the parsed
arguments of every sub-command before anything slow happens (no model or tokenizer is loaded, no file or folder is
written). Every problem is a ``ValueError`` whose message names the option (and the file) at fault; the entry point
prints it as one line and exits with code 2.

The checks it shares with the Python API live below the command line and are used by both, so that both report a
bad device or a bad (method, budget) pair the same way: :func:`slake.engines.transformers.models.check_device` and
:func:`slake.methods.budget_check.check_method_budget`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from slake.cli.options import check_out_folder, engine_from_args, method_overrides, refuse_duplicates, split_list
from slake.engines.transformers.models import check_device
from slake.methods.budget_check import check_budget_at_length, check_method_budget

__all__ = ["fidelity_grid", "read_prompt", "read_text", "refuse_empty", "refuse_unchunkable", "validate_args"]

#: options whose value names something (a list, a file or folder, a shape, a storage): an empty value is refused, never
#: read as the option left out (``--tasks ''`` ran every task, ``--random-model ''`` loaded the packaged model)
NOT_EMPTY = (
    "tasks", "lengths", "depths", "out", "out_dir", "prefill_cache", "longbench_dir", "kv_dtype", "random_model",
    "prompt_file", "model", "gguf_file",
)  # fmt: skip


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text file's content, without a leading byte-order mark; errors name the file (missing, a directory,
    unreadable, not UTF-8)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {p} is a directory, not a file")
    if not p.is_file():
        raise ValueError(f"{what} not found: {p}")
    try:
        return p.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {p} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt text from ``--prompt`` or ``--prompt-file`` (``-`` = standard input); refuses an empty prompt and
    one that is not UTF-8 (standard input's bytes are decoded strictly, whatever the locale; ``--prompt`` text holding
    lone surrogates is an argument whose bytes were not UTF-8)."""
    if prompt is not None:
        text = prompt
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt given with --prompt is not UTF-8 text (character {e.start})") from None
    elif prompt_file == "-":
        try:
            # universal newlines, as a text stream and read_text read them
            text = _stdin_bytes().decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
        except UnicodeDecodeError as e:
            raise ValueError(f"the prompt on standard input is not UTF-8 text (byte {e.start}: {e.reason})") from None
    else:
        text = read_text(str(prompt_file), "prompt file")
    if not text.strip():
        raise ValueError(f"the prompt{f' file {prompt_file}' if prompt is None else ''} is empty")
    return text


def _stdin_bytes() -> bytes:
    """Standard input's bytes: read from its binary buffer, or (a text stream without one, as tests substitute)
    its text encoded back with the surrogates that stand for undecodable bytes."""
    buffer = getattr(sys.stdin, "buffer", None)
    return buffer.read() if buffer is not None else sys.stdin.read().encode("utf-8", "surrogateescape")


def refuse_empty(args: argparse.Namespace, names: tuple[str, ...] = NOT_EMPTY) -> None:
    """Refuse (ValueError naming the flag) an option of ``names`` given an empty or blank value: left out, it has a
    default; given empty, it names nothing, and reading it as left out would run what was not asked.

    Parameters
    ----------
    args : argparse.Namespace
        A parsed command line; options it does not have are skipped.
    names : tuple of str
        The attribute names to check (``--kv-dtype`` is ``kv_dtype``).
    """
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} is empty ({value!r}); give it a value or leave {flag} out")


#: seeds run from 0 to this, excluded (torch's generators take 64 bits)
SEED_LIMIT = 2**64


def _at_least(args: argparse.Namespace, name: str, low: int) -> None:
    value = getattr(args, name, None)
    if value is not None and value < low:
        raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def _positive(args: argparse.Namespace, name: str) -> None:
    value = getattr(args, name, None)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")


def _finite(args: argparse.Namespace, name: str, low: float, high: float, low_open: bool = True) -> None:
    value = getattr(args, name, None)
    if value is None:
        return
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"--{name.replace('_', '-')} must lie in {bracket}{low}, {high}], got {value}")


def _pairs(methods: list[str], budgets: list[Any]) -> None:
    for m in methods:
        for b in budgets:
            check_method_budget(m, b)


def refuse_unchunkable(methods: list[Any], prefill_chunk: int | None) -> None:
    """Refuse (ValueError) ``--prefill-chunk`` with methods that cannot prefill in chunks (KVzip's second pass,
    SAGE-KV's one-shot selection: :func:`slake.cache.chunked.check_chunkable`), naming every such method, before any
    model work: a sweep would otherwise stop when it reaches the first of them."""
    if prefill_chunk is None:
        return
    from slake.cache.chunked import check_chunkable
    from slake.methods.base import Method, make_method

    problems = []
    for m in methods:
        try:
            check_chunkable(m if isinstance(m, Method) else make_method(m))
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError(f"--prefill-chunk: {'; '.join(problems)}")


def _check_common(args: argparse.Namespace) -> None:
    from slake.engines.transformers.models import default_device, parse_dtype

    refuse_empty(args)
    check_device(getattr(args, "device", None))
    if getattr(args, "dtype", None) is not None:
        args.dtype = args.dtype.strip().lower()  # --dtype BF16 as bf16, for either engine
        parse_dtype(args.dtype, args.device or default_device())
    _at_least(args, "max_new_tokens", 1)
    _at_least(args, "prefill_chunk", 1)
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        # torch's generators take 64 bits: a larger seed failed after the model loaded, without naming the option
        raise ValueError(f"--seed must be an integer from 0 to 2**64 - 1, got {seed}")
    if getattr(args, "kernels", None) == "triton":
        from slake.cache.compressed import resolve_kernels

        # loads the kernels now, before the model's import of transformers imports Triton: on a machine without CUDA
        # that is when Triton's interpreter can still be switched on (Triton missing, or CPU tensors on a machine
        # where Triton compiles for a GPU, is refused here)
        resolve_kernels("triton", getattr(args, "device", None))


def fidelity_grid(args: argparse.Namespace) -> tuple[list[str], list[int | float], list[str | None]]:
    """The methods, budgets and key/value storages of a ``slake fidelity`` command line, each given once.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments of :func:`slake.cli.fidelity.add_fidelity_parser` (``--methods``, ``--budgets``,
        ``--kv-dtype``, ``--linear-cache``).

    Returns
    -------
    tuple
        The method specs, the budget values and the ``kv_dtype`` names (None for the model's dtype).

    Raises
    ------
    ValueError
        For a bad item, an empty ``--kv-dtype``, or an item given twice (the same canonical method spec, with
        ``linear_cache`` left out where ``--linear-cache`` forces it; the same budget value; the same storage): it
        would be measured twice and reported twice under one name.
    """
    from slake.budgets.budget import Budget
    from slake.cache.quant import parse_kv_dtype
    from slake.methods.base import canonical_method_spec, parse_method_list

    methods = parse_method_list(args.methods)
    forced = ("linear_cache",) if getattr(args, "linear_cache", "default") != "default" else ()
    refuse_duplicates("--methods", methods, [canonical_method_spec(m, drop=forced) for m in methods])
    budget_texts = split_list(args.budgets, "--budgets")
    budgets = [Budget(b).value for b in budget_texts]
    refuse_duplicates("--budgets", budget_texts, budgets)
    kv_texts = split_list("auto" if args.kv_dtype is None else args.kv_dtype, "--kv-dtype")
    kv_dtypes = [parse_kv_dtype(k) for k in kv_texts]
    refuse_duplicates("--kv-dtype", kv_texts, kv_dtypes)
    return methods, budgets, kv_dtypes


def _check_generate(args: argparse.Namespace) -> None:
    from slake.budgets.budget import Budget
    from slake.methods.base import make_method

    hyper = method_overrides(args)
    method = make_method(args.method, **hyper)
    check_method_budget(method, Budget(args.budget))
    refuse_unchunkable([method], args.prefill_chunk)
    if args.sample:
        _positive(args, "temperature")
        _finite(args, "top_p", 0.0, 1.0)
    else:
        given = [f"--{n.replace('_', '-')}" for n in ("temperature", "top_p") if getattr(args, n) is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{' and '.join(given)} only {verb} with --sample (decoding is greedy without it)")
    # read once here (standard input cannot be read twice); cmd_generate uses args.prompt
    args.prompt = read_prompt(args.prompt, args.prompt_file)
    args.prompt_file = None


def _check_fidelity(args: argparse.Namespace) -> None:
    from slake.methods.base import make_method

    methods, budgets, _ = fidelity_grid(args)
    forced: dict[str, list[bool]] = {"on": [True], "off": [False], "both": [False, True]}
    for lin in forced.get(str(getattr(args, "linear_cache", "default")), []):
        for m in methods:  # forced on every method: one that cannot take it (full) fails here, before the model loads
            make_method(m, linear_cache=lin)
    _pairs(methods, budgets)
    _at_least(args, "steps", 1)
    if args.prompt_file is not None:
        args.prompt_text = read_prompt(None, args.prompt_file)
    else:
        _at_least(args, "length", 2)
    output_tokens, output_samples = getattr(args, "output_tokens", 0), getattr(args, "output_samples", 1)
    if output_tokens < 0 or output_tokens == 1 or output_samples < 1:
        raise ValueError("--output-tokens must be 0 (skip) or >= 2, and --output-samples >= 1")
    if output_tokens:
        # the output level's prompts are --length tokens of essay with or without --prompt-file, and need 64
        if getattr(args, "length", 64) < 64:
            raise ValueError(
                f"--length must be >= 64 for the output level's prompts, got {args.length} (--output-tokens 0 skips "
                "the output level)"
            )
    if args.prompt_file is None or output_tokens:
        # a ratio of the --length-token prompts (the generated document, the output level's prompts with or without
        # --prompt-file), before the model loads: with --prompt-file the output level failed after the attention level
        for m in methods:
            for b in budgets:
                check_budget_at_length(m, b, args.length)


def _check_bench(args: argparse.Namespace) -> None:
    from slake.budgets.budget import Budget
    from slake.cli.bench import bench_lengths, bench_methods, check_serve_options, check_threads

    check_threads(args.threads)
    baselines = engine_from_args(args).bench_baselines
    methods = bench_methods(args.methods, baselines)
    budgets = [Budget(b).value for b in split_list(args.budget, "--budget")]
    _pairs([m for m in methods if m != "full" and m not in baselines], budgets)
    refuse_unchunkable([m for m in methods if m != "full" and m not in baselines], args.prefill_chunk)
    check_serve_options(args)
    lengths = bench_lengths(args)
    if not getattr(args, "serve", False):  # a ratio of each length: refused before the first configuration runs
        for m in methods:
            if m != "full" and m not in baselines:
                for b in budgets:
                    for n in lengths:
                        check_budget_at_length(m, b, n)
    if args.random_model is not None:
        from slake.engines.transformers.shapes import parse_shape

        parse_shape(args.random_model)
    check_out_folder(args.out)


def _check_eval(args: argparse.Namespace) -> None:
    pass  # cmd_eval validates its own arguments before loading the model; device and dtype are checked above


_CHECKS = {"generate": _check_generate, "fidelity": _check_fidelity, "bench": _check_bench, "eval": _check_eval}


def validate_args(args: argparse.Namespace) -> None:
    """Check a parsed ``slake`` command line before any model load; raise ValueError naming the problem.

    Checked for every command that has them: an empty value of an option of :data:`NOT_EMPTY` (never read as the
    option left out), ``--device`` (parsable and present on this machine), ``--dtype``,
    ``--max-new-tokens >= 1``, ``--prefill-chunk >= 1``, ``--kernels triton`` (Triton installed and able to run on
    the device; the kernels are loaded here, through Triton's interpreter on a machine without CUDA). ``generate``:
    the method, its ``--set`` hyperparameters and the budget (a window larger than the budget is refused),
    ``--temperature`` and ``--top-p`` (checked when sampling, refused without ``--sample``), and the prompt (missing,
    a directory, empty or not UTF-8: a file, standard input or ``--prompt``).
    ``fidelity``: methods (each with the ``--linear-cache`` setting it forces), budgets and their pairs, each given
    once (:func:`fidelity_grid`), ``--steps``, ``--length``, the prompt file. ``bench``: ``--threads`` from 1 to
    ``os.cpu_count()``, methods, budgets and their pairs, ``--lengths``, ``--random-model`` (unknown shapes, config
    keys, a key given twice), ``--out`` (not a file, writable); the engine's own baselines
    (``Engine.bench_baselines``) are accepted among the methods.
    """
    _check_common(args)
    check = _CHECKS.get(str(getattr(args, "command", "")))
    if check is not None:
        check(args)
