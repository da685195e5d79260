"""Bootstrap intervals and paired comparisons of evaluation scores (slake.eval.stats), and how the summaries show
them."""

from __future__ import annotations

import csv
import math
import random

import pytest

from slake.eval.stats import line_interval, paired_difference, score_table
from slake.eval.summary import summary_tables, write_summary


def _rows(method, budget, scores_by_task, length=8192):
    return [
        {"task": t, "sample_id": f"{t}-{i}", "method": method, "budget": budget, "length": length, "score": s}
        for t, scores in scores_by_task.items()
        for i, s in enumerate(scores)
    ]


def test_constant_scores_give_a_zero_width_interval():
    table = score_table(_rows("m", 64, {"a": [1.0] * 5, "b": [0.0] * 3}))
    i = line_interval(table[("m", 64)])
    assert (i.mean, i.low, i.high, i.n) == (50.0, 50.0, 50.0, 8)


def test_average_is_the_mean_of_task_means_with_unequal_counts():
    """The statistic is the summary's macro average: task a (1 sample at 100) weighs as much as task b (3 at 0)."""
    i = line_interval(score_table(_rows("m", 64, {"a": [1.0], "b": [0.0, 0.0, 0.0]}))[("m", 64)])
    assert i.mean == 50.0


def test_interval_width_matches_the_normal_approximation_for_many_coin_flips():
    rng = random.Random(3)
    flips = [float(rng.random() < 0.5) for _ in range(400)]
    i = line_interval(score_table(_rows("m", 64, {"a": flips}))[("m", 64)], resamples=4000)
    p = sum(flips) / len(flips)
    normal = 1.96 * math.sqrt(p * (1 - p) / len(flips)) * 100
    assert i.low < i.mean < i.high
    assert abs(i.half_width - normal) < 0.15 * normal


def test_intervals_are_reproducible_and_depend_on_the_seed():
    rng = random.Random(0)
    table = score_table(_rows("m", 64, {"a": [rng.random() for _ in range(30)]}))
    assert line_interval(table[("m", 64)]) == line_interval(table[("m", 64)])
    assert line_interval(table[("m", 64)], seed=1) != line_interval(table[("m", 64)], seed=2)


def test_pairing_resolves_a_difference_the_separate_intervals_do_not():
    """A beats B by 5 points on every sample while both spread from 0 to 90: the lines' intervals overlap, the
    paired difference is exactly 5 with a zero-width interval, and it is significant."""
    base = [0.9 * k / 19 for k in range(20)]
    rows = _rows("a", 128, {"t": [x + 0.05 for x in base]}) + _rows("b", 128, {"t": base})
    table = score_table(rows)
    ia, ib = line_interval(table[("a", 128)]), line_interval(table[("b", 128)])
    assert ia.low < ib.high  # the separate intervals overlap
    d = paired_difference(table, ("a", 128), ("b", 128))
    assert d.diff == pytest.approx(5.0) and d.low == pytest.approx(5.0) and d.high == pytest.approx(5.0)
    assert d.significant and d.p_value == 0.0 and d.n == 20


def test_identical_lines_differ_by_nothing():
    rng = random.Random(1)
    scores = {"t": [float(rng.random() < 0.6) for _ in range(25)]}
    table = score_table(_rows("a", 64, scores) + _rows("b", 64, scores))
    d = paired_difference(table, ("a", 64), ("b", 64))
    assert (d.diff, d.low, d.high, d.p_value, d.significant) == (0.0, 0.0, 0.0, 1.0, False)


def test_a_noisy_small_difference_is_not_significant():
    rng = random.Random(2)
    a = [float(rng.random() < 0.5) for _ in range(10)]
    b = [float(rng.random() < 0.5) for _ in range(10)]
    d = paired_difference(score_table(_rows("a", 64, {"t": a}) + _rows("b", 64, {"t": b})), ("a", 64), ("b", 64))
    assert d.low < 0 < d.high and not d.significant and d.p_value > 0.05


def test_paired_uses_the_common_samples_only():
    rows = _rows("a", 64, {"t": [1.0, 1.0, 1.0]}) + _rows("b", 64, {"t": [0.0, 0.0]})
    d = paired_difference(score_table(rows), ("a", 64), ("b", 64))
    assert d.n == 2 and d.diff == 100.0
    with pytest.raises(ValueError, match="no rows"):
        paired_difference(score_table(rows), ("a", 64), ("c", 64))
    with pytest.raises(ValueError, match="share no sample"):
        paired_difference(score_table(rows + _rows("c", 64, {"u": [1.0]})), ("a", 64), ("c", 64))


