"""The results store: one JSON object per (sample, method, budget) in ``DIR/results.jsonl``.

Rows are appended and flushed one at a time, so an interrupted run loses at most the row being written. When the
file is opened again, a last line that does not parse (a crash mid-write) is cut off; a complete last row that only
lacks its newline gets one. A row is identified by :func:`row_key`; a resumed run skips every key already present.
One writer at a time: :class:`ResultsWriter` holds an exclusive lock on its directory, so a second run on the same
directory while the first is running is refused instead of appending beside it.

One reader, :func:`scan_results`, serves resuming, summaries and plots: it keeps the valid result rows
(:func:`is_result_row`) and reports every other line (not UTF-8, not JSON, not an object, missing or mistyped
fields) by line number, without ever deleting it from the file.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "RESULTS_FILE",
    "ROW_FIELDS",
    "FULL_METHOD",
    "ResultsScan",
    "ResultsWriter",
    "is_result_row",
    "read_results",
    "scan_results",
    "row_key",
    "budget_label",
    "canonical_budget",
    "summary_view",
]

RESULTS_FILE = "results.jsonl"

#: The method name of the full-cache reference row (its ``budget`` is None).
FULL_METHOD = "full"

#: Fields every row has (more may follow: ``compressed``, ``compress_s``, ``new_tokens``, ``depth`` ...).
ROW_FIELDS: tuple[str, ...] = (
    "suite",
    "task",
    "sample_id",
    "model",
    "method",
    "budget",
    "length",
    "prompt_tokens",
    "prediction",
    "answers",
    "score",
    "prefill_s",
    "decode_s",
    "seed",
    "query_aware",
)

RowKey = tuple[str, str, str, Any, int, str, Any]


def row_key(row: dict[str, Any]) -> RowKey:
    """``(task, sample_id, method, budget, length, model, prefill_chunk)``: what identifies a row for resuming.

    ``budget`` is None for the full-cache reference row, else the integer token budget or the float ratio.
    ``prefill_chunk`` is None for exact prefill (rows written before chunked prefill existed have no such field).
    """
    return (
        str(row["task"]),
        str(row["sample_id"]),
        str(row["method"]),
        canonical_budget(row.get("budget")),
        int(row["length"]),
        str(row["model"]),
        row.get("prefill_chunk"),
    )


def summary_view(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` as summaries and plots read them: a compressed row measured with chunked prefill becomes its own
    method, ``"<method> (prefill_chunk=N)"``.

    :func:`row_key` names ``prefill_chunk``, so exact and chunked rows of one method and budget share a directory
    (and the full-cache row, whose prefill is exact in both); a summary keyed by method and budget alone would put
    both in one line. Rows are copied, not changed; a row already relabelled is left as it is.
    """
    out = []
    for r in rows:
        chunk = r.get("prefill_chunk")
        if chunk is not None and r.get("budget") is not None:
            r = {**r, "method": f"{r['method']} (prefill_chunk={chunk})", "prefill_chunk": None}
        out.append(r)
    return out


def budget_label(budget: Any) -> str:
    """``"full"`` for the reference row (None), else the budget as :class:`slake.Budget` reads it (``"128"``,
    ``"0.25"``; a whole float of tokens in a hand-made row, ``128.0``, is ``"128"`` as the token count it is)."""
    return "full" if budget is None else str(canonical_budget(budget))


def canonical_budget(budget: Any) -> Any:
    """A row's budget as :class:`slake.Budget` reads it: a whole float of tokens (``128.0``, written by hand or by
    another tool) is the int ``128``, so that it sorts, labels and groups with the token budgets; None and anything
    :class:`slake.Budget` refuses are returned as they are."""
    if budget is None or isinstance(budget, bool) or not isinstance(budget, float):
        return budget
    from slake.budgets.budget import Budget

    try:
        return Budget(budget).value
    except ValueError:
        return budget


