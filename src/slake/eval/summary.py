"""Summaries derived from ``results.jsonl``: ``summary.md``, ``summary.csv``, ``intervals.csv``, ``paired.csv``
and the ``--json`` rows.

A table per (model, suite, context length), plus one over all lengths when a suite has several: one line per
(method, budget), the full-cache reference first, one column per task with the mean score in percent, then the
average over tasks (the mean of the task columns), its bootstrap confidence interval over samples
(:mod:`slake.eval.stats`) and ``n``, the number of rows behind the line. Under each table, every method is compared
with the best method at the same budget on the samples both were scored on (a paired bootstrap), and the
differences whose interval excludes 0 are marked. ``intervals.csv`` holds the interval of every cell (each task and
the average); ``paired.csv`` every paired comparison of two methods at one budget.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slake.eval.fidelity_summary import fidelity_csv_rows, fidelity_markdown, fidelity_tables
from slake.eval.results import FULL_METHOD, budget_label, canonical_budget, read_results, summary_view
from slake.eval.stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    Interval,
    PairedDifference,
    line_interval,
    paired_difference,
    score_table,
)

__all__ = [
    "SummaryLine",
    "budget_sort_key",
    "table_strata",
    "complete_pairs",
    "SummaryTable",
    "summary_rows",
    "summary_tables",
    "write_summary",
    "method_budget_order",
    "task_order",
]

ALL_LENGTHS = "all"


def budget_sort_key(budget: Any) -> tuple[int, float]:
    """A budget's place in the tables: the full cache (None) first, then token budgets, then ratios, ascending (a
    whole float of tokens, ``128.0``, is the token budget 128: :func:`slake.eval.results.canonical_budget`)."""
    if budget is None:
        return (0, 0.0)
    budget = canonical_budget(budget)
    return (1, float(budget)) if isinstance(budget, int) else (2, float(budget))


def method_budget_order(rows: Iterable[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Distinct (method, budget) pairs: the full reference first, then methods in order of first appearance,
    budgets ascending (token budgets, then ratios)."""
    methods: list[str] = []
    budgets: dict[str, set] = defaultdict(set)
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
        budgets[r["method"]].add(r.get("budget"))
    methods.sort(key=lambda m: m != FULL_METHOD)  # stable: keeps first-appearance order otherwise
    return [(m, b) for m in methods for b in sorted(budgets[m], key=budget_sort_key)]


