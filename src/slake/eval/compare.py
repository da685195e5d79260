"""Compare configurations measured in different result folders, on the samples they share.

``slake eval``'s summary compares the lines of one folder. A calibrated profile, a hyperparameter or a code change is
often evaluated later, into a folder of its own, on the same samples (same suite, lengths, seed and sample count, so the
same ``sample_id``). This module puts named lines from several folders into one: each line is ``DIR:METHOD:LABEL`` (the
rows of ``METHOD`` in ``DIR/results.jsonl``, renamed ``LABEL``), the full cache's rows are taken once (from the first
folder that has each sample; folders whose rows of one sample id record different prompts, ``sample_digest``, are
refused: their rows would be paired as one sample), and the folder gets the usual summary
(:func:`slake.eval.summary.write_summary`: scores, intervals and, for rows written with ``--fidelity``, the KL table)
plus ``comparison.md`` and ``comparison.csv``: for each consecutive pair of lines (the second minus the first) and each
(length, budget) both have, the paired difference of scores (points) and of KL (nats per token), each with its paired
bootstrap interval (:func:`slake.eval.stats.paired_difference`, samples resampled within each task). A sample whose KL
was not finite (``kl: null`` with ``kl_tokens`` > 0) is left out of the KL difference and counted beside it, and the KL
difference says on how many samples it stands, as the score's does.

Command line::

    python -m slake.eval.compare OUT DIR_A:METHOD:LABEL_A DIR_B:METHOD:LABEL_B [DIR_C:...:LABEL_C DIR_D:...]

A line may be repeated to compare it with several others (``A B A C``: B - A, then C - A).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slake.eval.results import RESULTS_FILE, budget_label, read_results, summary_view
from slake.eval.stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    PairedDifference,
    paired_difference,
    score_table,
)
from slake.eval.summary import budget_sort_key, write_summary

__all__ = ["Line", "compare_lines", "merge_lines", "parse_line", "write_comparison"]


@dataclass(frozen=True)
class Line:
    """The rows of ``method`` in ``folder``'s results, shown as ``label``."""

    folder: Path
    method: str
    label: str


def parse_line(spec: str) -> Line:
    """``DIR:METHOD:LABEL`` as a :class:`Line` (the label may contain colons; a method spec may not).

    Raises
    ------
    ValueError
        When a part is missing or empty.
    """
    parts = spec.split(":", 2)
    if len(parts) != 3 or not all(p.strip() for p in parts):
        raise ValueError(f"a line is DIR:METHOD:LABEL, got {spec!r}")
    return Line(Path(parts[0]), parts[1].strip(), parts[2].strip())


@functools.cache
def _canonical(method: str) -> str:
    """``method`` as a canonical spec (``SLAKE[window=8,VABS=false]`` and ``slake[vabs=false,window=8]`` name the same
    rows, as :func:`slake.methods.spec.parse_method_spec` promises), a chunked-prefill suffix kept; unchanged when it
    does not parse (a row of a method this version does not know)."""
    from slake.methods.base import canonical_method_spec

    base, sep, suffix = method.partition(" (")
    try:
        return canonical_method_spec(base) + sep + suffix
    except ValueError:
        return method


def _refuse_two_spellings(rows: Sequence[dict[str, Any]], line: Line) -> None:
    """Refuse rows of one line written under two spellings of its spec for the same sample and budget: ``slake
    eval`` resumes by the spec as written, so ``slake[alpha=1]`` and ``slake[alpha=1.0]`` are two runs in one folder,
    and the line would count the sample twice."""
    seen: dict[tuple[Any, ...], str] = {}
    for r in rows:
        key = (r.get("task"), r.get("sample_id"), r.get("budget"), r.get("length"), r.get("model"))
        spelling = str(r.get("method"))
        first = seen.setdefault(key, spelling)
        if first != spelling:
            raise ValueError(
                f"{line.folder / RESULTS_FILE} holds rows of {line.method!r} under two spellings, {first!r} and "
                f"{spelling!r}, for the same sample ({r.get('sample_id')!r}, budget {r.get('budget')}): name one "
                f"of them exactly"
            )


