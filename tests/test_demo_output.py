"""``slake demo`` prints answers as text a person reads, not as Python reprs."""

from slake.cli.demo import answer_excerpt


def test_answer_excerpt_collapses_line_breaks_and_the_leading_colon():
    assert answer_excerpt(":\n\n1. 4680899\n2. 4680899") == "1. 4680899 2. 4680899"
    assert "\\n" not in answer_excerpt("a\nb") and answer_excerpt("a\nb") == "a b"


def test_answer_excerpt_cuts_long_answers_at_a_word_boundary():
    text = " ".join(["word"] * 40)
    out = answer_excerpt(text, width=30)
    assert out.endswith(" ...") and len(out) <= 34 and " wor ..." not in out


def test_answer_excerpt_says_when_the_answer_is_empty():
    assert answer_excerpt("") == "(empty answer)"
    assert answer_excerpt(" \n: ") == "(empty answer)"
