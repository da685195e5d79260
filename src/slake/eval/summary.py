"""Summaries derived from ``results.jsonl``: ``summary.md``, ``summary.csv`` and the ``--json`` rows.

A table per (model, suite, context length), plus one over all lengths when a suite has several: one line per
(method, budget), the full-cache reference first, one column per task with the mean score in percent, then the
average over tasks (the mean of the task columns) and ``n``, the number of rows behind the line.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slake.eval.results import FULL_METHOD, budget_label, read_results

__all__ = ["SummaryTable", "summary_rows", "summary_tables", "write_summary", "method_budget_order", "task_order"]

ALL_LENGTHS = "all"


def _budget_sort(budget: Any) -> tuple[int, float]:
    if budget is None:
        return (0, 0.0)
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
    return [(m, b) for m in methods for b in sorted(budgets[m], key=_budget_sort)]


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
    (0-100, rounded to 2 decimals) and ``model``. Ordered by model, suite, length, then the table order.
    """
    rows = list(rows)
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        groups[
            (r.get("model", ""), r.get("suite", ""), r["task"], int(r["length"]), r["method"], r.get("budget"))
        ].append(float(r["score"]))
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
class SummaryTable:
    """One summary table: ``lines`` hold ``(method, budget, {task: (score %, n)}, average %, n)``."""

    model: str
    suite: str
    length: int | str
    tasks: list[str]
    lines: list[tuple[str, Any, dict[str, tuple[float, int]], float, int]] = field(default_factory=list)

    @property
    def title(self) -> str:
        """``suite, length L, model M``."""
        length = "all lengths" if self.length == ALL_LENGTHS else f"length {self.length}"
        return f"{self.suite or 'results'}, {length}, model {self.model}"


def _table(model: str, suite: str, length: int | str, rows: list[dict[str, Any]]) -> SummaryTable:
    tasks = task_order(rows)
    table = SummaryTable(model, suite, length, tasks)
    scores: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        scores[(r["method"], r.get("budget"), r["task"])].append(float(r["score"]))
    for method, budget in method_budget_order(rows):
        cells = {t: (100.0 * _mean(v), len(v)) for t in tasks if (v := scores.get((method, budget, t)))}
        avg = _mean([c[0] for c in cells.values()])
        table.lines.append((method, budget, cells, avg, sum(c[1] for c in cells.values())))
    return table


def summary_tables(rows: Iterable[dict[str, Any]]) -> list[SummaryTable]:
    """The tables of :func:`write_summary`, per (model, suite, length), plus an all-lengths table per suite with
    several lengths."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(str(r.get("model", "")), str(r.get("suite", "")))].append(r)
    tables = []
    for (model, suite), group in groups.items():
        lengths = sorted({int(r["length"]) for r in group})
        for length in lengths:
            tables.append(_table(model, suite, length, [r for r in group if int(r["length"]) == length]))
        if len(lengths) > 1:
            tables.append(_table(model, suite, ALL_LENGTHS, group))
    return tables


def _fmt(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN -> "-"


def _markdown(tables: list[SummaryTable]) -> str:
    out = [
        "# slake evaluation summary",
        "",
        "Mean score in percent per task; `average` is the mean of the task columns; `n` counts the rows "
        "(samples) behind each line. Budget `full` is the uncompressed reference.",
        "",
    ]
    for t in tables:
        out += [f"## {t.title}", ""]
        header = ["method", "budget", *t.tasks, "average", "n"]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join(["---", "---:"] + ["---:"] * (len(t.tasks) + 2)) + "|")
        for method, budget, cells, avg, n in t.lines:
            vals = [_fmt(cells[task][0]) if task in cells else "" for task in t.tasks]
            out.append("| " + " | ".join([method, budget_label(budget), *vals, _fmt(avg), str(n)]) + " |")
        out.append("")
    if not tables:
        out.append("No results yet.")
    return "\n".join(out) + "\n"


def _csv_rows(tables: list[SummaryTable]) -> tuple[list[str], list[dict[str, Any]]]:
    tasks: list[str] = []
    for t in tables:
        tasks += [x for x in t.tasks if x not in tasks]
    header = ["model", "suite", "length", "method", "budget", *tasks, "average", "n"]
    body = []
    for t in tables:
        for method, budget, cells, avg, n in t.lines:
            line: dict[str, Any] = {
                "model": t.model,
                "suite": t.suite,
                "length": t.length,
                "method": method,
                "budget": budget_label(budget),
                "average": round(avg, 2),
                "n": n,
            }
            line.update({task: round(cells[task][0], 2) for task in cells})
            body.append(line)
    return header, body


def write_summary(out_dir: str | os.PathLike[str], rows: Iterable[dict[str, Any]] | None = None) -> tuple[Path, Path]:
    """Write ``DIR/summary.md`` and ``DIR/summary.csv`` from ``rows`` (default: ``DIR/results.jsonl``).

    Returns
    -------
    (Path, Path)
        The markdown and CSV paths.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tables = summary_tables(read_results(directory) if rows is None else rows)
    md, csv_path = directory / "summary.md", directory / "summary.csv"
    md.write_text(_markdown(tables), encoding="utf-8")
    header, body = _csv_rows(tables)
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(body)
    return md, csv_path
