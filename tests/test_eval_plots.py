"""The evaluation plots (:mod:`slake.eval.plots`) show what their titles, axes and legends say; read from the
matplotlib objects, not the PNGs.

What they got wrong before (each test of a fix failed before it):

- A needle heatmap averaged every row of a cell, so a sample written twice (a rerun appending to
  ``results.jsonl``) counted twice, where the summary tables and the score-vs-budget plot keep its later row.
- A score-vs-budget plot over token budgets and ratios joined a method's last token budget to its first ratio in
  one line, a trend across two units; a method with no complete point stood in the legend as if it had a line.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from slake.eval.plots import write_plots  # noqa: E402
from slake.eval.summary import summary_rows  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots close, kept open to be read."""
    kept: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def _needle(method, budget, depth, length, i, score):
    return {
        "suite": "needle",
        "task": "needle",
        "sample_id": f"needle-city-{length}-{depth:g}-{i}",
        "model": "m",
        "method": method,
        "budget": budget,
        "length": length,
        "depth": depth,
        "score": score,
    }


def _axes_titled(figures, start):
    (ax,) = [ax for fig in figures for ax in fig.axes if ax.get_title().startswith(start)]
    return ax


def test_a_needle_heatmap_counts_a_rerun_sample_once_on_a_fixed_scale(figures, tmp_path):
    rows = []
    for length in (1024, 2048):
        for depth in (0.0, 50.0, 100.0):
            for i in range(2):
                rows.append(_needle("full", None, depth, length, i, 1.0))
                rows.append(_needle("snapkv", 128, depth, length, i, float(i == 0)))
    rows.append(_needle("snapkv", 128, 0.0, 1024, 1, 1.0))  # a rerun rewrites sample 1 of one cell: it now passes
    rows.append(_needle("snapkv", 64, 0.0, 1024, 0, 0.0))  # one cell only
    names = {p.name for p in write_plots(tmp_path, rows)}
    assert {"needle_full_full.png", "needle_snapkv_128.png", "needle_snapkv_64.png"} <= names

    ax = _axes_titled(figures, "needle: snapkv, budget 128")
    (im,) = ax.get_images()
    grid = im.get_array()
    assert grid[0][0] == pytest.approx(100.0)  # before: 66.7, the rewritten sample counted at 0 and at 1
    assert grid[1][1] == pytest.approx(50.0)
    # the title's mean is the summary's all-lengths score: (2 + 1 + 1 + 1 + 1 + 1) / 12 samples
    cells = [s for s in summary_rows(rows) if s["method"] == "snapkv" and s["budget"] == 128]
    assert {s["length"]: s["score"] for s in cells} == {1024: pytest.approx(66.67), 2048: 50.0}
    assert "(mean 58.3%)" in ax.get_title()  # before: 53.8%
    # x = length, y = depth with 0 at the top, a colour scale fixed at 0..100
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1024", "2048"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0%", "50%", "100%"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]
    assert im.get_clim() == (0.0, 100.0)

    # a cell without a sample is missing, not a 0
    (empty,) = _axes_titled(figures, "needle: snapkv, budget 64").get_images()
    assert empty.get_array()[0][0] == 0.0
    assert all(empty.get_array().mask[i][j] for i in range(3) for j in range(2) if (i, j) != (0, 0))
    assert empty.get_clim() == (0.0, 100.0)


def _ruler(method, budget, task, i, score):
    return {
        "suite": "ruler",
        "task": task,
        "sample_id": f"{task}-4096-{i}",
        "model": "m",
        "method": method,
        "budget": budget,
        "length": 4096,
        "score": score,
    }


