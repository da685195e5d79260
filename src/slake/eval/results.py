"""The results store: one JSON object per (sample, method, budget) in ``DIR/results.jsonl``.

Rows are appended and flushed one at a time, so an interrupted run loses at most the row being written; a
truncated last line (a crash mid-write) is cut off when the file is opened again. A row is identified by
:func:`row_key`; a resumed run skips every key already present.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, TextIO

__all__ = ["RESULTS_FILE", "ROW_FIELDS", "FULL_METHOD", "ResultsWriter", "read_results", "row_key", "budget_label"]

RESULTS_FILE = "results.jsonl"

#: The method name of the full-cache reference row (its ``budget`` is None).
FULL_METHOD = "full"

#: Fields every row has (more may follow: ``compressed``, ``compress_s``, ``new_tokens``, ``depth`` ...).
ROW_FIELDS: tuple[str, ...] = (
    "suite", "task", "sample_id", "model", "method", "budget", "length", "prompt_tokens", "prediction",
    "answers", "score", "prefill_s", "decode_s", "seed", "query_aware",
)

RowKey = tuple[str, str, str, Any, int, str, Any]


def row_key(row: dict[str, Any]) -> RowKey:
    """``(task, sample_id, method, budget, length, model, prefill_chunk)``: what identifies a row for resuming.

    ``budget`` is None for the full-cache reference row, else the integer token budget or the float ratio.
    ``prefill_chunk`` is None for exact prefill (rows written before chunked prefill existed have no such field).
    """
    budget = row.get("budget")
    if isinstance(budget, float) and budget.is_integer() and budget >= 1:
        budget = int(budget)
    return (str(row["task"]), str(row["sample_id"]), str(row["method"]), budget, int(row["length"]),
            str(row["model"]), row.get("prefill_chunk"))


def budget_label(budget: Any) -> str:
    """``"full"`` for the reference row (None), else the budget as written (``"128"``, ``"0.25"``)."""
    return "full" if budget is None else str(budget)


def _repair_tail(path: Path) -> None:
    """Cut a partial last line (a write interrupted before its newline)."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        fh.truncate(data.rfind(b"\n") + 1)


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All rows of a results file (a directory means its ``results.jsonl``); lines that are not JSON are skipped.

    Returns an empty list when the file does not exist.
    """
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_FILE
    if not p.is_file():
        return []
    rows = []
    with open(p, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


class ResultsWriter:
    """Append rows to ``DIR/results.jsonl``, flushing each one; knows which keys are done.

    Parameters
    ----------
    out_dir : path-like
        Output directory, created if needed.
    """

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / RESULTS_FILE
        if self.path.is_file():
            _repair_tail(self.path)
        self.done: set[RowKey] = {row_key(r) for r in read_results(self.path) if _has_key(r)}
        self._fh: TextIO | None = None

    def __contains__(self, key: RowKey) -> bool:
        return key in self.done

    def write(self, row: dict[str, Any]) -> bool:
        """Append ``row`` unless its key is already present; returns whether it was written."""
        key = row_key(row)
        if key in self.done:
            return False
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._fh.flush()
        self.done.add(key)
        return True

    def write_all(self, rows: Iterable[dict[str, Any]]) -> int:
        """Append several rows; returns how many were new."""
        return sum(self.write(r) for r in rows)

    def close(self) -> None:
        """Close the file (rows are already flushed)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _has_key(row: dict[str, Any]) -> bool:
    try:
        row_key(row)
    except (KeyError, TypeError, ValueError):
        return False
    return True
