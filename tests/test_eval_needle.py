"""Needle-in-a-haystack generator."""

from __future__ import annotations

import re

import pytest

from slake.eval.needle import needle_grid, needle_sample, needle_score

try:
    from test_eval_support import WordTokenizer, fake_essays
except ImportError:  # pragma: no cover
    from tests.test_eval_support import WordTokenizer, fake_essays

ESSAYS = fake_essays()


@pytest.mark.parametrize("kind", ["word", "number"])
@pytest.mark.parametrize("length", [800, 5000])
@pytest.mark.parametrize("depth", [0, 35, 100])
def test_length_depth_and_answer(kind, length, depth):
    tok = WordTokenizer()
    s = needle_sample(tok, length, depth, kind=kind, seed=2, essays=ESSAYS)
    assert abs(s.length - length) <= 0.02 * length
    assert s.length == len(tok.encode(s.context + s.question + s.answer_prefix))
    needle = s.metadata["needle"]
    assert needle in s.context and s.answers[0] in needle
    assert s.depth == depth and s.metric == "contains"
    assert abs(s.metadata["actual_depth"] - depth) < 8  # snapped to a sentence boundary
    # the needle sits at a sentence boundary: preceded by the instruction or a sentence end
    before = s.context[: s.context.index(needle)].rstrip()
    assert before.endswith((".", "?", "!"))
    assert s.question.startswith("Question:") and kind in s.question
    if kind == "number":
        assert re.fullmatch(r"\d{7}", s.answers[0])
    else:
        assert re.fullmatch(r"[a-z]+-[a-z]+", s.answers[0])


def test_deterministic_and_seeded():
    tok = WordTokenizer()
    a = needle_sample(tok, 1000, 50, seed=1, essays=ESSAYS)
    b = needle_sample(tok, 1000, 50, seed=1, essays=ESSAYS)
    c = needle_sample(tok, 1000, 50, seed=2, essays=ESSAYS)
    assert a.to_dict() == b.to_dict()
    assert a.context != c.context


def test_long_context_cycles_the_essays():
    s = needle_sample(WordTokenizer(), 60_000, 50, essays=ESSAYS[:2])
    assert abs(s.length - 60_000) <= 1200


def test_bad_depth():
    with pytest.raises(ValueError):
        needle_sample(WordTokenizer(), 1000, 120, essays=ESSAYS)


def test_grid_and_scoring():
    grid = needle_grid(WordTokenizer(), [600, 1200], [0, 50, 100], essays=ESSAYS)
    assert [(s.metadata["target_length"], s.depth) for s in grid] == [
        (600, 0),
        (600, 50),
        (600, 100),
        (1200, 0),
        (1200, 50),
        (1200, 100),
    ]
    s = grid[0]
    assert needle_score(f"It is {s.answers[0].upper()}.", s.answers) == 1.0
    assert needle_score("I do not know.", s.answers) == 0.0
    assert needle_score("", s.answers) == 0.0
