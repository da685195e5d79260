"""The protocol's table and plot: score against kvpress's compression ratio, a line per method, our methods and
kvpress's presses (``kvpress:<press>``) together.

Written by ``slake eval --protocol kvpress`` into its ``--out`` folder, from the rows of that protocol (those scored
with its metric: :func:`protocol_rows`):

* ``protocol_kvpress.md`` and ``protocol_kvpress.csv``: per model, one line per method, one column per compression
  ratio (fraction removed, as kvpress states it): the mean over tasks of each task's mean score, in percent, with its
  bootstrap interval over samples (:mod:`slake.eval.stats`), as in ``summary.md``; as there, a line without samples
  in every task of its table, or missing samples other methods have, averages its own tasks and samples, which the
  markdown table marks ``†`` (:func:`slake.eval.summary.complete_pairs`);
* ``score_vs_ratio_kvpress[_MODEL].png``: the same numbers as lines, our methods solid, kvpress's presses dashed, the
  full cache as a horizontal line (a line over fewer tasks or samples is marked ``†`` in the legend).
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slake.eval.protocol import Protocol, ratio_of_budget
from slake.eval.protocol_outputs import KVPRESS_PREFIX
from slake.eval.results import FULL_METHOD
from slake.eval.summary import SummaryLine, summary_tables

__all__ = ["common_rows", "protocol_lines", "protocol_rows", "write_protocol_report"]


def protocol_rows(rows: Iterable[dict[str, Any]], protocol: Protocol) -> list[dict[str, Any]]:
    """The rows a protocol's report reads: its suite and length, question-agnostic when it is, scored with the
    protocol's metric (:meth:`Protocol.metric`; a row that names no metric is kept), ratio budgets or the full cache.

    A results folder may also hold rows of a plain ``--suite ruler --lengths 4096 --question-agnostic`` run (other
    samples: ``slake eval`` refuses another metric only for the samples it runs), scored with RULER's own metric,
    which does not clean the prediction as kvpress's scorer does: they are left out of the table that says it is
    scored as kvpress scores it.
    """
    out = []
    for r in rows:
        budget = r.get("budget")
        if r.get("suite") != protocol.suite or int(r["length"]) != protocol.length:
            continue
        if protocol.question_agnostic and r.get("query_aware", True):
            continue
        if r.get("metric") is not None and r["metric"] != protocol.metric(str(r.get("task", ""))):
            continue
        if budget is not None and not (isinstance(budget, float) and 0.0 < budget < 1.0):
            continue
        out.append(r)
    return out


def common_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the samples kvpress's side ran, per model (all rows of a model without kvpress rows).

    kvpress's presses may have run on fewer samples than our methods (they cost one more prefill per sample, and KVzip
    a reconstruction pass); the table and plot then compare every line on the same samples first.
    """
    theirs: dict[str, set[str]] = {}
    for r in rows:
        if str(r["method"]).startswith(KVPRESS_PREFIX):
            theirs.setdefault(str(r.get("model", "")), set()).add(str(r["sample_id"]))
    return [r for r in rows if str(r.get("model", "")) not in theirs or str(r["sample_id"]) in theirs[str(r["model"])]]


def protocol_lines(rows: list[dict[str, Any]]) -> dict[str, tuple[list[str], list[SummaryLine]]]:
    """Per model: the tasks and the summary lines (:class:`slake.eval.summary.SummaryLine`) of ``rows``."""
    out: dict[str, tuple[list[str], list[SummaryLine]]] = {}
    for table in summary_tables(rows):
        if table.length != "all":
            out[table.model] = (table.tasks, table.lines)
    return out


#: our method -> kvpress's matching press (same algorithm; one colour in the plot, solid and dashed)
COUNTERPARTS: dict[str, str] = {
    "snapkv": "kvpress:snapkv",
    "pyramidkv": "kvpress:pyramidkv",
    "tova": "kvpress:tova",
    "streamingllm": "kvpress:streaming_llm",
    "ada-snapkv": "kvpress:adakv_snapkv",
    "keydiff": "kvpress:keydiff",
    "ada-expected-attention": "kvpress:expected_attention",
    "expected-attention": "kvpress:expected_attention_plain",
    "criticalkv": "kvpress:critical_snapkv",
    "ada-criticalkv": "kvpress:critical_adakv_snapkv",
    "kvzip": "kvpress:kvzip",
}