def task_order(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Distinct tasks: RULER's tasks in the RULER paper's order, then any other task in order of first appearance
    (runs split over several processes append their tasks interleaved)."""
    from slake.eval.ruler import RULER_TASKS

    out: list[str] = []
    for r in rows:
        if r["task"] not in out:
            out.append(r["task"])
    rank = {t: i for i, t in enumerate(RULER_TASKS)}
    return sorted(out, key=lambda t: (0, rank[t]) if t in rank else (1, out.index(t)))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, suite, task, length, method, budget) with ``n`` and the mean ``score`` in percent.

    Keys: ``suite``, ``task``, ``length``, ``method``, ``budget`` (None for the full reference), ``n``, ``score``
    (0-100, rounded to 2 decimals) and ``model``. Ordered by model, suite, length, then the table order. Chunked
    prefill's rows are their own method (:func:`slake.eval.results.summary_view`). A sample counts once, as in the
    tables: a sample id written twice (a rerun appending to ``results.jsonl``) keeps its later row
    (:func:`slake.eval.stats.score_table`), so ``n`` counts samples and ``score`` is the tables' cell.

    Parameters
    ----------
    rows : iterable of dict
        Result rows (:func:`slake.eval.results.read_results`).

    Returns
    -------
    list of dict
        The summary rows, keyed as above.
    """
    rows = summary_view(rows)
    by_source: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_source[(r.get("model", ""), r.get("suite", ""))].append(r)
    groups: dict[tuple, list[float]] = {}
    for (model, suite), group in by_source.items():
        for (method, budget), strata in score_table(group).items():
            for (task, length), by_sample in strata.items():
                groups[(model, suite, task, length, method, budget)] = list(by_sample.values())
    pair_rank = {p: i for i, p in enumerate(method_budget_order(rows))}
    task_rank = {t: i for i, t in enumerate(task_order(rows))}
    keys = sorted(groups, key=lambda k: (k[0], k[1], k[3], pair_rank[(k[4], k[5])], task_rank[k[2]]))
    return [
        {
            "suite": k[1],
            "task": k[2],
            "length": k[3],
            "method": k[4],
            "budget": k[5],
            "n": len(groups[k]),
            "score": round(100.0 * _mean(groups[k]), 2),
            "model": k[0],
        }
        for k in keys
    ]


@dataclass
class SummaryLine:
    """One (method, budget) of a table.

    Attributes
    ----------
    method, budget
        The line's method spec and budget (None for the full cache).
    cells : dict
        ``{task: (mean score %, rows)}``.
    average : float
        Mean of the task cells (of the line's own tasks: see ``complete``).
    n : int
        Rows behind the line.
    interval : Interval
        ``average`` with its bootstrap interval (:func:`slake.eval.stats.line_interval`).
    task_intervals : dict
        ``{task: Interval}``, each cell's interval.
    """

    method: str
    budget: Any
    cells: dict[str, tuple[float, int]]
    average: float
    n: int
    interval: Interval
    task_intervals: dict[str, Interval] = field(default_factory=dict)
    #: the line has samples in every task column of its table and, in the all-lengths table, at every length, and
    #: there every sample a compressed line has (:func:`complete_pairs`); an incomplete line's average is over fewer
    #: tasks, lengths or samples, not comparable with the others', and it is never the best of its budget
    complete: bool = True


@dataclass
class SummaryTable:
    """One summary table: its lines, and each method's paired comparison with the best at the same budget."""

    model: str
    suite: str
    length: int | str
    tasks: list[str]
    lines: list[SummaryLine] = field(default_factory=list)
    against_best: list[PairedDifference] = field(default_factory=list)
    paired: list[PairedDifference] = field(default_factory=list)

    @property
    def title(self) -> str:
        """``suite, length L, model M``."""
        length = "all lengths" if self.length == ALL_LENGTHS else f"length {self.length}"
        return f"{self.suite or 'results'}, {length}, model {self.model}"


def table_strata(scores: dict[tuple[str, Any], dict[tuple[str, int], dict[str, float]]]) -> set[tuple[str, int]]:
    """Every (task, length) that some line of a :func:`slake.eval.stats.score_table` has a sample in: a complete
    line has a sample in each (in a table over several lengths, a line run at fewer lengths averages each task over
    fewer, and so easier or harder, prompts than the others and is not comparable with them); see
    :func:`complete_pairs`."""
    return {s for by_stratum in scores.values() for s, v in by_stratum.items() if v}


def complete_pairs(scores: dict[tuple[str, Any], dict[tuple[str, int], dict[str, float]]]) -> set[tuple[str, Any]]:
    """The lines of a :func:`slake.eval.stats.score_table` whose average is comparable with the others'.

    A line is complete when it has a sample in every (task, length) of the table (:func:`table_strata`) and, in each,
    every sample that a compressed line of the table has there (every sample some line has, in a table of the full
    cache alone). A line missing samples (a run interrupted part-way through a sample's methods, a method added later
    with a smaller ``--samples``) averages other, fewer prompts than the others: its average is not comparable with
    theirs, so it is never the best and has no point in the score-vs-budget plot. The full cache's samples do not
    enter the reference set, so a survey of the full cache on more samples than the methods leaves the methods
    comparable with each other.

    Parameters
    ----------
    scores : dict
        ``{(method, budget): {(task, length): {sample_id: value}}}``.

    Returns
    -------
    set of (str, object)
        The complete (method, budget) pairs.
    """
    strata = table_strata(scores)
    compressed = [p for p in scores if p[0] != FULL_METHOD] or list(scores)
    wanted: dict[tuple[str, int], set[str]] = defaultdict(set)
    for p in compressed:
        for s, by_sample in scores[p].items():
            wanted[s] |= set(by_sample)
    return {
        p
        for p, by_stratum in scores.items()
        if {s for s, v in by_stratum.items() if v} == strata
        and all(wanted[s] <= set(by_stratum.get(s, {})) for s in wanted)
    }


def _table(
    model: str, suite: str, length: int | str, rows: list[dict[str, Any]], resamples: int, confidence: float
) -> SummaryTable:
    tasks = task_order(rows)
    table = SummaryTable(model, suite, length, tasks)
    scores = score_table(rows)
    complete = complete_pairs(scores)
    for method, budget in method_budget_order(rows):
        by_stratum = scores[(method, budget)]
        cells: dict[str, tuple[float, int]] = {}
        task_intervals: dict[str, Interval] = {}
        for t in tasks:
            strata = {s: v for s, v in by_stratum.items() if s[0] == t and v}
            if strata:
                values = [x for v in strata.values() for x in v.values()]
                cells[t] = (100.0 * _mean(values), len(values))
                task_intervals[t] = line_interval(strata, resamples=resamples, confidence=confidence)
        interval = line_interval(by_stratum, resamples=resamples, confidence=confidence)
        table.lines.append(
            SummaryLine(
                method,
                budget,
                cells,
                interval.mean,
                interval.n,
                interval,
                task_intervals,
                (method, budget) in complete,
            )
        )
    table.paired, table.against_best = _comparisons(table, scores, resamples, confidence)
    return table


def _comparisons(
    table: SummaryTable, scores: dict, resamples: int, confidence: float
) -> tuple[list[PairedDifference], list[PairedDifference]]:
    """Every pair of methods at one budget (``a - b`` in line order), and each method against the budget's best line
    by average (``method - best``). Only a complete line (:func:`complete_pairs`: every task, length and sample of the
    table) can be the best: an average over fewer tasks, lengths or samples is not comparable; without a complete
    line at a budget, no method is compared with a best."""
    by_budget: dict[Any, list[SummaryLine]] = defaultdict(list)
    for line in table.lines:
        if line.method != FULL_METHOD:
            by_budget[line.budget].append(line)
    paired: list[PairedDifference] = []
    against_best: list[PairedDifference] = []
    for budget, lines in by_budget.items():
        if len(lines) < 2:
            continue
        complete = [line for line in lines if line.complete]
        best = max(complete, key=lambda x: x.average) if complete else None
        for i, a in enumerate(lines):
            for b in lines[i + 1 :]:
                try:
                    d = paired_difference(
                        scores, (a.method, budget), (b.method, budget), resamples=resamples, confidence=confidence
                    )
                except ValueError:  # no common sample: nothing to compare
                    continue
                paired.append(d)
                if best is a:  # stored as (method - best): a line's distance below the best
                    against_best.append(_flipped(d))
                elif best is b:
                    against_best.append(d)
    rank = {(line.method, line.budget): i for i, line in enumerate(table.lines)}
    against_best.sort(key=lambda d: (budget_sort_key(d.a[1]), rank[d.a]))
    return paired, against_best


def _flipped(d: PairedDifference) -> PairedDifference:
    """``b - a`` from ``a - b``."""
    return PairedDifference(d.b, d.a, 0.0 - d.diff, 0.0 - d.high, 0.0 - d.low, d.p_value, d.n, d.confidence)


def summary_tables(
    rows: Iterable[dict[str, Any]],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> list[SummaryTable]:
    """The tables of :func:`write_summary`, per (model, suite, length), plus an all-lengths table per suite with
    several lengths; intervals from ``resamples`` bootstrap replicates at ``confidence``. Chunked prefill's rows are
    their own method (:func:`slake.eval.results.summary_view`)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in summary_view(rows):
        groups[(str(r.get("model", "")), str(r.get("suite", "")))].append(r)
    tables = []
    for (model, suite), group in groups.items():
        lengths = sorted({int(r["length"]) for r in group})
        for length in lengths:
            subset = [r for r in group if int(r["length"]) == length]
            tables.append(_table(model, suite, length, subset, resamples, confidence))
        if len(lengths) > 1:
            tables.append(_table(model, suite, ALL_LENGTHS, group, resamples, confidence))
    return tables


def _fmt(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN -> "-"


def _ci(i: Interval) -> str:
    return f"[{i.low:.1f}, {i.high:.1f}]" if i.measured else "-"  # one sample per stratum: no interval


def _line_name(pair: tuple[str, Any]) -> str:
    return f"{pair[0]} @ {budget_label(pair[1])}"


def _markdown(tables: list[SummaryTable], confidence: float) -> str:
    level = f"{100 * confidence:g}%"
    out = [
        "# slake evaluation summary",
        "",
        "Mean score in percent per task; `average` is the mean of the task columns, with its "
        f"{level} bootstrap interval over samples (samples resampled within each task and length); `n` counts the "
        "rows (samples) behind each line. Budget `full` is the uncompressed reference. Under each table, every "
        "method is compared with the best method at its budget on the samples both have (paired bootstrap of the "
        "difference of averages); **bold** differences have an interval that excludes 0. Few samples per task "
        "make the intervals too narrow rather than too wide (see `slake.eval.stats`); with a single sample in each "
        "task and length there is no interval (`-`) and no difference is called significant. An average marked † is "
        "over the line's own tasks (and, over all lengths, its own lengths), fewer than the table's, or misses samples "
        "that other methods' lines have (compare `n`): it is not comparable with the others and never the best.",
        "",
    ]
    for t in tables:
        out += [f"## {t.title}", ""]
        header = ["method", "budget", *t.tasks, "average", f"{level} CI", "n"]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join(["---", "---:"] + ["---:"] * (len(t.tasks) + 3)) + "|")
        for line in t.lines:
            vals = [_fmt(line.cells[task][0]) if task in line.cells else "" for task in t.tasks]
            out.append(
                "| "
                + " | ".join(
                    [
                        line.method,
                        budget_label(line.budget),
                        *vals,
                        _fmt(line.average) + ("" if line.complete else " †"),
                        _ci(line.interval),
                        str(line.n),
                    ]
                )
                + " |"
            )
        out.append("")
        if t.against_best:
            out += [
                f"Paired against the best method at each budget ({t.title}):",
                "",
                f"| budget | method | best | difference (points) | {level} CI | p | common samples |",
                "|---:|---|---|---:|---:|---:|---:|",
            ]
            for d in t.against_best:
                ci, p = (f"[{d.low:+.1f}, {d.high:+.1f}]", f"{d.p_value:.3f}") if d.measured else ("-", "-")
                out.append(
                    f"| {budget_label(d.a[1])} | {d.a[0]} | {d.b[0]} | {_bold(f'{d.diff:+.1f}', d.significant)} | "
                    f"{ci} | {p} | {d.n} |"
                )
            out.append("")
    if not tables:
        out.append("No results yet.")
    return "\n".join(out) + "\n"


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _csv_rows(tables: list[SummaryTable]) -> tuple[list[str], list[dict[str, Any]]]:
    tasks: list[str] = []
    for t in tables:
        tasks += [x for x in t.tasks if x not in tasks]
    header = [
        "model",
        "suite",
        "length",
        "method",
        "budget",
        *tasks,
        "average",
        "average_low",
        "average_high",
        "n",
        "all_tasks",
    ]
    body = []
    for t in tables:
        for line in t.lines:
            row: dict[str, Any] = {
                "model": t.model,
                "suite": t.suite,
                "length": t.length,
                "method": line.method,
                "budget": budget_label(line.budget),
                "average": round(line.average, 2),
                "average_low": round(line.interval.low, 2),
                "average_high": round(line.interval.high, 2),
                "n": line.n,
                "all_tasks": line.complete,
            }
            row.update({task: round(line.cells[task][0], 2) for task in line.cells})
            body.append(row)
    return header, body


def _interval_rows(tables: list[SummaryTable]) -> list[dict[str, Any]]:
    out = []
    for t in tables:
        for line in t.lines:
            cells = [*line.task_intervals.items(), ("average", line.interval)]
            for task, i in cells:
                out.append(
                    {
                        "model": t.model,
                        "suite": t.suite,
                        "length": t.length,
                        "method": line.method,
                        "budget": budget_label(line.budget),
                        "task": task,
                        "mean": round(i.mean, 2),
                        "low": round(i.low, 2),
                        "high": round(i.high, 2),
                        "n": i.n,
                        "confidence": i.confidence,
                    }
                )
    return out


def _paired_rows(tables: list[SummaryTable]) -> list[dict[str, Any]]:
    return [
        {
            "model": t.model,
            "suite": t.suite,
            "length": t.length,
            "budget": budget_label(d.a[1]),
            "a": d.a[0],
            "b": d.b[0],
            "diff": round(d.diff, 2),
            "low": round(d.low, 2),
            "high": round(d.high, 2),
            "p_value": round(d.p_value, 4),
            "significant": d.significant,
            "n": d.n,
            "confidence": d.confidence,
        }
        for t in tables
        for d in t.paired
    ]


def _write_csv(path: Path, header: list[str], body: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(body)


def write_summary(
    out_dir: str | os.PathLike[str],
    rows: Iterable[dict[str, Any]] | None = None,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> tuple[Path, Path]:
    """Write ``DIR/summary.md``, ``DIR/summary.csv``, ``DIR/intervals.csv`` and ``DIR/paired.csv`` from ``rows``
    (default: ``DIR/results.jsonl``); with ``--fidelity`` rows also the KL section of ``summary.md`` and
    ``DIR/fidelity.csv`` (:mod:`slake.eval.fidelity_summary`).

    Parameters
    ----------
    out_dir : path-like
        The results folder.
    rows : iterable of dict, optional
        The rows to summarise.
    resamples : int
        Bootstrap replicates of every interval.
    confidence : float
        Level of the intervals, in (0, 1).

    Returns
    -------
    (Path, Path)
        The markdown and CSV paths.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rows = summary_view(read_results(directory) if rows is None else rows)
    tables = summary_tables(rows, resamples=resamples, confidence=confidence)
    md, csv_path = directory / "summary.md", directory / "summary.csv"
    kl_tables = fidelity_tables(rows, resamples=resamples, confidence=confidence)
    kl_md = fidelity_markdown(kl_tables, confidence)
    md.write_text(_markdown(tables, confidence) + ("\n" + kl_md if kl_md else ""), encoding="utf-8")
    if kl_tables:
        kl_rows = fidelity_csv_rows(kl_tables)
        _write_csv(directory / "fidelity.csv", list(kl_rows[0]), kl_rows)
    header, body = _csv_rows(tables)
    _write_csv(csv_path, header, body)
    intervals = _interval_rows(tables)
    _write_csv(directory / "intervals.csv", list(intervals[0]) if intervals else ["model"], intervals)
    paired = _paired_rows(tables)
    _write_csv(directory / "paired.csv", list(paired[0]) if paired else ["model"], paired)
    return md, csv_path