def _parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """``(row, "")`` for a valid result row, else ``(None, reason)``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None, "not JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    problem = _row_problem(obj)
    return (None, problem) if problem else (obj, "")


#: fields a row needs to be resumed and summarised (``budget`` may be null: the full-cache reference)
_REQUIRED = ("task", "sample_id", "method", "budget", "length", "model", "score")


def _row_problem(row: dict[str, Any]) -> str:
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        return f"missing {', '.join(missing)}"
    length, score, budget = row["length"], row["score"], row["budget"]
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not float(length).is_integer():
        return f"length is not an integer ({length!r})"
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return f"score is not a number ({score!r})"
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or not _valid_budget(budget)
    ):
        # NaN passed a plain ``> 0`` test: each such row became a line of its own (NaN != NaN) and was never resumed
        return f"budget is not null, a whole number of tokens or a ratio in (0, 1) ({budget!r})"
    if any(not isinstance(row[k], str) for k in ("task", "method", "model")):
        # an integer task passed here, then broke the summaries, which name tasks by their string
        return "task, method and model must be strings"
    if not isinstance(row["sample_id"], (str, int)) or isinstance(row["sample_id"], bool):
        return f"sample_id is not a string or an integer ({row['sample_id']!r})"
    return ""


def _valid_budget(budget: int | float) -> bool:
    """Whether a row's numeric budget is one :class:`slake.budgets.budget.Budget` takes (the one definition of a
    token count and a ratio)."""
    from slake.budgets.budget import Budget

    try:
        Budget(budget)
    except ValueError:
        return False
    return True


def is_result_row(row: Any) -> bool:
    """Whether ``row`` is a result row that resuming and the summaries can use (the fields of :func:`row_key`,
    an integer ``length``, a finite numeric ``score``, a ``budget`` that is null, a whole number of tokens or a ratio
    in (0, 1))."""
    return isinstance(row, dict) and not _row_problem(row)


@dataclass
class ResultsScan:
    """What :func:`scan_results` found: the valid rows and the skipped lines ``(line number, reason)``.

    ``cut_tail`` is the number of a last line that has no newline and does not parse (a write cut short by a crash):
    it is in ``skipped`` too, but unlike the others it is not kept, :class:`ResultsWriter` removes it."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    cut_tail: int | None = None

    def describe_skipped(self, name: str = RESULTS_FILE, limit: int = 10) -> str:
        """One line: ``skipped 2 lines of results.jsonl that are not valid result rows: 3 (not JSON), 7 (...)``,
        and what happens to an incomplete last line (``cut_tail``)."""
        kept = [(n, why) for n, why in self.skipped if n != self.cut_tail]
        parts = []
        if kept:
            shown = ", ".join(f"{n} ({why})" for n, why in kept[:limit])
            more = f" and {len(kept) - limit} more" if len(kept) > limit else ""
            parts.append(
                f"skipped {len(kept)} line{'s' if len(kept) > 1 else ''} of {name} that "
                f"{'are' if len(kept) > 1 else 'is'} not valid result rows (kept in the file): line {shown}{more}"
            )
        if self.cut_tail is not None:
            parts.append(
                f"the last line of {name} (line {self.cut_tail}) is an incomplete row, a write cut short by a crash: "
                "it is removed before rows are appended, and its row is run again"
            )
        return "; ".join(parts)


def _results_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p / RESULTS_FILE if p.is_dir() else p


def scan_results(path: str | os.PathLike[str]) -> ResultsScan:
    """Read a results file (a directory means its ``results.jsonl``) line by line, as bytes.

    Valid result rows (:func:`is_result_row`) are returned in file order; every other non-blank line (not UTF-8,
    not JSON, not an object, missing or mistyped fields) is reported in ``skipped`` with its 1-based line number.
    An absent file gives an empty scan.
    """
    p = _results_path(path)
    scan = ResultsScan()
    if not p.is_file():
        return scan
    lines = p.read_bytes().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        row, why = _parse_line(raw.strip())
        if row is None:
            scan.skipped.append((number, why))
            if number == len(lines) and not _parses(raw):  # no newline after it, as _repair_tail cuts it
                scan.cut_tail = number
        else:
            scan.rows.append(row)
    return scan


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The valid result rows of a results file (see :func:`scan_results`, which also reports skipped lines).

    Parameters
    ----------
    path : path-like
        A ``results.jsonl`` file, or the folder holding it.

    Returns
    -------
    list of dict
        The rows in file order; an empty list when the file does not exist.
    """
    return scan_results(path).rows


def _parses(raw: bytes) -> bool:
    """Whether ``raw`` is UTF-8 JSON; a last line without its newline that is not was cut short mid-write."""
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


def _repair_tail(path: Path) -> None:
    """Make the file end with a newline: cut a last line that does not parse as JSON (a write interrupted before
    its newline); give a complete last line its missing newline. Nothing else is touched."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        cut = data.rfind(b"\n") + 1
        if not _parses(data[cut:]):
            fh.truncate(cut)
            return
        fh.seek(0, os.SEEK_END)
        fh.write(b"\n")


