"""RULER generators: target lengths, answers in context, determinism, task specifics."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from slake.eval.fitting import LengthFitError, fit_to_length
from slake.eval.prompts import build_prompt
from slake.eval.ruler import RULER_TASKS, TASK_SPECS, ruler_sample, ruler_samples, ruler_score
from slake.eval.ruler_words import FWE_NOISE

try:
    from test_eval_support import WordTokenizer, fake_essays, fake_qa_records
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.test_eval_support import WordTokenizer, fake_essays, fake_qa_records

ESSAYS = fake_essays()
SQUAD_LIKE = fake_qa_records(80, paragraphs=1, seed=1)
HOTPOT_LIKE = fake_qa_records(80, paragraphs=4, seed=2)


def make(task: str, length: int = 3000, seed: int = 0, **kw):
    records = SQUAD_LIKE if task == "qa_1" else HOTPOT_LIKE
    return ruler_sample(task, WordTokenizer(), length, seed=seed, essays=ESSAYS, qa_records=records, **kw)


def test_all_thirteen_tasks_registered():
    assert len(RULER_TASKS) == 13
    assert set(RULER_TASKS) == {
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    }


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("length", [1500, 6000])
def test_length_answers_and_layout(task, length):
    tok = WordTokenizer()
    s = make(task, length)
    text = s.context + s.question + s.answer_prefix
    assert s.length == len(tok.encode(text))
    assert abs(s.length - length) <= 0.02 * length
    assert s.answers and all(a in s.context for a in s.answers)
    assert s.task == task and s.metric == TASK_SPECS[task].metric
    assert s.max_new_tokens == TASK_SPECS[task].max_new_tokens
    # the question comes last and is not part of the context
    assert s.question.strip() and s.question not in s.context
    assert build_prompt(s).endswith(s.question + s.answer_prefix)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_deterministic_and_seed_dependent(task):
    a, b, c = make(task, seed=5), make(task, seed=5), make(task, seed=6)
    assert a.to_dict() == b.to_dict()
    assert a.context != c.context


def test_metric_values():
    assert TASK_SPECS["qa_1"].metric == "part" and TASK_SPECS["vt"].metric == "all"
    assert [TASK_SPECS[t].max_new_tokens for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_2")] == [
        128,
        30,
        120,
        50,
        32,
    ]


def test_niah_variants():
    assert len(make("niah_multivalue").answers) == 4
    assert len(make("niah_multiquery").answers) == 4
    mk1 = make("niah_multikey_1")
    assert len(mk1.answers) == 1 and mk1.context.count("special magic number for") == 4
    mk2 = make("niah_multikey_2")  # the haystack is made of needles
    assert mk2.context.count("special magic number for") > 50
    mk3 = make("niah_multikey_3")
    assert re.fullmatch(r"[0-9a-f-]{36}", mk3.answers[0]) and re.search(
        r"for [0-9a-f-]{36} is", mk3.question + mk3.context
    )
    s1 = make("niah_single_1")
    assert "The river keeps flowing toward the sea." in s1.context  # noise haystack
    assert re.fullmatch(r"\d{7}", s1.answers[0])


def test_niah_depth_control():
    shallow = make("niah_single_2", depth=0)
    deep = make("niah_single_2", depth=100)
    assert shallow.depth == pytest.approx(0.0, abs=3)
    assert deep.depth == pytest.approx(100.0, abs=3)
    assert shallow.context.index(shallow.answers[0]) < len(shallow.context) * 0.1
    assert deep.context.index(deep.answers[0]) > len(deep.context) * 0.9


def test_vt_chain_order():
    s = make("vt")
    names = s.answers
    assert len(names) == 5
    value = s.metadata["value"]
    assert f"VAR {names[0]} = {value}." in s.context
    positions = [s.context.index(f"VAR {names[i]} = VAR {names[i - 1]}.") for i in range(1, 5)]
    assert positions == sorted(positions)
    assert s.context.index(f"VAR {names[0]} = {value}.") < positions[0]


def test_cwe_counts():
    s = make("cwe", 6000)
    words = re.findall(r"\d+\. (\w+)", s.context)
    counts = Counter(words)
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(s.answers)
    assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in s.answers)


def test_fwe_counts():
    s = make("fwe", 6000)
    body = s.context.split("\n\n")[1].split()
    counts = Counter(w for w in body if w != FWE_NOISE)
    ranked = counts.most_common()
    assert {w for w, _ in ranked[:3]} == set(s.answers)
    assert ranked[2][1] > ranked[3][1]
    assert body.count(FWE_NOISE) > ranked[0][1]  # the noise token is the most frequent


def test_qa_gold_among_distractors():
    s = make("qa_2", 4000)
    assert s.context.count("Document ") >= 5
    assert s.metadata["record_id"].startswith("q")


def test_too_short_target_raises():
    with pytest.raises(LengthFitError):
        make("qa_2", 100)


def test_ruler_samples_and_score():
    samples = ruler_samples("niah_single_1", WordTokenizer(), 1200, 3, seed=10)
    assert len({s.context for s in samples}) == 3
    preds = [s.answers[0] for s in samples[:2]] + ["nothing"]
    assert ruler_score(preds, [s.answers for s in samples], "all") == pytest.approx(66.67)


def test_fit_to_length_search():
    tok = WordTokenizer()
    fit = fit_to_length(lambda n: "x " * n, str, tok, 1001, 10_000, tolerance=0.001)
    assert fit.length == 1000 and fit.size == 500  # "x " is two tokens
    with pytest.raises(LengthFitError, match="too small"):
        fit_to_length(lambda n: "header " * 10 + "x " * n, str, tok, 5, 100)
    with pytest.raises(LengthFitError, match="could only reach"):
        fit_to_length(lambda n: "x " * n, str, tok, 1000, 100)