def _refuse_other_prompts(rows: Iterable[dict[str, Any]], line: Line, seen: dict[tuple, tuple[str, Path]]) -> None:
    """Refuse a row whose sample id was seen (in an earlier folder, or earlier in this one) with another prompt: a
    sample id names the task, length and seed, not the text (:func:`slake.eval.sample.sample_digest`), and rows of
    two prompts under one id would be paired as one sample. Rows without ``sample_digest`` (written before it)
    are not checked."""
    for r in rows:
        digest = r.get("sample_digest")
        if not digest:
            continue
        key = (str(r.get("model", "")), str(r.get("suite", "")), str(r["task"]), int(r["length"]), str(r["sample_id"]))
        first, where = seen.setdefault(key, (str(digest), line.folder))
        if first != str(digest):
            raise ValueError(
                f"sample {r['sample_id']!r} ({r['task']}, length {r['length']}, model {key[0]!r}) was another prompt "
                f"in {where} (digest {first}) than in {line.folder} (digest {digest}): its rows would be paired as one "
                "sample; compare folders made from the same prompts"
            )


def merge_lines(lines: Sequence[Line]) -> list[dict[str, Any]]:
    """The rows of every line, ``method`` replaced by its label, and the full cache's rows once per sample (of each
    model and suite). Rows measured with chunked prefill are their own method, ``"<method> (prefill_chunk=N)"``, as
    in the summaries (:func:`slake.eval.results.summary_view`), so a line of exact rows never takes them. A line
    given twice (the same folder, method and label, as the first of several pairs) counts once.

    Raises
    ------
    ValueError
        When one label names two different lines, a label is ``full``, a folder has no results file or no row
        of its line's method, a line's rows come from several models or suites (their samples share ids), or two
        folders' rows of one sample id record different prompts (``sample_digest``).
    """
    unique: dict[str, Line] = {}
    for line in lines:
        if unique.setdefault(line.label, line) != line:
            raise ValueError(f"the label {line.label!r} names two different lines; labels must differ")
    if "full" in unique:
        raise ValueError("'full' names the full cache's rows, which are included once; choose another label")
    merged: list[dict[str, Any]] = []
    full_seen: set[tuple[str, str, str, int, str]] = set()
    digests: dict[tuple, tuple[str, Path]] = {}
    for line in unique.values():
        if not (line.folder / RESULTS_FILE).is_file():
            raise ValueError(f"no {RESULTS_FILE} in {line.folder}")
        rows = summary_view(read_results(line.folder / RESULTS_FILE))
        wanted = _canonical(line.method)
        matched = [r for r in rows if _canonical(str(r.get("method"))) == wanted]
        _refuse_two_spellings(matched, line)
        mine = [dict(r, method=line.label) for r in matched]
        if not mine:
            found = sorted({str(r.get("method")) for r in rows})
            raise ValueError(f"{line.folder / RESULTS_FILE} has no row of {line.method!r} (it has: {found})")
        sources = sorted({(str(r.get("model", "")), str(r.get("suite", ""))) for r in mine})
        if len(sources) > 1:
            named = ", ".join(f"model {m!r} suite {s!r}" for m, s in sources)
            raise ValueError(
                f"the rows of {line.method!r} in {line.folder / RESULTS_FILE} come from {len(sources)} models or "
                f"suites ({named}), whose samples share ids: a line must be one model's rows of one suite; put each "
                "model's rows in a folder of its own"
            )
        _refuse_other_prompts([r for r in rows if r.get("method") == "full"] + matched, line, digests)
        for r in rows:
            model, suite = str(r.get("model", "")), str(r.get("suite", ""))
            key = (model, suite, str(r["task"]), int(r["length"]), str(r["sample_id"]))
            if r.get("method") == "full" and key not in full_seen:
                full_seen.add(key)
                merged.append(r)
        merged.extend(mine)
    return merged


