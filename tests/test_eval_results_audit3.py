"""Audit of the results side of the harness (2026-12-03): the results store after a failed write, rows the store
would write but never read back, and summary lines, plot points and the closest KL line over other samples than the
rest of their table."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest

from slake.eval import results as results_module
from slake.eval.fidelity_summary import fidelity_tables
from slake.eval.plots import _macro_scores
from slake.eval.results import ResultsWriter, is_result_row, scan_results
from slake.eval.summary import summary_tables, write_summary


def _row(method: str, budget, i: int, score: float, task: str = "niah_single_1", **kw) -> dict:
    return dict(
        suite="ruler", task=task, sample_id=f"{task}-{i}", model="m", method=method, budget=budget, length=1024,
        score=score, **kw,
    )  # fmt: skip


# --- the results store -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_does_not_leave_the_directory_locked(tmp_path):
    """A write to a full disk raised, and so did closing the file (its buffered row could not be flushed either):
    close() stopped before releasing the directory's lock, so a retry in the same process (a notebook, a script
    catching the error) was refused as 'being written by another run' for as long as the old writer lived."""
    pytest.importorskip("fcntl")
    (tmp_path / "results.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    writer = ResultsWriter(tmp_path)
    with pytest.raises(OSError):
        writer.write(_row("snapkv", 128, 0, 1.0))
    try:
        writer.close()
    except OSError:
        pass
    (tmp_path / "results.jsonl").unlink()  # space freed: the user retries while the failed writer is still referenced
    with ResultsWriter(tmp_path) as again:
        assert again.write(_row("snapkv", 128, 0, 1.0))
    assert [r["sample_id"] for r in scan_results(tmp_path).rows] == ["niah_single_1-0"]
    del writer


class _FailsOnce:
    """A file whose first write stores half the text and then fails, as a disk filling up mid-row does."""

    def __init__(self, fh):
        self._fh, self.failed = fh, False

    def write(self, text: str) -> int:
        if not self.failed:
            self.failed = True
            self._fh.write(text[: len(text) // 2])
            self._fh.flush()
            raise OSError(28, "No space left on device")
        return self._fh.write(text)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def test_a_row_written_after_a_failed_write_is_not_swallowed_by_its_partial_line(tmp_path, monkeypatch):
    """The writer kept appending after a row cut short: the next row landed on the partial line, and that line, not
    JSON, was skipped by every reader, although the writer counted the row as done."""
    real_open = open
    monkeypatch.setattr(results_module, "open", lambda *a, **k: _FailsOnce(real_open(*a, **k)), raising=False)
    with ResultsWriter(tmp_path) as store:
        with pytest.raises(OSError):
            store.write(_row("snapkv", 128, 0, 1.0))
        monkeypatch.setattr(results_module, "open", real_open, raising=False)
        assert store.write(_row("snapkv", 128, 1, 1.0))
    scan = scan_results(tmp_path)
    assert scan.skipped == [] and [r["sample_id"] for r in scan.rows] == ["niah_single_1-1"]
    with ResultsWriter(tmp_path) as store:  # the failed row is not done: a resumed run computes it again
        assert store.write(_row("snapkv", 128, 0, 1.0))


def test_the_writer_refuses_a_row_its_reader_would_skip(tmp_path):
    """A row with a NaN score was appended, then skipped by every reader: resumed runs recomputed it each time and
    the summaries never counted it, without a word at the time it was written."""
    with ResultsWriter(tmp_path) as store:
        with pytest.raises(ValueError, match="score is not a number"):
            store.write(_row("snapkv", 128, 0, float("nan")))
        with pytest.raises(ValueError, match="budget"):
            store.write(_row("snapkv", float("nan"), 0, 1.0))
        assert store.write(_row("snapkv", 128, 0, 1.0))
    assert len(scan_results(tmp_path).rows) == 1


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 2.5])
def test_a_budget_that_is_neither_tokens_nor_a_ratio_is_not_a_result_row(tmp_path, budget):
    """A NaN budget (JSON's NaN) passed the check (NaN <= 0 is false): each such row became a summary line of its
    own, since NaN equals nothing, and was never resumed; 2.5 tokens is no budget slake runs."""
    assert not is_result_row(_row("snapkv", budget, 0, 1.0))
    path = tmp_path / "results.jsonl"
    good = [_row("snapkv", b, 0, 1.0) for b in (None, 128, 128.0, 0.25)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good, _row("snapkv", budget, 1, 1.0)]))
    scan = scan_results(path)
    assert len(scan.rows) == 4 and [n for n, _ in scan.skipped] == [5] and "budget" in scan.skipped[0][1]


# --- lines over other samples than the rest of their table --------------------------------------------------------


def _interrupted_rows() -> list[dict]:
    """full and snapkv on 10 samples; h2o on the first 3 only (a run stopped part-way, or added with --samples 3),
    which happen to be the easy ones: h2o 100 on 3 samples, snapkv 30 on 10, both 100 on the 3 both have."""
    rows = []
    for i in range(10):
        rows += [_row("full", None, i, 1.0), _row("snapkv", 128, i, float(i < 3))]
    rows += [_row("h2o", 128, i, 1.0) for i in range(3)]
    return rows


def test_a_line_missing_samples_is_marked_and_never_the_best(tmp_path):
    """h2o's 100 over 3 samples was called the best at 128 and snapkv reported 70 points below it, where the two
    agree on every sample both have."""
    (table,) = summary_tables(_interrupted_rows(), resamples=200)
    lines = {line.method: line for line in table.lines}
    assert lines["full"].complete and lines["snapkv"].complete
    assert not lines["h2o"].complete
    (d,) = table.against_best
    assert d.b == ("snapkv", 128) and d.a == ("h2o", 128) and d.diff == pytest.approx(0.0) and d.n == 3
    md, csv_path = write_summary(tmp_path, _interrupted_rows(), resamples=200)
    assert "| h2o | 128 | 100.0 | 100.0 † |" in md.read_text()
    flags = {r["method"]: r["all_tasks"] for r in csv.DictReader(csv_path.open())}
    assert flags == {"full": "True", "snapkv": "True", "h2o": "False"}


def test_the_plot_has_no_point_for_a_line_missing_samples():
    assert set(_macro_scores(_interrupted_rows())) == {("full", None), ("snapkv", 128)}


def test_a_full_cache_surveyed_on_more_samples_leaves_the_methods_comparable():
    """The full cache alone first on 20 samples (a survey), then the methods on 10: the methods are compared with
    each other as before."""
    rows = [_row("full", None, i, 1.0) for i in range(20)]
    rows += [_row(m, 128, i, s) for i in range(10) for m, s in (("snapkv", 1.0), ("h2o", float(i < 5)))]
    (table,) = summary_tables(rows, resamples=200)
    assert all(line.complete for line in table.lines)
    (d,) = table.against_best
    assert d.b == ("snapkv", 128) and d.diff == pytest.approx(-50.0)


def test_the_closest_kl_line_has_every_sample_of_its_table():
    """With --fidelity, a line measured on 3 of 10 samples (KL 0.1) was called the closest over one measured on all
    10 (0.1 on those 3, 0.5 elsewhere)."""
    rows = []
    for i in range(10):
        base = _row("a", 128, i, 1.0, kl=0.1 if i < 3 else 0.5, kl_tokens=8)
        rows += [base, *([_row("b", 128, i, 1.0, kl=0.1, kl_tokens=8)] if i < 3 else [])]
    (table,) = fidelity_tables(rows, resamples=200)
    a, b = table.lines
    assert a.is_closest and not b.is_closest
    assert b.against_closest is not None and b.against_closest.b == ("a", 128)
    assert b.against_closest.diff == pytest.approx(0.0) and b.against_closest.n == 3
    assert math.isclose(b.interval.mean, 0.1)
