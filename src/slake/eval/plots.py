"""Plots derived from ``results.jsonl`` (matplotlib with the Agg backend, imported lazily).

* ``needle_<method>_<budget>.png``: needle-in-a-haystack accuracy heatmap, needle depth (y) x context length (x),
  one per (method, budget), the full reference included.
* ``score_vs_budget_<suite>.png``: mean score vs budget, one line per method, the full cache as a dashed
  horizontal line; the score is the mean over tasks of each task's mean over samples and lengths. Token budgets and
  ratios share a categorical axis when both were run, a method's line broken between the two units.

A sample counts once in both, as in the summary tables: of a sample id written twice, the later row wins.

A model suffix is added to the file names when the results hold several models.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slake.eval.results import FULL_METHOD, budget_label, canonical_budget, read_results, summary_view
from slake.eval.stats import score_table
from slake.eval.summary import budget_sort_key, complete_pairs, method_budget_order, task_order

__all__ = ["write_plots", "needle_heatmaps", "score_vs_budget"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _by_model(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[str(r.get("model", ""))].append(r)
    return out


def needle_heatmaps(
    rows: Iterable[dict[str, Any]], out_dir: str | os.PathLike[str], model_suffix: str = ""
) -> list[Path]:
    """One depth x length accuracy heatmap per (method, budget) of the needle rows (``suite == "needle"``)."""
    rows = [r for r in rows if r.get("suite", r["task"]) == "needle" and r.get("depth") is not None]
    if not rows:
        return []
    plt = _pyplot()
    depths = sorted({float(r["depth"]) for r in rows})
    lengths = sorted({int(r["length"]) for r in rows})
    paths = []
    for method, budget in method_budget_order(rows):
        # a sample counts once, as in the tables: a later duplicate row (a rerun appending) wins
        cells: dict[tuple[float, int], dict[tuple[str, str], float]] = defaultdict(dict)
        for r in rows:
            if r["method"] == method and r.get("budget") == budget:
                sample = (str(r["task"]), str(r["sample_id"]))
                cells[(float(r["depth"]), int(r["length"]))][sample] = float(r["score"])
        grid = [
            [100.0 * _mean(list(cells[(d, n)].values())) if cells.get((d, n)) else float("nan") for n in lengths]
            for d in depths
        ]
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.4 + 0.5 * len(depths)), dpi=120)
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(
                        j,
                        i,
                        f"{v:.0f}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="black" if 20 <= v <= 80 else "white",
                    )
        label = "full cache" if budget is None else f"{method}, budget {budget_label(budget)}"
        mean = _mean([s for v in cells.values() for s in v.values()]) * 100
        ax.set_title(f"needle: {label} (mean {mean:.1f}%)", fontsize=10)
        fig.colorbar(im, ax=ax, label="accuracy (%)", fraction=0.05, pad=0.03)
        fig.tight_layout()
        path = Path(out_dir) / f"needle_{_slug(method)}_{_slug(budget_label(budget))}{model_suffix}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _macro_scores(rows: list[dict[str, Any]]) -> dict[tuple[str, Any], float]:
    """(method, budget) -> the summary table's average (percent): the mean over tasks of each task's mean score, a
    sample counting once (a later duplicate row wins, as in the tables: :func:`slake.eval.stats.score_table`), for
    the pairs scored at every (task, length) of ``rows`` on every sample the compressed lines have there
    (:func:`slake.eval.summary.complete_pairs`; a mean over fewer tasks, lengths or samples would not be comparable
    with the others, so such a pair has no point)."""
    scores = score_table(rows)
    complete = complete_pairs(scores)
    out: dict[tuple[str, Any], float] = {}
    for pair, by_stratum in scores.items():
        if pair not in complete:
            continue
        per_task: dict[str, list[float]] = defaultdict(list)
        for (task, _), by_sample in by_stratum.items():
            per_task[task] += by_sample.values()
        out[pair] = _mean([100.0 * _mean(v) for v in per_task.values()])
    return out


def score_vs_budget(
    rows: Iterable[dict[str, Any]], out_dir: str | os.PathLike[str], model_suffix: str = ""
) -> list[Path]:
    """One score-vs-budget plot per suite: a line per method, the full cache as a dashed horizontal line; a method
    and budget not scored on every task and sample of the suite has no point (:func:`_macro_scores`)."""
    by_suite: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_suite[str(r.get("suite", "results"))].append(r)
    paths = []
    for suite, srows in by_suite.items():
        scores = _macro_scores(srows)
        pairs = method_budget_order(srows)
        # as slake.Budget reads them: a whole float of tokens (128.0, a hand-made row) is the token budget 128, not a
        # ratio (it was drawn among the ratios, on a categorical axis, its method's line broken before it); the
        # scores' keys compare equal (128 == 128.0)
        budgets = sorted({canonical_budget(b) for _, b in pairs if b is not None}, key=budget_sort_key)
        if not budgets and (FULL_METHOD, None) not in scores:
            continue
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        numeric = bool(budgets) and all(isinstance(b, int) for b in budgets)
        xpos = {b: (b if numeric else i) for i, b in enumerate(budgets)}
        methods = [m for m, _ in pairs if m != FULL_METHOD]
        # token budgets and ratios are different units: a method's line is drawn in one segment per unit, never
        # joining a token budget to a ratio (on the shared categorical axis, a dotted rule parts the two)
        units = [[b for b in budgets if isinstance(b, int)], [b for b in budgets if not isinstance(b, int)]]
        units = [u for u in units if u]
        for i, method in enumerate(dict.fromkeys(methods)):  # markers and dashes tell apart >10 colour-cycled lines
            style = dict(color=f"C{i % 10}", marker="osD^v<>pPhX*"[i % 12], linestyle=("-", "-.", ":")[(i // 10) % 3])
            segments = [[(xpos[b], scores[(method, b)]) for b in unit if (method, b) in scores] for unit in units]
            segments = [seg for seg in segments if seg] or [[]]
            for k, seg in enumerate(segments):
                # a method with no complete point keeps its legend entry, saying it has none
                label = (method if seg else f"{method} (incomplete: no point)") if k == 0 else "_nolegend_"
                ax.plot([p[0] for p in seg], [p[1] for p in seg], label=label, **style)
        if len(units) > 1:
            ax.axvline(len(units[0]) - 0.5, color="grey", linestyle=":", linewidth=1)
        if (FULL_METHOD, None) in scores:
            ax.axhline(scores[(FULL_METHOD, None)], color="black", linestyle="--", linewidth=1.2, label="full cache")
        if numeric:
            ax.set_xscale("log", base=2)
        ax.set_xticks([xpos[b] for b in budgets], [budget_label(b) for b in budgets])
        ax.minorticks_off()
        ax.set_ylim(-3, 103)
        if numeric:
            ax.set_xlabel("KV budget (tokens per layer and head)")
        elif len(units) > 1:
            ax.set_xlabel("KV budget: tokens per layer and head | ratio of the prompt")
        else:
            ax.set_xlabel("KV budget (ratio of the prompt)" if budgets else "KV budget")
        ax.set_ylabel("mean score (%)")
        tasks = task_order(srows)
        lengths = sorted({int(r["length"]) for r in srows})
        sub = ", ".join(tasks) if len(tasks) <= 4 else f"{len(tasks)} tasks"
        ax.set_title(f"{suite}: score vs budget\n{sub}; lengths {', '.join(map(str, lengths))}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = Path(out_dir) / f"score_vs_budget_{_slug(suite)}{model_suffix}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def write_plots(out_dir: str | os.PathLike[str], rows: Iterable[dict[str, Any]] | None = None) -> list[Path]:
    """Write every plot for ``rows`` (default: ``DIR/results.jsonl``) into ``DIR``; returns the PNG paths.

    Parameters
    ----------
    out_dir : path-like
        The folder ``DIR`` the plots go to (created if missing).
    rows : iterable of dict, optional
        Result rows; the rows of ``DIR/results.jsonl`` by default.

    Returns
    -------
    list of Path
        The PNG files written: needle heatmaps and score-vs-budget plots, per model when the rows hold several.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rows = summary_view(read_results(directory) if rows is None else rows)
    models = _by_model(rows)
    paths: list[Path] = []
    for model, mrows in models.items():
        suffix = f"_{_slug(model)}" if len(models) > 1 else ""
        paths += needle_heatmaps(mrows, directory, suffix)
        paths += score_vs_budget(mrows, directory, suffix)
    return paths