def test_bad_parameters_are_refused():
    table = score_table(_rows("m", 64, {"a": [1.0]}))
    with pytest.raises(ValueError, match="resamples"):
        line_interval(table[("m", 64)], resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        line_interval(table[("m", 64)], confidence=1.0)


def test_summary_marks_significant_differences_against_the_best(tmp_path):
    base = [0.9 * k / 19 for k in range(20)]
    rows = (
        _rows("full", None, {"t": [1.0] * 20})
        + _rows("good", 128, {"t": [x + 0.05 for x in base]})
        + _rows("bad", 128, {"t": base})
        + _rows("same", 128, {"t": [x + 0.05 for x in base]})
    )
    for r in rows:
        r.update(model="m", suite="ruler")
    (table,) = summary_tables(rows)
    assert [(d.a[0], d.b[0]) for d in table.against_best] == [("bad", "good"), ("same", "good")]
    assert {(d.a, d.b) for d in table.paired} == {
        (("good", 128), ("bad", 128)),
        (("good", 128), ("same", 128)),
        (("bad", 128), ("same", 128)),
    }
    md, _ = write_summary(tmp_path, rows)
    text = md.read_text()
    assert "| 128 | bad | good | **-5.0** | [-5.0, -5.0] | 0.000 | 20 |" in text
    assert "| 128 | same | good | +0.0 | [+0.0, +0.0] | 1.000 | 20 |" in text
    with open(tmp_path / "paired.csv") as fh:
        paired = list(csv.DictReader(fh))
    assert len(paired) == 3 and {p["significant"] for p in paired} == {"True", "False"}
    with open(tmp_path / "intervals.csv") as fh:
        intervals = list(csv.DictReader(fh))
    assert {(p["method"], p["task"]) for p in intervals} >= {("full", "t"), ("full", "average"), ("bad", "average")}


def test_one_sample_per_stratum_has_no_interval_and_no_significance(tmp_path):
    """Resampling one sample per (task, length) cannot move the statistic: the interval was [x, x] and the paired
    difference of a single sample, or of one sample per task, was significant with p 0 (a wins 3 tasks of 5 and ties
    2: +60 [60, 60], p 0.000, where a sign test gives p 0.25)."""
    single = score_table(_rows("a", 64, {"t": [1.0]}) + _rows("b", 64, {"t": [0.0]}))
    d = paired_difference(single, ("a", 64), ("b", 64))
    assert d.diff == 100.0 and d.n == 1 and not d.significant
    assert math.isnan(d.low) and math.isnan(d.high) and math.isnan(d.p_value)
    one_each = _rows("a", 64, {f"t{k}": [1.0] for k in range(5)}) + _rows(
        "b", 64, {f"t{k}": [0.0 if k < 3 else 1.0] for k in range(5)}
    )
    d = paired_difference(score_table(one_each), ("a", 64), ("b", 64))
    assert d.diff == pytest.approx(60.0) and d.n == 5 and not d.significant and math.isnan(d.p_value)
    i = line_interval(score_table(one_each)[("a", 64)])
    assert i.mean == 100.0 and i.n == 5 and math.isnan(i.low) and math.isnan(i.high)
    # a stratum of two samples is something to resample: the interval is back
    i = line_interval(score_table(_rows("m", 64, {"t": [1.0, 0.0], "u": [1.0]}))[("m", 64)])
    assert i.low < i.mean < i.high
    rows = one_each + _rows("full", None, {f"t{k}": [1.0] for k in range(5)}) + _rows("c", 64, {"t0": [0.0]})
    for r in rows:
        r.update(model="m", suite="ruler")
    md, _ = write_summary(tmp_path, rows, resamples=200)
    text = md.read_text()
    assert "| a | 64 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | - | 5 |" in text
    assert "| 64 | b | a | -60.0 | - | - | 5 |" in text  # not bold, no interval, no p


def test_an_interval_does_not_depend_on_the_order_of_the_rows():
    """The same rows appended in another order (a run split over several processes) gave another interval."""
    rng = random.Random(4)
    rows = _rows("m", 64, {"a": [rng.random() for _ in range(20)], "b": [float(rng.random() < 0.5) for _ in range(9)]})
    shuffled = list(rows)
    random.Random(5).shuffle(shuffled)
    assert line_interval(score_table(rows)[("m", 64)]) == line_interval(score_table(shuffled)[("m", 64)])
    assert line_interval(score_table(rows)[("m", 64)]) == line_interval(score_table(rows[::-1])[("m", 64)])
