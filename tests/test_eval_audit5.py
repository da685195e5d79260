"""Evaluation audit 5: summaries that read a budget as written instead of as :class:`slake.Budget` reads it.

A whole float budget in a result row (``128.0``, written by hand or by another tool, accepted by the results file)
is the token budget 128, and the summary tables sort and label it so since c020107; but

- the score-vs-budget plot took it for a ratio (``tests/test_eval_plots.py``);
- ``comparison.md`` and ``comparison.csv`` (``python -m slake.eval.compare``) printed the budget as written:
  ``128.0``, and ``None`` for two full-cache lines (e.g. a bf16 and an int8 ``--kv-dtype`` folder), where every
  other summary says ``128`` and ``full``.
"""

from __future__ import annotations

import json

from slake.eval.compare import Line, write_comparison


def _row(i, method, budget, score, task="niah_single_1"):
    return {
        "suite": "ruler",
        "task": task,
        "sample_id": f"{task}-1024-{i}",
        "model": "m",
        "method": method,
        "budget": budget,
        "length": 1024,
        "score": score,
    }


def _folder(path, rows):
    path.mkdir()
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_comparison_labels_budgets_as_the_summaries_do(tmp_path):
    a = _folder(
        tmp_path / "a",
        [_row(i, m, b, 1.0) for i in range(4) for m, b in (("full", None), ("snapkv", 128.0))],
    )
    b = _folder(
        tmp_path / "b",
        [_row(i, m, b, float(i % 2)) for i in range(4) for m, b in (("full", None), ("snapkv", 128.0))],
    )
    lines = [Line(a, "full", "A"), Line(b, "full", "B"), Line(a, "snapkv", "SA"), Line(b, "snapkv", "SB")]
    write_comparison(tmp_path / "out", lines, resamples=50)
    md = (tmp_path / "out" / "comparison.md").read_text(encoding="utf-8")
    assert "| B - A | 1024 | full |" in md and "| SB - SA | 1024 | 128 |" in md
    assert "None" not in md and "128.0" not in md
    csv_text = (tmp_path / "out" / "comparison.csv").read_text(encoding="utf-8").splitlines()
    assert csv_text[1].startswith("A,B,1024,full,") and csv_text[2].startswith("SA,SB,1024,128,")
