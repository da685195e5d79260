"""Needle and RULER samples say what they are, and the needle metric scores only the needle's own answer."""

from __future__ import annotations

import math

import pytest

from slake.eval.haystack import check_haystack_words, essay_words
from slake.eval.metrics import needle_score, score_sample
from slake.eval.needle import needle_grid, needle_sample
from slake.eval.ruler import ruler_sample
from test_eval_support import fake_essays
from tiny_models import word_tokenizer


@pytest.mark.parametrize(
    ("prediction", "answer", "found"),
    [
        ("The special magic number for Oslo is 5867520.", "5867520", 1.0),
        ("5867520", "5867520", 1.0),
        ("It is BOLD-OWL!", "bold-owl", 1.0),
        ("(5867520)", "5867520", 1.0),
        ("The number is _5867520_.", "5867520", 1.0),  # markdown italics
        ("**bold-owl**", "bold-owl", 1.0),
        ("58675201", "5867520", 0.0),  # before: 1.0, another number
        ("15867520", "5867520", 0.0),
        ("The special magic word for Oslo is bold-owl.", "old-owl", 0.0),  # before: 1.0, another word
        ("old-owls", "old-owl", 0.0),
        ("nothing", "5867520", 0.0),
    ],
)
def test_the_needle_metric_finds_the_answer_as_a_whole_word(prediction, answer, found):
    assert needle_score(prediction, [answer]) == found
    assert score_sample("contains", prediction, [answer]) == found


def test_the_needle_metric_takes_any_of_several_answers():
    assert needle_score("it is 42", ["7", "42"]) == 1.0
    assert needle_score("it is 42", []) == 0.0


def test_essays_without_a_sentence_end_are_refused_where_every_depth_would_be_zero():
    tok = word_tokenizer()
    flat = ["word " * 3000]
    with pytest.raises(ValueError, match="no sentence end"):  # before: depth 50 recorded, the needle at 0
        needle_sample(tok, 300, 50.0, essays=flat)
    with pytest.raises(ValueError, match="no sentence end"):
        ruler_sample("niah_single_2", tok, 300, essays=flat)
    with pytest.raises(ValueError, match="empty"):
        check_haystack_words([])
    # sentences ended by a CJK full stop are sentences: the needle goes to the depth asked for
    cjk = [" ".join(f"字{i % 7} 词{i % 5}。" for i in range(3000))]
    check_haystack_words(essay_words(cjk))
    s = needle_sample(tok, 300, 50.0, essays=cjk)
    assert abs(s.metadata["actual_depth"] - 50.0) < 5


def test_a_ruler_sample_at_a_chosen_depth_is_a_sample_of_its_own():
    tok, essays = word_tokenizer(), fake_essays(n_essays=4, sentences=60)
    plain = ruler_sample("niah_single_2", tok, 300, essays=essays)
    shallow = ruler_sample("niah_single_2", tok, 300, essays=essays, depth=10.0)
    deep = ruler_sample("niah_single_2", tok, 300, essays=essays, depth=90.0)
    # before: all three niah_single_2-300-0, three prompts under one id
    assert len({plain.sample_id, shallow.sample_id, deep.sample_id}) == 3
    assert shallow.sample_id == "niah_single_2-300-0-d10"
    for bad in (150.0, -40.0, math.nan):  # before: clamped to 100 or 0 without a word
        with pytest.raises(ValueError, match="depth"):
            ruler_sample("niah_single_2", tok, 300, essays=essays, depth=bad)


def test_one_text_given_as_the_essays_is_refused_where_it_would_be_read_letter_by_letter():
    tok = word_tokenizer()
    text = " ".join(fake_essays(n_essays=4, sentences=60))
    for make in (
        lambda e: needle_sample(tok, 300, 50.0, essays=e),
        lambda e: needle_grid(tok, [300], [50.0], essays=e)[0],
        lambda e: ruler_sample("niah_single_2", tok, 300, essays=e),
    ):
        # before: a haystack of single letters between spaces ("M e l l o w ..."), built without a word
        with pytest.raises(TypeError, match=r"pass \[text\]"):
            make(text)
        words = make([text]).context.split()
        assert sum(len(w) == 1 for w in words) < len(words) / 10  # a list of one text is read word by word
    with pytest.raises(TypeError, match="sequence of texts"):
        essay_words(text)
