"""What the evaluation's statistics got wrong before: each test failed before its fix.

- ``slake.eval.compare`` took a method's chunked-prefill rows into the line of its exact rows, and paired the rows
  of two models by sample id (one model's rows overwrote the other's, and the second model lost its full cache);
  a full-cache line crashed it.
- In the all-lengths summary table a line run at fewer lengths than the others counted as complete and could be the
  best of its budget; the score-vs-budget plot gave it a point, and counted a duplicated sample twice.
- The paired comparison's p-value split the replicates at exactly 0 between the tails, so it fell below 0.05 beside
  an interval that reached 0.
- A sample whose KL was not finite (written as ``kl: null`` with ``kl_tokens`` > 0) vanished from its line's mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slake.eval.compare import compare_lines, merge_lines, parse_line, write_comparison
from slake.eval.fidelity_summary import fidelity_csv_rows, fidelity_markdown, fidelity_tables
from slake.eval.plots import _macro_scores
from slake.eval.stats import paired_difference, score_table
from slake.eval.summary import summary_tables


def _row(method, budget, task, i, score, length=8192, model="m", **kw) -> dict:
    return {
        "suite": "ruler",
        "task": task,
        "sample_id": f"{task}-{length}-{i}",
        "model": model,
        "method": method,
        "budget": budget,
        "length": length,
        "prediction": "x",
        "answers": ["x"],
        "score": score,
        **kw,
    }


def _folder(base: Path, name: str, rows: list[dict]) -> Path:
    d = base / name
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_compare_keeps_chunked_prefill_rows_out_of_the_exact_line(tmp_path):
    rows = []
    for t in ("t1", "t2"):
        for i in range(4):
            rows += [_row("full", None, t, i, 1.0), _row("cake", 128, t, i, 1.0), _row("snapkv", 128, t, i, 1.0)]
    # the same samples measured later with chunked prefill, appended to the same folder
    rows += [_row("snapkv", 128, t, i, 0.0, prefill_chunk=512) for t in ("t1", "t2") for i in range(4)]
    d = _folder(tmp_path, "a", rows)
    lines = [parse_line(f"{d}:snapkv:exact"), parse_line(f"{d}:cake:cake")]
    merged = merge_lines(lines)
    (c,) = compare_lines(merged, ["exact", "cake"], resamples=200)
    assert c.score.diff == 0.0  # before: 100.0, the chunked zeros overwrote the exact rows
    chunked = merge_lines([parse_line(f"{d}:snapkv (prefill_chunk=512):chunked"), lines[1]])
    (c,) = compare_lines(chunked, ["chunked", "cake"], resamples=200)
    assert c.score.diff == 100.0


def test_compare_refuses_a_line_of_two_models_and_keeps_each_models_full_cache(tmp_path):
    both = []
    for model, cake in (("big", 1.0), ("small", 0.0)):
        both += [_row("full", None, "t1", i, 1.0, model=model) for i in range(4)]
        both += [_row("cake", 128, "t1", i, cake, model=model) for i in range(4)]
    mixed = _folder(tmp_path, "mixed", both)
    with pytest.raises(ValueError, match="2 models or suites"):
        merge_lines([parse_line(f"{mixed}:cake:a"), parse_line(f"{mixed}:cake:b")])
    # one folder per model: each model keeps its own full-cache rows (before: only the first folder's model had any)
    big = _folder(tmp_path, "big", [r for r in both if r["model"] == "big"])
    small = _folder(tmp_path, "small", [r for r in both if r["model"] == "small"])
    merged = merge_lines([parse_line(f"{big}:cake:big"), parse_line(f"{small}:cake:small")])
    full_models = sorted({r["model"] for r in merged if r["method"] == "full"})
    assert full_models == ["big", "small"]


def test_compare_takes_full_cache_lines(tmp_path):
    a = _folder(tmp_path, "a", [_row("full", None, "t1", i, 1.0) for i in range(3)])
    b = _folder(tmp_path, "b", [_row("full", None, "t1", i, 0.0) for i in range(3)])
    lines = [parse_line(f"{a}:full:bf16"), parse_line(f"{b}:full:int8")]
    merged = merge_lines(lines)
    (c,) = compare_lines(merged, ["bf16", "int8"], resamples=200)  # before: TypeError sorting budget None
    assert c.budget is None and c.score.diff == -100.0
    write_comparison(tmp_path / "out", lines, resamples=200)
    assert "bf16" in (tmp_path / "out" / "comparison.md").read_text()


def _lengths_rows() -> list[dict]:
    rows = []
    for t in ("t1", "t2"):
        for i in range(6):
            for length, cake in ((8192, 0.8), (16384, 0.5)):
                rows += [_row("full", None, t, i, 1.0, length), _row("cake", 128, t, i, float(i < 6 * cake), length)]
            rows.append(_row("snapkv", 128, t, i, float(i < 5), 8192))  # run later at 8K only
    return rows


def test_a_line_missing_a_length_is_not_complete_in_the_all_lengths_table():
    (table,) = [t for t in summary_tables(_lengths_rows(), resamples=200) if t.length == "all"]
    lines = {line.method: line for line in table.lines}
    assert lines["full"].complete and lines["cake"].complete
    assert not lines["snapkv"].complete  # before: complete, and the best at 128 (83.3 against cake's 66.7)
    assert [d.b[0] for d in table.against_best] == ["cake"]
    # the per-length table, where snapkv has every task, still counts it
    (at_8k,) = [t for t in summary_tables(_lengths_rows(), resamples=200) if t.length == 8192]
    assert all(line.complete for line in at_8k.lines)


def test_the_plot_has_no_point_for_a_line_missing_a_length_and_counts_a_sample_once():
    points = _macro_scores(_lengths_rows())
    assert set(points) == {("full", None), ("cake", 128)}
    rows = [_row("cake", 128, "t1", i, 1.0) for i in range(4)] + [_row("cake", 128, "t1", 0, 0.0)] * 4
    # the summary's cell: the later row of sample 0 wins (0.0), the other three score 1.0
    assert _macro_scores(rows)[("cake", 128)] == pytest.approx(75.0)  # before: 3/8 rows at 1.0, 37.5


def test_the_p_value_is_not_significant_where_the_interval_reaches_zero():
    rows = [_row("a", 128, "t1", i, float(i < 3)) for i in range(30)]
    rows += [_row("b", 128, "t1", i, 0.0) for i in range(30)]
    d = paired_difference(score_table(rows), ("a", 128), ("b", 128), resamples=2000)
    assert d.low == 0.0 and not d.significant
    assert d.p_value >= 0.05  # before: 0.043, a "significant" p beside an interval reaching 0
    rows = [_row("a", 128, "t1", i, float(i < 15)) for i in range(30)]
    rows += [_row("b", 128, "t1", i, 0.0) for i in range(30)]
    d = paired_difference(score_table(rows), ("a", 128), ("b", 128), resamples=2000)
    assert d.significant and d.p_value < 0.05


def test_a_non_finite_kl_is_counted_and_its_line_is_never_the_closest():
    rows = []
    for i in range(4):
        rows.append(_row("cake", 128, "t1", i, 1.0, kl=0.5, kl_tokens=10))
        # snapkv's finite KLs are lower, but one of its samples overflowed
        rows.append(_row("snapkv", 128, "t1", i, 1.0, kl=None if i == 3 else 0.1, kl_tokens=10))
    rows.append(_row("full", None, "t1", 0, 1.0))
    (table,) = fidelity_tables(rows, resamples=200)
    lines = {line.method: line for line in table.lines}
    assert lines["snapkv"].nonfinite == 1 and lines["snapkv"].interval.n == 3
    assert lines["cake"].against_closest is None  # cake is the closest; before: snapkv, its overflow dropped
    assert lines["snapkv"].against_closest is not None and lines["snapkv"].against_closest.b[0] == "cake"
    assert "1 non-finite left out" in fidelity_markdown([table])
    assert [(r["method"], r["nonfinite"]) for r in fidelity_csv_rows([table])] == [("cake", 0), ("snapkv", 1)]


def test_a_line_whose_every_kl_is_non_finite_still_has_its_line():
    rows = [_row("cake", 128, "t1", i, 1.0, kl=0.5, kl_tokens=10) for i in range(3)]
    rows += [_row("snapkv", 128, "t1", i, 0.0, kl=None, kl_tokens=10) for i in range(3)]
    (table,) = fidelity_tables(rows, resamples=200)
    lines = {line.method: line for line in table.lines}
    assert lines["snapkv"].nonfinite == 3 and lines["snapkv"].interval.n == 0
    markdown = fidelity_markdown([table])
    (row,) = [line for line in markdown.splitlines() if line.startswith("| snapkv")]
    assert "3 non-finite left out" in row and "closest" not in row  # it has no comparison, and is not the closest
    (row,) = [line for line in markdown.splitlines() if line.startswith("| cake")]
    assert "| closest |" in row