def _methods(lines: list[SummaryLine]) -> list[str]:
    """Methods in table order: the full cache, our methods, then kvpress's presses (``no_press`` first)."""
    names = list(dict.fromkeys(line.method for line in lines))

    def rank(m: str) -> tuple[int, int]:
        if m == FULL_METHOD:
            return (0, 0)
        if m == KVPRESS_PREFIX + "no_press":
            return (1, 0)
        return (3 if m.startswith(KVPRESS_PREFIX) else 2, names.index(m))

    return sorted(names, key=rank)


#: marks an average over fewer tasks or samples than the table's (as ``summary.md`` marks it)
FEWER_TASKS = " †"


def _cell(line: SummaryLine | None) -> str:
    if line is None:
        return ""
    mark = "" if line.complete else FEWER_TASKS  # its own tasks or samples only: not comparable with the others
    if not line.interval.measured:  # one sample per task: no interval (slake.eval.stats)
        return f"{line.average:.1f}{mark}"
    return f"{line.average:.1f}{mark} [{line.interval.low:.1f}, {line.interval.high:.1f}]"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


PerModel = dict[str, tuple[list[str], list[SummaryLine]]]


def _markdown(protocol: Protocol, sections: list[tuple[str, PerModel]]) -> str:
    ratios = list(protocol.compression_ratios)
    out = [
        f"# Protocol `{protocol.name}`",
        "",
        f"{protocol.suite.upper() if protocol.suite == 'ruler' else protocol.suite} at {protocol.length} tokens, "
        f"{'question-agnostic' if protocol.question_agnostic else 'query-aware'} compression, scored as kvpress "
        f"scores it ({protocol.source}). Columns: kvpress's compression ratio (fraction of the context removed; our "
        "budget is the fraction kept, 1 - ratio). Cells: mean over tasks of each task's mean score in percent, "
        "with its 95% bootstrap interval over samples; an average marked † is over the line's own tasks, fewer than "
        "the table's, or misses samples other methods have, and is not comparable with the others. Methods named "
        "`kvpress:<press>` are kvpress's own presses run by kvpress in its own environment on the same token ids.",
        "",
    ]
    for heading, per_model in sections:
        out += _section(protocol, heading, per_model, ratios)
    if not sections or not any(per_model for _, per_model in sections):
        out.append("No results yet.")
    return "\n".join(out) + "\n"


def _section(protocol: Protocol, heading: str, per_model: PerModel, ratios: list[float]) -> list[str]:
    out = []
    for model, (tasks, lines) in per_model.items():
        by_pair = {(line.method, line.budget): line for line in lines}
        n_samples = max((line.n for line in lines), default=0)
        out += [f"## model {model}{heading}", "", f"Tasks: {', '.join(tasks)}; up to {n_samples} samples per line.", ""]
        out.append("| method | " + " | ".join(f"{r:g}" for r in ratios) + " | n |")
        out.append("|---|" + "---:|" * (len(ratios) + 1))
        for method in _methods(lines):
            full = by_pair.get((method, None))
            if full is not None:
                cells = [_cell(full) + " (no compression)"] + [""] * (len(ratios) - 1)
                n = full.n
            else:
                found = [by_pair.get((method, b)) for b in protocol.budgets]
                cells = [_cell(x) for x in found]
                n = max((x.n for x in found if x is not None), default=0)
            out.append(f"| {method} | " + " | ".join(cells) + f" | {n} |")
        out.append("")
    return out


