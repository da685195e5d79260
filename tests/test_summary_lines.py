"""What a summary line stands for: one method's rows of one kind, compared only with lines scored on the same tasks."""

from __future__ import annotations

import csv

from slake.eval.plots import _macro_scores
from slake.eval.results import summary_view
from slake.eval.summary import summary_rows, summary_tables, write_summary


def _row(task, i, method, budget, score, **kw):
    return dict(
        suite="ruler", task=task, sample_id=f"{task}-{i}", model="m", method=method, budget=budget, length=1024,
        score=score, **kw,
    )  # fmt: skip


def _lines(table):
    return {(line.method, line.budget): line for line in table.lines}


def test_a_line_missing_tasks_is_never_the_best_and_says_so(tmp_path):
    """h2o, scored on niah_single_1 only (80), was the best at 128 over snapkv (100 there, 40 on vt: 70 on average),
    and snapkv was then reported 20 points above the best."""
    rows = []
    for i in range(5):
        rows += [_row("niah_single_1", i, "full", None, 1.0), _row("vt", i, "full", None, 0.0)]
        rows += [_row("niah_single_1", i, "snapkv", 128, 1.0), _row("vt", i, "snapkv", 128, 0.4)]
        rows += [_row("niah_single_1", i, "h2o", 128, 0.8)]
    (table,) = summary_tables(rows, resamples=200)
    lines = _lines(table)
    assert lines[("snapkv", 128)].complete and not lines[("h2o", 128)].complete
    assert lines[("h2o", 128)].average > lines[("snapkv", 128)].average  # 80 over one task, 70 over two
    (d,) = table.against_best
    assert d.b == ("snapkv", 128) and d.a == ("h2o", 128) and d.diff < 0  # the complete line is the best
    md, csv_path = write_summary(tmp_path, rows, resamples=200)
    text = md.read_text()
    assert "| h2o | 128 | 80.0 |  | 80.0 † |" in text and "| snapkv | 128 | 100.0 | 40.0 | 70.0 |" in text
    flags = {r["method"]: r["all_tasks"] for r in csv.DictReader(csv_path.open())}
    assert flags == {"full": "True", "snapkv": "True", "h2o": "False"}
    assert set(_macro_scores(rows)) == {("full", None), ("snapkv", 128)}  # the plot has no point for h2o


def test_without_a_complete_line_no_method_is_called_the_best():
    rows = [_row("niah_single_1", i, "snapkv", 128, 1.0) for i in range(3)]
    rows += [_row("vt", i, "h2o", 128, 0.5) for i in range(3)]
    (table,) = summary_tables(rows, resamples=100)
    assert table.against_best == [] and table.paired == []  # no sample in common, no best


def test_chunked_prefill_rows_are_their_own_line():
    """Exact and chunked rows of snapkv at 128 share a directory (the resume key names the chunk); the summary put
    them in one line: summary.md showed the later rows only, the --json rows averaged both."""
    rows = []
    for i in range(4):
        rows.append(_row("niah_single_1", i, "full", None, 1.0, prefill_chunk=None))
        rows.append(_row("niah_single_1", i, "snapkv", 128, 1.0, prefill_chunk=None))
        rows.append(_row("niah_single_1", i, "snapkv", 128, 0.0, prefill_chunk=512))
    (table,) = summary_tables(rows, resamples=100)
    lines = _lines(table)
    assert lines[("snapkv", 128)].average == 100.0 and lines[("snapkv", 128)].n == 4
    assert lines[("snapkv (prefill_chunk=512)", 128)].average == 0.0
    assert {(r["method"], r["score"], r["n"]) for r in summary_rows(rows)} == {
        ("full", 100.0, 4),
        ("snapkv", 100.0, 4),
        ("snapkv (prefill_chunk=512)", 0.0, 4),
    }
    assert summary_view(summary_view(rows)) == summary_view(rows)  # relabelled once
    assert rows[2]["method"] == "snapkv"  # the rows themselves are not changed


def test_kl_tables_of_methods_on_disjoint_tasks_do_not_stop_the_summary(tmp_path):
    """``--fidelity`` rows of snapkv on one task and h2o on another raised "share no sample" after the whole run, and
    no summary was written."""
    rows = []
    for task, method, kl in (("niah_single_1", "snapkv", 0.1), ("vt", "h2o", 0.3)):
        for i in range(3):
            rows.append(_row(task, i, "full", None, 1.0))
            rows.append(_row(task, i, method, 128, 0.5, kl=kl))
    md, _ = write_summary(tmp_path, rows, resamples=100)
    assert "Output-level distance" in md.read_text()
