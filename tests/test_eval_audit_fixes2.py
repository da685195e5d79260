"""Regression tests for a second audit of the evaluation harness's scoring and task construction.

Each test failed before its fix:

* the dataset-level scorers (:func:`slake.eval.metrics.longbench_score`, :func:`slake.eval.metrics.ruler_score`)
  returned 0.0 for no predictions even when answers were given, although they promise a ``ValueError`` for
  predictions and answers of different lengths;
* the answer-list scorers took one bare string of answers as a sequence of one-character answers and silently scored
  each character (``string_match_part("a", "Paris")`` was 1.0);
* :func:`slake.eval.compare.write_comparison` with no line wrote the merged results and the summary, then failed with
  an ``IndexError``;
* :func:`slake.eval.suites.plan_suite` read an empty ``lengths`` or ``depths`` as "the default" (the command line
  refuses an empty ``--lengths``), and ran a repeated length or depth twice (the command line keeps one).
"""

from __future__ import annotations

import pytest

from slake.eval import metrics
from slake.eval.compare import compare_lines, write_comparison
from slake.eval.suites import plan_suite


def test_dataset_scores_refuse_answers_without_predictions() -> None:
    with pytest.raises(ValueError):
        metrics.longbench_score("hotpotqa", [], [["Paris"]])
    with pytest.raises(ValueError):
        metrics.ruler_score([], [["Paris"]], "all")
    assert metrics.ruler_score([], [], "all") == 0.0
    assert metrics.longbench_score("hotpotqa", [], []) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: metrics.string_match_part("a", "Paris"),
        lambda: metrics.string_match_all("Paris", "Paris"),
        lambda: metrics.needle_score("5 8 6", "586"),
        lambda: metrics.score_sample("part", "a", "Paris"),
        lambda: metrics.score_sample("hotpotqa", "Paris", "Paris"),
        lambda: metrics.longbench_sample_score("hotpotqa", "Paris", "Paris"),
        lambda: metrics.ruler_score(["a"], ["Paris"], "part"),
        lambda: metrics.longbench_score("hotpotqa", ["Paris"], ["Paris"]),
    ],
)
def test_one_string_of_answers_is_refused_not_scored_per_character(call) -> None:
    with pytest.raises(TypeError, match="sequence of answers"):
        call()


def test_answer_lists_still_score() -> None:
    assert metrics.string_match_part("a", ["Paris"]) == 0.0
    assert metrics.string_match_all("Paris and Rome", ("paris", "rome")) == 1.0
    assert metrics.needle_score("it is 586.", ["586"]) == 1.0
    assert metrics.longbench_sample_score("hotpotqa", "Paris", ["Paris"]) == 1.0


def test_a_comparison_of_no_line_is_refused_before_anything_is_written(tmp_path) -> None:
    with pytest.raises(ValueError, match="no line"):
        compare_lines([], [])
    with pytest.raises(ValueError, match="no line"):
        write_comparison(tmp_path / "out", [])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": []}, r"lengths \(--lengths\) must name at least one"),
        ({"depths": []}, r"depths \(--depths\) must name at least one"),
    ],
)
def test_plan_suite_refuses_an_empty_length_or_depth_list(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_suite("needle", **kwargs)


def test_plan_suite_keeps_one_of_each_repeated_length_and_depth() -> None:
    plan = plan_suite("needle", lengths=[64, 128, 64], depths=[50, 0, 50.0])
    assert plan.lengths == [64, 128]
    assert plan.depths == [50.0, 0.0]