@dataclass(frozen=True)
class Comparison:
    """``second - first`` at one (length, budget): scores in points, KL in nats per token (None without KL rows;
    ``kl.n`` counts its samples, which may be fewer than ``score.n``)."""

    first: str
    second: str
    length: int
    budget: Any
    score: PairedDifference
    kl: PairedDifference | None
    #: rows of the two lines at this (length, budget), one per line and sample, whose KL was not finite (``kl: null``
    #: with ``kl_tokens`` > 0: the compressed cache's logits overflowed or were NaN), left out of ``kl``
    kl_nonfinite: int = 0


def _kl_split(rows: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The rows with a finite KL (as scores), and how many (line, sample) had a KL measured that was not finite (a
    later row of a sample wins, as in :func:`slake.eval.stats.score_table`)."""
    finite: dict[tuple, dict[str, Any] | None] = {}
    for r in rows:
        key = (r["method"], r.get("budget"), str(r["task"]), int(r["length"]), str(r["sample_id"]))
        kl = r.get("kl")
        if kl is not None and math.isfinite(float(kl)):
            finite[key] = dict(r, score=float(kl))
        elif kl is not None or r.get("kl_tokens"):  # measured, not finite
            finite[key] = None
        else:
            finite.pop(key, None)  # no KL measured (a run without --fidelity)
    return [r for r in finite.values() if r is not None], sum(r is None for r in finite.values())


def compare_lines(
    rows: Iterable[dict[str, Any]],
    labels: Sequence[str],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> list[Comparison]:
    """Paired differences of each consecutive pair of ``labels`` (second minus first), per length and budget.

    Raises
    ------
    ValueError
        When ``labels`` is empty or has an odd count, or a pair shares no (length, budget) with common samples.
    """
    if not labels:
        raise ValueError("no line to compare: give lines in pairs (first, second)")
    if len(labels) % 2:
        raise ValueError(f"lines are compared in pairs (first, second); got {len(labels)}")
    rows = list(rows)
    out: list[Comparison] = []
    for first, second in zip(labels[0::2], labels[1::2], strict=True):
        cells = sorted(
            {(int(r["length"]), r["budget"]) for r in rows if r["method"] == first}
            & {(int(r["length"]), r["budget"]) for r in rows if r["method"] == second},
            key=lambda c: (c[0], budget_sort_key(c[1])),
        )
        for length, budget in cells:
            sub = [r for r in rows if int(r["length"]) == length and r["method"] in (first, second)]
            scores = score_table(sub)
            try:
                d_score = paired_difference(
                    scores, (second, budget), (first, budget), resamples=resamples, confidence=confidence
                )
            except ValueError:
                continue
            kl_rows, nonfinite = _kl_split(r for r in sub if r["budget"] == budget)
            kls = score_table(kl_rows)
            try:
                d_kl: PairedDifference | None = paired_difference(
                    kls, (second, budget), (first, budget), resamples=resamples, confidence=confidence, scale=1.0
                )
            except ValueError:  # a line without KL rows (run without --fidelity), or none in common
                d_kl = None
            out.append(Comparison(first, second, length, budget, d_score, d_kl, nonfinite))
        if not any(c.first == first and c.second == second for c in out):
            raise ValueError(f"{first!r} and {second!r} share no sample at any length and budget")
    return out


def _cell(d: PairedDifference | None, fmt: str) -> tuple[str, str]:
    if d is None:
        return "", ""
    text = format(d.diff, fmt)
    ci = f"[{d.low:{fmt}}, {d.high:{fmt}}]" if d.measured else "-"  # one sample per task: no interval
    return (f"**{text}**" if d.significant else text), ci


def write_comparison(
    out_dir: str | os.PathLike[str],
    lines: Sequence[Line],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> list[Comparison]:
    """Write ``OUT/results.jsonl`` (the merged rows), its summary, ``OUT/comparison.md`` and ``OUT/comparison.csv``.

    Parameters
    ----------
    out_dir : path-like
        The comparison's folder (created; an existing ``results.jsonl`` there is replaced).
    lines : sequence of Line
        An even number of lines (at least two), compared in consecutive pairs.
    resamples, confidence
        As in :func:`slake.eval.stats.paired_difference`.

    Returns
    -------
    list of Comparison
        As :func:`compare_lines`.

    Raises
    ------
    ValueError
        As :func:`merge_lines` and :func:`compare_lines` (no line, an odd count ...), before anything is written.
    """
    labels = [line.label for line in lines]
    rows = merge_lines(lines)
    comparisons = compare_lines(rows, labels, resamples=resamples, confidence=confidence)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RESULTS_FILE, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    write_summary(out, rows, resamples=resamples, confidence=confidence)
    level = f"{confidence:.0%}"
    md = [
        "# Paired comparisons (second line minus first) on the samples both have",
        "",
        "Lines: " + "; ".join(f"`{line.label}` = `{line.method}` in `{line.folder}`" for line in lines) + ".",
        f"Score in points, KL(full || compressed) in nats per token, each with its {level} paired bootstrap "
        "interval (samples resampled within each task); **bold** where the interval excludes 0; `-`: no interval "
        "(one sample per task). `n`: samples of the score difference; `KL n`: of the KL difference, a sample whose "
        "KL was not finite left out and counted beside it.",
        "",
        "| second - first | length | budget | score | interval | KL | interval | n | KL n |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    csv_rows = []
    for c in comparisons:
        s, s_ci = _cell(c.score, "+.1f")
        k, k_ci = _cell(c.kl, "+.3f")
        kl_n = ("" if c.kl is None else str(c.kl.n)) + (
            f" ({c.kl_nonfinite} non-finite left out)" if c.kl_nonfinite else ""
        )
        md.append(
            # the budget as every summary labels it: "full" (not "None"), 128 (not a hand-made row's 128.0)
            f"| {c.second} - {c.first} | {c.length} | {budget_label(c.budget)} | {s} | {s_ci} | {k} | {k_ci} | "
            f"{c.score.n} | {kl_n} |"
        )
        csv_rows.append(
            {
                "first": c.first,
                "second": c.second,
                "length": c.length,
                "budget": budget_label(c.budget),
                "score_diff": round(c.score.diff, 4),
                "score_low": round(c.score.low, 4),
                "score_high": round(c.score.high, 4),
                "kl_diff": "" if c.kl is None else round(c.kl.diff, 6),
                "kl_low": "" if c.kl is None else round(c.kl.low, 6),
                "kl_high": "" if c.kl is None else round(c.kl.high, 6),
                "n": c.score.n,
                "kl_n": "" if c.kl is None else c.kl.n,
                "kl_nonfinite": c.kl_nonfinite,
            }
        )
    (out / "comparison.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    with open(out / "comparison.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        writer.writeheader()
        writer.writerows(csv_rows)
    return comparisons


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slake.eval.compare OUT LINE LINE [LINE LINE ...]``; exit code 2 with one line on bad input."""
    ap = argparse.ArgumentParser(
        prog="python -m slake.eval.compare",
        description="Compare lines from several result folders on their common samples (pairs: second - first).",
    )
    ap.add_argument("out", help="the comparison's folder")
    ap.add_argument("lines", nargs="+", help="DIR:METHOD:LABEL, an even number, compared in consecutive pairs")
    ap.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    args = ap.parse_args(argv)
    try:
        lines = [parse_line(s) for s in args.lines]
        comparisons = write_comparison(args.out, lines, resamples=args.resamples)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(args.out) / "comparison.md").read_text(encoding="utf-8"), end="")
    print(f"{len(comparisons)} comparisons written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