def _csv(path: Path, sections: list[tuple[str, PerModel]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["samples", "model", "method", "compression_ratio", "budget", "average", "low", "high", "n"])
        for (_, per_model), label in zip(sections, ("common", "all"), strict=False):
            if len(sections) == 1:
                label = "all"
            for model, (_, lines) in per_model.items():
                for line in lines:
                    ratio = "" if line.budget is None else f"{ratio_of_budget(line.budget):g}"
                    budget = "full" if line.budget is None else f"{line.budget:g}"
                    w.writerow(
                        [
                            label,
                            model,
                            line.method,
                            ratio,
                            budget,
                            f"{line.average:.2f}",
                            f"{line.interval.low:.2f}",
                            f"{line.interval.high:.2f}",
                            line.n,
                        ]
                    )


def _plot(path: Path, protocol: Protocol, model: str, tasks: list[str], lines: list[SummaryLine]) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    by_pair = {(line.method, line.budget): line for line in lines}
    fig, ax = plt.subplots(figsize=(7.6, 4.8), dpi=120)
    palette = [plt.get_cmap("tab20")(i) for i in range(0, 20, 2)] + [plt.get_cmap("tab20")(i) for i in range(1, 20, 2)]
    colours: dict[str, Any] = {}
    ours = [m for m in _methods(lines) if m != FULL_METHOD and not m.startswith(KVPRESS_PREFIX)]
    theirs = [m for m in _methods(lines) if m.startswith(KVPRESS_PREFIX) and m != KVPRESS_PREFIX + "no_press"]
    for i, method in enumerate(ours + theirs):
        twin = COUNTERPARTS.get(method) or {v: k for k, v in COUNTERPARTS.items()}.get(method)
        colour = colours.get(twin or "", palette[len(colours) % len(palette)])  # a method and its press share one
        colours[method] = colour
        found = [
            (r, by_pair[(method, b)])
            for r, b in zip(protocol.compression_ratios, protocol.budgets, strict=True)
            if (method, b) in by_pair
        ]
        if not found:
            continue
        fewer = not all(line.complete for _, line in found)  # averaged over its own tasks, as the table marks it
        ax.plot(
            [r for r, _ in found],
            [line.average for _, line in found],
            marker="osD^v<>pPhX*"[i % 11],
            linestyle="--" if method in theirs else "-",
            color=colour,
            label=method + (f"{FEWER_TASKS} (fewer tasks or samples)" if fewer else ""),
        )
    full = by_pair.get((FULL_METHOD, None))
    if full is not None:
        ax.axhline(full.average, color="black", linestyle=":", linewidth=1.4, label="full cache")
    ax.set_xticks(list(protocol.compression_ratios), [f"{r:g}" for r in protocol.compression_ratios])
    ax.set_xlim(min(protocol.compression_ratios) - 0.05, max(protocol.compression_ratios) + 0.05)
    ax.set_ylim(-3, 103)
    ax.set_xlabel("compression ratio (fraction of the context removed, as kvpress states it)")
    ax.set_ylabel("mean score over tasks (%)")
    n = max((line.n for line in lines), default=0)
    sub = ", ".join(tasks) if len(tasks) <= 4 else f"{len(tasks)} tasks"
    ax.set_title(
        f"{protocol.name} protocol, {model}: RULER {protocol.length}, question-agnostic\n{sub}; up to {n} samples "
        "per point; dashed: kvpress's presses",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_protocol_report(
    out_dir: str | os.PathLike[str], rows: Iterable[dict[str, Any]], protocol: Protocol, *, plots: bool = True
) -> list[Path]:
    """Write the protocol's table (``protocol_<name>.md``/``.csv``) and, with ``plots``, one score-vs-ratio plot per
    model into ``out_dir``; returns the paths written.

    Parameters
    ----------
    out_dir : path-like
        The results folder.
    rows : iterable of dict
        Result rows (those of other suites, lengths or prompt layouts are left out: :func:`protocol_rows`).
    protocol : Protocol
        The protocol.
    plots : bool
        Draw the plots (needs matplotlib).
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    selected = protocol_rows(rows, protocol)
    common = common_rows(selected)
    per_model = protocol_lines(selected)
    sections: list[tuple[str, PerModel]] = [("", per_model)]
    if len(common) < len(selected):
        both = protocol_lines(common)
        sections = [(", the samples both sides ran", both), (", every sample (our methods on more samples)", per_model)]
        per_model = both
    md = directory / f"protocol_{protocol.name}.md"
    md.write_text(_markdown(protocol, sections), encoding="utf-8")
    csv_path = directory / f"protocol_{protocol.name}.csv"
    _csv(csv_path, sections)
    paths = [md, csv_path]
    if plots:
        for model, (tasks, lines) in per_model.items():
            suffix = f"_{_slug(model)}" if len(per_model) > 1 else ""
            paths.append(
                _plot(directory / f"score_vs_ratio_{protocol.name}{suffix}.png", protocol, model, tasks, lines)
            )
    return paths
