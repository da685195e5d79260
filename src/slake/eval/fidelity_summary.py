"""The output-level distance to the full cache in an evaluation's summary (rows written with ``--fidelity``).

``slake eval --fidelity`` teacher-forces the full cache's answer through every compressed cache and adds to each row
``kl``, the mean over the answer's tokens of KL(full || compressed) of the next-token distributions (nats per token),
and ``kl_tokens``. This module summarises those rows the way :mod:`slake.eval.summary` summarises scores: one table
per (model, suite, context length), a line per (method, budget) with the mean KL (the mean over tasks of each task's
mean over samples, every sample counting once) and its percentile bootstrap interval over samples
(:func:`slake.eval.stats.line_interval`, samples resampled within each task), and each line compared with the
closest method (lowest KL) at its budget on the samples both have (:func:`slake.eval.stats.paired_difference`). A KL
is continuous, so a few samples already give intervals far narrower than a 0/1 score's.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slake.eval.results import budget_label
from slake.eval.stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    Interval,
    PairedDifference,
    line_interval,
    paired_difference,
)

__all__ = ["FidelityLine", "FidelityTable", "fidelity_csv_rows", "fidelity_markdown", "fidelity_tables"]


@dataclass(frozen=True)
class FidelityLine:
    """One (method, budget): its mean KL with interval, and its paired difference to the closest method (None for
    the closest itself, for a pair sharing no sample with it, and at a budget where no pair was measured on every
    sample of every task that some line of the table has: only such a pair can be the closest)."""

    method: str
    budget: Any
    interval: Interval
    against_closest: PairedDifference | None
    #: samples whose KL was not finite (written as ``kl: null`` with ``kl_tokens`` > 0: the compressed cache's
    #: logits overflowed or were NaN), left out of ``interval``; a line with any is never the closest
    nonfinite: int = 0
    #: the line is the closest at its budget (the lowest mean KL among the lines measured on every sample of every
    #: task of the table, with no non-finite sample)
    is_closest: bool = False


@dataclass(frozen=True)
class FidelityTable:
    """The lines of one (model, suite, length), in the order the rows first name them."""

    model: str
    suite: str
    length: int
    lines: list[FidelityLine]

    @property
    def title(self) -> str:
        """The table's heading: suite, prompt length and model."""
        return f"{self.suite}, length {self.length}, model {self.model}"


