"""Evaluation audit 5: summaries that read a budget as written instead of as :class:`slake.Budget` reads it.

A whole float budget in a result row (``128.0``, written by hand or by another tool, accepted by the results file)
is the token budget 128, and the summary tables sort and label it so since c020107; but

- the score-vs-budget plot took it for a ratio: a run of 64 and 128.0 tokens was drawn on a categorical axis
  labelled "tokens per layer and head | ratio of the prompt", with a dotted rule between 64 and 128 and the
  method's line broken there, as if the two were different units;
- ``comparison.md`` and ``comparison.csv`` (``python -m slake.eval.compare``) printed the budget as written:
  ``128.0``, and ``None`` for two full-cache lines (e.g. a bf16 and an int8 ``--kv-dtype`` folder), where every
  other summary says ``128`` and ``full``.
"""

from __future__ import annotations

import json

import pytest

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


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots close, kept open to be read."""
    plt = pytest.importorskip("matplotlib.pyplot")
    kept: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def test_a_whole_float_token_budget_is_plotted_as_tokens_not_as_a_ratio(figures, tmp_path):
    from slake.eval.plots import write_plots

    rows = []
    for i in range(3):
        rows += [_row(i, "full", None, 1.0), _row(i, "snapkv", 64, 0.5), _row(i, "snapkv", 128.0, 0.75)]
    write_plots(tmp_path, rows)
    (ax,) = [ax for fig in figures for ax in fig.axes if ax.get_title().startswith("ruler: score vs budget")]
    assert ax.get_xlabel() == "KV budget (tokens per layer and head)"  # before: "... | ratio of the prompt"
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128"]
    (line,) = [x for x in ax.get_lines() if x.get_label() == "snapkv"]
    assert list(line.get_xdata()) == [64, 128] and list(line.get_ydata()) == [50.0, 75.0]  # one segment
    assert not [x for x in ax.get_lines() if x.get_label() == "_nolegend_"]  # no second segment


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