class _DirectoryLock:
    """An exclusive advisory lock (``flock``) on a directory, held by an open descriptor until :meth:`release`."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        _HELD.add(self)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the lock releases it
            self.fd = None

    def _forget(self) -> None:
        """In a forked child: close the child's copy of the descriptor. The lock stays the parent's (a flock is
        released when every descriptor of it is closed), and a long-lived child (a worker pool) no longer keeps the
        directory locked after the parent's writer has closed."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


_HELD: weakref.WeakSet[_DirectoryLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    for lock in list(_HELD):
        lock._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def _lock_directory(directory: Path, path: Path) -> _DirectoryLock | None:
    """An exclusive advisory lock on ``directory``, or None where the platform or the filesystem has none (the
    writer then runs unlocked, as before the lock existed). Raises ``ValueError`` while another writer holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    try:
        fd = os.open(directory, os.O_RDONLY)  # not inherited by a program this process executes
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(
            f"{path} is being written by another run (another slake eval, or a merge of kvpress's outputs, with the "
            "same --out): two runs appending to one results file would each run every pending row and mix their "
            "rows, whatever their settings; wait for it to end, or use another --out directory"
        ) from None
    except OSError:  # a filesystem without flock (some network mounts)
        os.close(fd)
        return None
    return _DirectoryLock(fd)


class ResultsWriter:
    """Append rows to ``DIR/results.jsonl``, flushing each one; knows which keys are done.

    The writer holds an exclusive lock on ``DIR`` from its creation to :meth:`close` (where the platform has
    ``flock``): a second writer of the same directory, in another process or this one, is refused with
    ``ValueError`` while the first is open. Without it two runs started on one ``--out`` would both pass the checks
    of the rows present (:func:`check_run_settings` ...), both run every pending row and append them side by side,
    and each summary would mix the other's rows, whatever their settings.

    Parameters
    ----------
    out_dir : path-like
        Output directory, created if needed.
    """

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / RESULTS_FILE
        self._fh: TextIO | None = None
        #: a write failed part-way (a full disk, an interrupt): the file may end in a partial line, cut before the
        #: next row is appended
        self._torn = False
        self._lock = _lock_directory(self.dir, self.path)
        try:
            if self.path.is_file():
                _repair_tail(self.path)
            #: what the existing file held: valid rows and skipped lines (reported by ``slake eval``)
            self.scan = scan_results(self.path)
            self.done: set[RowKey] = {row_key(r) for r in self.scan.rows}
        except BaseException:
            self.close()
            raise

    def __contains__(self, key: RowKey) -> bool:
        return key in self.done

    def write(self, row: dict[str, Any]) -> bool:
        """Append ``row`` unless its key is already present; returns whether it was written.

        Raises ``ValueError`` for a row that :func:`scan_results` would skip (:func:`is_result_row`: a NaN score, a
        missing field ...): written, it would be recomputed by every resumed run and left out of every summary. A
        write that fails part-way (``OSError``: a full disk; an interrupt) is raised after the file is closed; the
        next row written first cuts the partial line it may have left, so that it does not swallow that row.
        """
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"not a valid result row for {self.path}: {problem}")
        key = row_key(row)
        if key in self.done:
            return False
        line = json.dumps(row, ensure_ascii=False) + "\n"
        if self._fh is None:
            if self._torn:
                _repair_tail(self.path)
                self._torn = False
            self._fh = open(self.path, "a", encoding="utf-8")
        try:
            self._fh.write(line)
            self._fh.flush()
        except BaseException:
            self._torn = True
            self._close_file(quiet=True)
            raise
        self.done.add(key)
        return True

    def _close_file(self, quiet: bool = False) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                if not quiet:
                    raise

    def close(self) -> None:
        """Close the file (rows are already flushed) and release the directory's lock, also when closing the file
        fails (a full disk): the lock must not outlive the writer's run in this process."""
        try:
            self._close_file()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __del__(self) -> None:  # a writer dropped without close() must not keep its directory locked
        if getattr(self, "_lock", None) is not None:
            self.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
