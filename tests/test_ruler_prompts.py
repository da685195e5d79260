"""RULER's prompts as RULER words them where it matters to the task (an audit against NVIDIA/RULER): a needle task
with one answer asks in the singular (RULER's ``niah.py`` switches when queries x values == 1), and variable
tracking's answer prefix says how many variables to list (RULER's ``{num_v} variables are assigned the value``)."""

from __future__ import annotations

import pytest

from slake.eval.ruler_niah import NIAH_TASKS, niah_renderer
from slake.eval.ruler_vt import vt_renderer

SINGLE = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3"]


@pytest.mark.parametrize("task", SINGLE)
def test_a_needle_task_with_one_answer_asks_in_the_singular(task):
    """Before, every needle task asked "What are all the special magic numbers ..." and prefixed "... are", also
    where exactly one value answers."""
    draft = niah_renderer(NIAH_TASKS[task], seed=0, essays=["One sentence here. Another one there."] * 50)(40)
    assert len(draft.answers) == 1
    one = "uuid" if NIAH_TASKS[task].value_type == "uuids" else "number"
    assert draft.context.startswith(f"A special magic {one} is hidden")
    assert draft.question.startswith(f"What is the special magic {one} for ")
    assert draft.answer_prefix.endswith(" mentioned in the text above is")


@pytest.mark.parametrize("task", ["niah_multivalue", "niah_multiquery"])
def test_a_needle_task_with_several_answers_asks_for_all_of_them(task):
    draft = niah_renderer(NIAH_TASKS[task], seed=0, essays=["One sentence here. Another one there."] * 50)(40)
    assert len(draft.answers) == 4
    assert draft.question.startswith("What are all the special magic numbers for ")
    assert draft.answer_prefix.endswith(" mentioned in the text above are")


def test_variable_tracking_says_how_many_variables_to_list():
    """string_match_all needs all five variables of the 4-hop chain; the prefix now says five, as RULER's does."""
    draft = vt_renderer(seed=0)(40)
    assert len(draft.answers) == 5
    assert " 5 variables hold the value " in draft.answer_prefix
