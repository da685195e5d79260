"""Suites for ``slake eval``: which tasks a suite has, validation before the model loads, and sample building.

* ``needle``: a needle-in-a-haystack grid, every (length, depth) cell ``samples`` times; the only suite that
  takes ``depths``.
* ``ruler``: the 13 RULER tasks (:data:`slake.eval.ruler.RULER_TASKS`), ``samples`` per (task, length); NIAH
  needles at random depths, as in RULER.
* ``longbench``: LongBench v1 datasets from official JSONL files; a length is the middle-truncation maximum.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slake.eval.sample import Sample

__all__ = [
    "SUITES",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "SuitePlan",
    "plan_suite",
    "build_samples",
    "parse_ints",
    "parse_floats",
]

SUITES: tuple[str, ...] = ("needle", "ruler", "longbench")
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 25.0, 50.0, 75.0, 100.0)
DEFAULT_LENGTHS: dict[str, tuple[int, ...]] = {"needle": (1024, 2048, 4096), "ruler": (2048,), "longbench": (4096,)}
DEFAULT_SAMPLES: dict[str, int | None] = {"needle": 1, "ruler": 5, "longbench": None}


def parse_ints(text: str | Sequence[int], what: str, minimum: int = 1) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``; raises ValueError naming ``what`` on bad input."""
    items = [t.strip() for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{what} must be integers >= {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


def parse_floats(text: str | Sequence[float], what: str, low: float, high: float) -> list[float]:
    """``"0,50,100"`` -> ``[0.0, 50.0, 100.0]`` within ``[low, high]``."""
    items = [t.strip() for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{what} must lie in [{low:g}, {high:g}], got {text!r}")
    return list(dict.fromkeys(values))


@dataclass
class SuitePlan:
    """A validated suite request (no model needed); LongBench records are already loaded."""

    suite: str
    tasks: list[str]
    lengths: list[int]
    samples: int | None
    seed: int = 0
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    longbench_records: dict[str, list[Any]] = field(default_factory=dict)


def _longbench_available(directory: str | os.PathLike[str]) -> list[str]:
    from slake.eval.longbench_config import LONGBENCH_DATASETS, LONGBENCH_E_DATASETS

    base = Path(directory)
    return [
        d
        for d in (*LONGBENCH_DATASETS, *LONGBENCH_E_DATASETS)
        if (base / f"{d}.jsonl").is_file() or (base / "data" / f"{d}.jsonl").is_file()
    ]


def plan_suite(
    suite: str,
    tasks: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    samples: int | None = None,
    seed: int = 0,
    depths: Sequence[float] | None = None,
    longbench_dir: str | os.PathLike[str] | None = None,
    longbench_hub: bool = False,
) -> SuitePlan:
    """Validate a suite request before any model is loaded.

    For LongBench, ``longbench_dir`` (or ``$SLAKE_LONGBENCH_DIR``) holds the official JSONL files; with
    ``longbench_hub`` the datasets missing there are read from the hub's ``data.zip``
    (:func:`slake.eval.longbench.load_longbench`), and no ``tasks`` means the 21 LongBench v1 datasets.

    ``depths`` (``--depths``) is for the needle suite only: a RULER NIAH sample's depths are random, as in
    RULER (its task scores average over depths, the summary has no depth axis for them), and a LongBench
    context is a given text; either refuses them rather than ignoring them.

    Parameters
    ----------
    suite : str
        One of :data:`SUITES`.
    tasks : sequence of str, optional
        Tasks of the suite (RULER tasks, LongBench datasets); all of them by default.
    lengths : sequence of int, optional
        Target lengths in tokens, integers ``>= 1`` (a repeated one is kept once); :data:`DEFAULT_LENGTHS` of the
        suite when None (an empty sequence is refused).
    samples : int, optional
        Samples per (task, length) cell, an integer ``>= 1``; the suite's default when None (every LongBench
        record).
    seed : int
        Seed of the first sample.
    depths : sequence of float, optional
        Needle depths in percent, each in ``[0, 100]`` (a repeated one is kept once); needle suite only,
        :data:`DEFAULT_DEPTHS` when None (an empty sequence is refused).
    longbench_dir : path-like, optional
        Directory of the official LongBench JSONL files.
    longbench_hub : bool
        Read the LongBench datasets missing locally from the hub.

    Returns
    -------
    SuitePlan

    Raises
    ------
    ValueError
        Unknown suite or task; ``samples`` or a length that is not an integer ``>= 1``, a ``seed`` that is no
        integer, a depth that is no number in ``[0, 100]`` (a bool is neither), an empty ``lengths`` or ``depths``;
        ``depths`` for a suite other than needle; missing LongBench data.
    """
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
    if samples is not None:
        _check_int(samples, "samples (--samples)", 1)
    _check_int(seed, "seed (--seed)", None)
    lengths = _check_ints(lengths, "lengths (--lengths)", 1) if lengths is not None else None
    depths = _check_depths(depths) if depths is not None else None
    n = int(samples) if samples is not None else DEFAULT_SAMPLES[suite]
    plan = SuitePlan(
        suite, [], list(lengths or DEFAULT_LENGTHS[suite]), n, int(seed), depths if depths else list(DEFAULT_DEPTHS)
    )
    if suite == "needle":
        if tasks and list(tasks) != ["needle"]:
            raise ValueError(f"the needle suite has one task, 'needle'; got {', '.join(tasks)}")
        plan.tasks = ["needle"]
    elif suite == "ruler":
        from slake.eval.ruler import RULER_TASKS

        unknown = [t for t in tasks or [] if t not in RULER_TASKS]
        if unknown:
            raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; expected some of {', '.join(RULER_TASKS)}")
        plan.tasks = list(dict.fromkeys(tasks)) if tasks else list(RULER_TASKS)
        _refuse_depths(suite, depths)
    else:
        _plan_longbench(plan, tasks, longbench_dir, longbench_hub, depths)
    return plan


def _check_int(value: Any, what: str, minimum: int | None) -> None:
    """Refuse ``value`` unless it is an integer (a bool is not) at least ``minimum``, naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")


def _check_ints(values: Any, what: str, minimum: int) -> list[int]:
    """``values`` as a list of plain ints; ValueError naming ``what`` unless they are integers at least ``minimum``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{what} must be a sequence of integers, got {values!r}")
    items = list(values)
    if not items:  # names nothing: not the default, which is asked by leaving the argument out (None)
        raise ValueError(f"{what} must name at least one integer, got none")
    for v in items:
        _check_int(v, f"each of {what}", minimum)
    return list(dict.fromkeys(int(v) for v in items))  # a repeated value once, as parse_ints keeps it


def _check_depths(depths: Any) -> list[float]:
    """``depths`` as a list of floats; ValueError unless each is a real number (a bool is not) in ``[0, 100]``."""
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Iterable):
        raise ValueError(f"depths (--depths) must be a sequence of numbers in [0, 100], got {depths!r}")
    items = list(depths)
    if not items:  # names nothing: not the default, which is asked by leaving the argument out (None)
        raise ValueError("depths (--depths) must name at least one number in [0, 100], got none")
    for d in items:
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 <= float(d) <= 100:
            raise ValueError(f"each of depths (--depths) must be a number in [0, 100] (percent), got {d!r}")
    return list(dict.fromkeys(float(d) for d in items))  # a repeated depth once, as parse_floats keeps it


def _refuse_depths(suite: str, depths: Sequence[float] | None) -> None:
    """Refuse ``--depths`` for a suite that cannot honour it rather than ignore it."""
    if not depths:
        return
    why = (
        "RULER's NIAH tasks put each sample's needles at random depths, as RULER does, and score a task over all "
        "depths; use --suite needle for a depth x length grid"
        if suite == "ruler"
        else "LongBench's contexts are given texts"
    )
    raise ValueError(f"--depths applies to the needle suite only, not to {suite}: {why}")


def _plan_longbench(
    plan: SuitePlan, tasks: Sequence[str] | None, longbench_dir: Any, hub: bool, depths: Sequence[float] | None
) -> None:
    from slake.eval.longbench import LONGBENCH_DIR_ENV, load_longbench
    from slake.eval.longbench_config import LONGBENCH_DATASETS, LONGBENCH_E_DATASETS

    known = (*LONGBENCH_DATASETS, *LONGBENCH_E_DATASETS)
    unknown = [t for t in tasks or [] if t not in known]
    if unknown:
        raise ValueError(f"unknown LongBench dataset(s) {', '.join(unknown)}; expected some of {', '.join(known)}")
    directory = longbench_dir or os.environ.get(LONGBENCH_DIR_ENV)
    if directory is None and not hub:
        raise ValueError(
            f"the longbench suite needs the official JSONL files: pass --longbench-dir DIR, set "
            f"{LONGBENCH_DIR_ENV}, or add --longbench-hub to download them (needs network)"
        )
    if directory is not None and not Path(directory).is_dir():
        raise ValueError(f"LongBench directory not found: {directory}")
    if tasks:
        plan.tasks = list(dict.fromkeys(tasks))
    elif hub:
        plan.tasks = list(LONGBENCH_DATASETS)
    else:
        plan.tasks = _longbench_available(directory or ".")
    if not plan.tasks:
        raise ValueError(f"no LongBench <dataset>.jsonl file in {directory}")
    _refuse_depths(plan.suite, depths)
    from slake.eval.metrics import check_scorable

    check_scorable(plan.tasks)
    for task in plan.tasks:
        plan.longbench_records[task] = load_longbench(task, directory, use_hub=hub, limit=plan.samples)


def build_samples(plan: SuitePlan, tokenizer: Any, *, essays: Sequence[str] | None = None) -> list[Sample]:
    """Generate (needle, RULER) or format (LongBench) the samples of ``plan`` with the model's tokenizer.

    Every sample has ``metadata["target_length"]`` (the row's ``length``).  A needle cell's sample depends on
    its length, depth and sample number (:func:`slake.eval.needle.needle_cell_seed`), not on the other
    lengths and depths asked.

    Parameters
    ----------
    plan : SuitePlan
        A validated request (:func:`plan_suite`).
    tokenizer : TokenizerLike
        The model's tokenizer; lengths count its tokens.
    essays : sequence of str, optional
        Haystack essays for the needle and essay-based RULER tasks; Paul Graham's essays by default.

    Returns
    -------
    list of Sample
        Needle: per sample number, length and depth; RULER: per task, length and seed; LongBench: per dataset,
        length and record.

    Raises
    ------
    LengthFitError
        When a sample cannot be fitted to its length; the message names the task, length and seed.
    """
    out: list[Sample] = []
    n = plan.samples or 1
    if plan.suite == "needle":
        from slake.eval.needle import needle_grid

        if essays is None:
            from slake.eval.data_sources import paul_graham_essays

            essays = paul_graham_essays()
        for k in range(n):
            for length in sorted(plan.lengths):
                out += needle_grid(tokenizer, [length], plan.depths, seed=plan.seed + k, essays=essays)
    elif plan.suite == "ruler":
        from slake.eval.ruler import ruler_samples

        extra: dict[str, Any] = {"essays": essays} if essays is not None else {}
        for task in plan.tasks:
            for length in sorted(plan.lengths):
                out += ruler_samples(task, tokenizer, length, n, seed=plan.seed, **extra)
    else:
        from slake.eval.longbench import longbench_samples

        for task in plan.tasks:
            for length in sorted(plan.lengths):
                for sample in longbench_samples(plan.longbench_records[task], tokenizer, length, dataset=task):
                    sample.metadata["target_length"] = length
                    out.append(sample)
    return out
