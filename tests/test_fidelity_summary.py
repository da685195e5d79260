"""The KL section of an evaluation's summary (:mod:`slake.eval.fidelity_summary`): means, intervals, the paired
comparison with the closest method, and nothing for runs without ``--fidelity``."""

from __future__ import annotations

import json

import pytest

from slake.eval.fidelity_summary import fidelity_csv_rows, fidelity_markdown, fidelity_tables
from slake.eval.summary import write_summary


def _rows() -> list[dict]:
    rows = []
    for task, kls in (("t1", (0.1, 0.2, 0.3, 0.2)), ("t2", (1.0, 1.2, 0.8, 1.0))):
        for i, kl in enumerate(kls):
            base = {"model": "m", "suite": "ruler", "task": task, "length": 8192, "sample_id": f"{task}-{i}"}
            rows.append({**base, "method": "full", "budget": None, "score": 1.0})  # no kl: left out
            rows.append({**base, "method": "a", "budget": 128, "score": 1.0, "kl": kl, "kl_tokens": 9})
            rows.append({**base, "method": "b", "budget": 128, "score": 0.0, "kl": kl + 0.5, "kl_tokens": 9})
    return rows


def test_mean_is_the_macro_average_over_tasks_and_the_closest_is_compared():
    (table,) = fidelity_tables(_rows(), resamples=500)
    a, b = table.lines
    assert (a.method, b.method) == ("a", "b")
    assert a.interval.mean == pytest.approx((0.2 + 1.0) / 2)
    assert a.interval.low <= a.interval.mean <= a.interval.high and a.interval.n == 8
    assert a.against_closest is None
    d = b.against_closest
    assert d is not None and d.b == ("a", 128) and d.diff == pytest.approx(0.5)
    assert d.significant and d.low == pytest.approx(0.5) and d.high == pytest.approx(0.5)  # the same shift everywhere
    md = fidelity_markdown([table])
    assert "| a | 128 | 0.6000 |" in md and "**+0.5000**" in md
    assert fidelity_csv_rows([table])[1]["closest"] == "a"


def test_no_section_without_fidelity_rows(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("kl", "kl_tokens")} for r in _rows()]
    assert fidelity_tables(rows) == [] and fidelity_markdown([]) == ""
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md, _ = write_summary(tmp_path, resamples=200)
    assert "Output-level distance" not in md.read_text() and not (tmp_path / "fidelity.csv").exists()


def test_summary_carries_the_kl_section_and_csv(tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    md, _ = write_summary(tmp_path, resamples=200)
    text = md.read_text()
    assert "## Output-level distance to the full cache" in text and "### ruler, length 8192, model m" in text
    assert (tmp_path / "fidelity.csv").read_text().splitlines()[0].startswith("model,suite,length,method")


def test_a_nan_or_infinite_kl_is_counted_as_non_finite_and_never_the_closest():
    """A ``kl`` written as JSON's NaN or Infinity (the reader accepts both) went into the mean: a NaN mean made its
    line the closest at its budget (no mean compares below NaN)."""
    rows = []
    for i in range(4):
        base = {"model": "m", "suite": "ruler", "task": "t", "length": 8192, "sample_id": f"t-{i}", "kl_tokens": 9}
        bad = {0: float("nan"), 1: float("inf")}.get(i, 0.1)
        rows += [{**base, "method": "snapkv", "budget": 128, "score": 1.0, "kl": bad}]
        rows += [{**base, "method": "cake", "budget": 128, "score": 1.0, "kl": 0.5}]
    (table,) = fidelity_tables(rows, resamples=200)
    snap, cake = table.lines
    assert snap.nonfinite == 2 and snap.interval.n == 2 and snap.interval.mean == pytest.approx(0.1)
    assert cake.is_closest and not snap.is_closest and snap.against_closest is not None