def fidelity_tables(
    rows: Iterable[dict[str, Any]],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> list[FidelityTable]:
    """The KL tables of ``rows`` (rows without a KL measured, such as the full cache's, are left out; no table when
    no row has one). A row with ``kl_tokens`` > 0 and no ``kl`` (a KL that was not finite, written as null), or with a
    ``kl`` that is NaN or infinite (JSON's ``NaN``/``Infinity``, which the reader accepts), is counted in its line's
    ``nonfinite``, not silently dropped nor let into the mean."""
    groups: dict[tuple, dict[tuple, dict[tuple, dict[str, float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(dict))
    )
    order: dict[tuple, list[tuple]] = defaultdict(list)
    nonfinite: dict[tuple, dict[tuple, set[str]]] = defaultdict(lambda: defaultdict(set))
    for r in rows:
        kl = r.get("kl")
        if kl is None and not r.get("kl_tokens"):  # no KL measured (the full cache, a run without --fidelity)
            continue
        # a NaN mean would be the closest (no mean compares below NaN) and an infinite one breaks the interval
        finite = kl is not None and math.isfinite(float(kl))
        key = (str(r.get("model", "")), str(r.get("suite", "")), int(r["length"]))
        pair = (r["method"], r.get("budget"))
        if pair not in order[key]:
            order[key].append(pair)
        stratum, sample = (str(r["task"]), int(r["length"])), str(r["sample_id"])
        if finite and kl is not None:  # a later row of the same sample wins, as in the score tables
            groups[key][pair][stratum][sample] = float(kl)
            nonfinite[key][pair].discard(sample)
        else:
            groups[key][pair][stratum].pop(sample, None)
            nonfinite[key][pair].add(sample)
    tables = []
    for key in sorted(order):
        table = groups[key]
        intervals = {p: _interval(table[p], resamples, confidence) for p in order[key]}
        wanted: dict[tuple, set[str]] = defaultdict(set)  # every sample some line has, per task
        for p in order[key]:
            for stratum, by_sample in table[p].items():
                wanted[stratum] |= set(by_sample)
        closest: dict[Any, tuple] = {}
        for p in order[key]:  # only a pair measured on every sample of every task can be the closest: a mean over
            # fewer tasks or samples is not comparable with the others; nor can a pair with a non-finite KL left out
            b = p[1]
            if nonfinite[key][p] or any(not v <= set(table[p].get(s, {})) for s, v in wanted.items()):
                continue
            if b not in closest or intervals[p].mean < intervals[closest[b]].mean:
                closest[b] = p
        lines = []
        for p in order[key]:
            best = closest.get(p[1])
            diff = None
            if best is not None and p != best:
                try:
                    diff = paired_difference(table, p, best, resamples=resamples, confidence=confidence, scale=1.0)
                except ValueError:  # no sample in common: nothing to compare
                    diff = None
            lines.append(FidelityLine(p[0], p[1], intervals[p], diff, len(nonfinite[key][p]), p == best))
        tables.append(FidelityTable(key[0], key[1], key[2], lines))
    return tables


def _interval(scores: dict[tuple, dict[str, float]], resamples: int, confidence: float) -> Interval:
    """A line's mean KL with its interval; NaN without a finite sample."""
    if not any(scores.values()):
        nan = float("nan")
        return Interval(nan, nan, nan, 0, confidence)
    return line_interval(scores, resamples=resamples, confidence=confidence, scale=1.0)


def fidelity_markdown(tables: list[FidelityTable], confidence: float = DEFAULT_CONFIDENCE) -> str:
    """The tables as a markdown section (empty string without tables)."""
    if not tables:
        return ""
    level = f"{100 * confidence:g}%"
    out = [
        "## Output-level distance to the full cache (`--fidelity`)",
        "",
        "Mean KL(full || compressed) of the next-token distributions along the full cache's answer, nats per token "
        f"(the mean over tasks of each task's mean over samples), with its {level} bootstrap interval over samples; "
        "lower is closer to the full model. `vs closest`: the difference to the method with the lowest KL at the "
        "same budget on the samples both have (paired bootstrap); **bold** when its interval excludes 0. A sample "
        "whose KL was not finite (the compressed cache's logits overflowed or were NaN) is left out of its line's "
        "mean and counted beside it; such a line is never the closest.",
        "",
    ]
    for t in tables:
        out += [
            f"### {t.title}",
            "",
            f"| method | budget | KL | {level} CI | vs closest | {level} CI | n |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for line in t.lines:
            i, d = line.interval, line.against_closest
            if d is None:  # the closest itself, or no closest to compare with (none at the budget, no common sample)
                vs = "closest" if line.is_closest else "-"
            else:
                vs = f"**{d.diff:+.4f}**" if d.significant else f"{d.diff:+.4f}"
            vs_ci = "" if d is None else f"[{d.low:+.4f}, {d.high:+.4f}]"
            mark = f" ({line.nonfinite} non-finite left out)" if line.nonfinite else ""
            out.append(
                f"| {line.method} | {budget_label(line.budget)} | {i.mean:.4f}{mark} | [{i.low:.4f}, {i.high:.4f}] | "
                f"{vs} | {vs_ci} | {i.n} |"
            )
        out.append("")
    return "\n".join(out) + "\n"


def fidelity_csv_rows(tables: list[FidelityTable]) -> list[dict[str, Any]]:
    """One CSV row per line: model, suite, length, method, budget, kl, low, high, n, nonfinite, closest, diff,
    diff_low, diff_high, p."""
    out = []
    for t in tables:
        for line in t.lines:
            i, d = line.interval, line.against_closest
            out.append(
                {
                    "model": t.model,
                    "suite": t.suite,
                    "length": t.length,
                    "method": line.method,
                    "budget": budget_label(line.budget),
                    "kl": round(i.mean, 6),
                    "low": round(i.low, 6),
                    "high": round(i.high, 6),
                    "n": i.n,
                    "nonfinite": line.nonfinite,
                    "closest": "" if d is None else d.b[0],
                    "diff": "" if d is None else round(d.diff, 6),
                    "diff_low": "" if d is None else round(d.low, 6),
                    "diff_high": "" if d is None else round(d.high, 6),
                    "p": "" if d is None else round(d.p_value, 4),
                }
            )
    return out