def test_a_score_vs_budget_line_never_joins_a_token_budget_to_a_ratio(figures, tmp_path):
    rows = []
    for task in ("t1", "t2"):
        for i in range(4):
            rows.append(_ruler("full", None, task, i, 1.0))
            for budget, score in ((64, 0.25), (128, 0.5), (0.25, 0.75), (0.5, 1.0)):
                rows.append(_ruler("snapkv", budget, task, i, score))
    rows += [_ruler("tova", 128, "t1", i, 1.0) for i in range(4)]  # t2 missing: no point
    assert [p.name for p in write_plots(tmp_path, rows)] == ["score_vs_budget_ruler.png"]

    ax = _axes_titled(figures, "ruler: score vs budget")
    ticks = dict(zip([t.get_text() for t in ax.get_xticklabels()], ax.get_xticks()))
    assert list(ticks) == ["64", "128", "0.25", "0.5"]
    tokens, ratios = {ticks["64"], ticks["128"]}, {ticks["0.25"], ticks["0.5"]}
    (first,) = [line for line in ax.get_lines() if line.get_label() == "snapkv"]
    look = (to_rgba(first.get_color()), first.get_marker(), first.get_linestyle())
    snapkv = [
        line for line in ax.get_lines() if (to_rgba(line.get_color()), line.get_marker(), line.get_linestyle()) == look
    ]
    points = {(float(x), float(y)) for line in snapkv for x, y in zip(line.get_xdata(), line.get_ydata())}
    assert points == {(ticks["64"], 25.0), (ticks["128"], 50.0), (ticks["0.25"], 75.0), (ticks["0.5"], 100.0)}
    for line in snapkv:  # before: one line through all four
        xs = set(map(float, line.get_xdata()))
        assert xs <= tokens or xs <= ratios
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["snapkv", "tova (incomplete: no point)", "full cache"]  # before: "tova", and no line of it
    (full,) = [line for line in ax.get_lines() if line.get_label() == "full cache"]
    assert full.get_ydata()[0] == pytest.approx(100.0)
    assert "ratio" in ax.get_xlabel() and "tokens" in ax.get_xlabel()
    assert ax.get_ylim() == (-3.0, 103.0)


def test_a_score_vs_budget_plot_of_token_budgets_is_on_a_log_axis(figures, tmp_path):
    rows = [_ruler("full", None, "t1", i, 1.0) for i in range(3)]
    rows += [_ruler("snapkv", b, "t1", i, b / 512) for b in (64, 128, 256) for i in range(3)]
    rows += [_ruler("h2o", b, "t1", i, 0.0) for b in (64, 256) for i in range(3)]
    write_plots(tmp_path, rows)
    ax = _axes_titled(figures, "ruler: score vs budget")
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "KV budget (tokens per layer and head)"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["snapkv"].get_xdata()) == [64, 128, 256]
    assert [round(y, 6) for y in lines["snapkv"].get_ydata()] == [12.5, 25.0, 50.0]
    assert list(lines["h2o"].get_xdata()) == [64, 256]
    styles = {(line.get_color(), line.get_marker()) for k, line in lines.items() if k != "full cache"}
    assert len(styles) == 2
    assert not any(math.isnan(y) for line in lines.values() for y in line.get_ydata())


# a whole float budget in a result row (128.0, written by hand or by another tool) is the token budget 128: the plot
# took it for a ratio, drawn on a categorical axis labelled "tokens per layer and head | ratio of the prompt", with a
# dotted rule between 64 and 128 and the method's line broken there
def test_a_whole_float_token_budget_is_plotted_as_tokens_not_as_a_ratio(figures, tmp_path):
    rows = []
    for i in range(3):
        rows += [
            _ruler("full", None, "t1", i, 1.0),
            _ruler("snapkv", 64, "t1", i, 0.5),
            _ruler("snapkv", 128.0, "t1", i, 0.75),
        ]
    write_plots(tmp_path, rows)
    (ax,) = [ax for fig in figures for ax in fig.axes if ax.get_title().startswith("ruler: score vs budget")]
    assert ax.get_xlabel() == "KV budget (tokens per layer and head)"  # before: "... | ratio of the prompt"
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128"]
    (line,) = [x for x in ax.get_lines() if x.get_label() == "snapkv"]
    assert list(line.get_xdata()) == [64, 128] and list(line.get_ydata()) == [50.0, 75.0]  # one segment
    assert not [x for x in ax.get_lines() if x.get_label() == "_nolegend_"]  # no second segment
