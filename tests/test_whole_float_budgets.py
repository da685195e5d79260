"""A whole float budget in a result row (``128.0``, hand-made or written by another tool) is the token budget 128.

``slake.Budget(128.0)`` is 128 tokens, and the results file accepts such a row; but the summaries sorted it among the
ratios (after 0.25) and labelled it ``128.0``, beside a line ``128`` of the same budget written by slake.
"""

from __future__ import annotations

from slake.eval.compare import budget_sort_key
from slake.eval.results import budget_label, canonical_budget, is_result_row
from slake.eval.summary import method_budget_order, summary_tables, write_summary


def _row(i, method, budget, score):
    return dict(
        suite="ruler", task="niah_single_1", sample_id=f"s-{i}", model="m", method=method, budget=budget,
        length=1024, score=score,
    )  # fmt: skip


def test_a_whole_float_budget_sorts_and_reads_as_tokens():
    assert canonical_budget(128.0) == 128 and isinstance(canonical_budget(128.0), int)
    assert canonical_budget(0.25) == 0.25 and canonical_budget(None) is None and canonical_budget(64) == 64
    assert canonical_budget(1.0) == 1.0  # refused by slake.Budget (ambiguous): left as it is
    assert budget_label(128.0) == "128" and budget_label(0.25) == "0.25" and budget_label(None) == "full"
    assert sorted([0.25, 128.0, None, 64], key=budget_sort_key) == [None, 64, 128.0, 0.25]  # before: 128.0 last


def test_the_summary_orders_and_labels_hand_made_rows_with_the_others(tmp_path):
    rows = []
    for i in range(4):
        rows += [_row(i, "full", None, 1.0), _row(i, "snapkv", 0.25, 0.5), _row(i, "snapkv", 128.0, 0.75)]
        rows += [_row(i, "snapkv", 64, 0.25)]
    assert all(is_result_row(r) for r in rows)
    assert method_budget_order(rows) == [("full", None), ("snapkv", 64), ("snapkv", 128.0), ("snapkv", 0.25)]
    (table,) = summary_tables(rows, resamples=100)
    lines = [(line.method, line.budget) for line in table.lines]
    assert lines == [("full", None), ("snapkv", 64), ("snapkv", 128), ("snapkv", 0.25)]
    md, _ = write_summary(tmp_path, rows, resamples=100)
    text = md.read_text()
    assert "| snapkv | 128 |" in text and "128.0" not in text
    assert text.index("| snapkv | 64 |") < text.index("| snapkv | 128 |") < text.index("| snapkv | 0.25 |")
