"""Metrics against hand-computed values."""

from __future__ import annotations

import pytest

from slake.eval import metrics as m


def test_normalize_answer():
    assert m.normalize_answer("The  Cat, sat on a mat!") == "cat sat on mat"
    assert m.normalize_zh_answer("北京， 是 首都。") == "北京是首都"


def test_qa_f1():
    # pred -> "cat sat on mat" (4), gold -> "cat on mat" (3): p = 3/4, r = 1
    assert m.qa_f1_score("The cat sat on the mat.", "cat on mat") == pytest.approx(6 / 7)
    assert m.qa_f1_score("Paris", "paris") == 1.0
    assert m.qa_f1_score("", "paris") == 0.0
    assert m.qa_f1_score("the", "a") == 0.0  # both normalise to nothing


def test_qa_f1_zh():
    pytest.importorskip("jieba")  # the extra slake[eval]; without it the Chinese metrics refuse to score
    assert m.qa_f1_zh_score("北京。", "北京") == 1.0
    assert m.qa_f1_zh_score("", "北京") == 0.0


def test_rouge():
    # the rouge package (LongBench's) counts distinct words: pred {the, cat, sat, on, mat} (5), gold 4, LCS words 4:
    # p = 4/5, r = 1, f = 2pr / (p + r + 1e-8); the value is the reference's (/tmp/audit_metrics/venv, rouge 1.0.1)
    assert m.rouge_score("the cat sat on the mat", "the cat on the mat") == pytest.approx(0.8888888839506174, abs=1e-12)
    assert m.rouge_score("", "anything") == 0.0
    assert m.rouge_score("a b c", "d e f") == 0.0


def test_classification():
    classes = ["Location", "Person", "Entity"]
    assert m.classification_score("Person and Location", "Person", all_classes=classes) == 0.5
    assert m.classification_score("Person", "Person", all_classes=classes) == 1.0
    assert m.classification_score("nothing", "Person", all_classes=classes) == 0.0
    assert m.classification_score("Sports News", "Sports News", all_classes=["News", "Sports News"]) == 1.0
    # the official loop removes while iterating: "AB" is skipped after "A" is removed
    assert m.classification_score("ABC", "ABC", all_classes=["A", "AB", "ABC"]) == 0.5


def test_retrieval_and_count():
    assert m.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval_score("Paragraph 3 or Paragraph 4", "Paragraph 3") == 0.5
    assert m.retrieval_score("I am not sure", "Paragraph 3") == 0.0
    assert m.retrieval_zh_score("段落5", "段落5") == 1.0
    assert m.retrieval_zh_score("段落5和段落6", "段落5") == 0.5
    assert m.count_score("There are 12 unique paragraphs; 12.", "12") == 1.0
    assert m.count_score("10 or 12", 12) == 0.5
    assert m.count_score("", "12") == 0.0


def test_code_sim():
    pred = "\n```python\nx = foo(1)\n"
    # first line without a backtick/#/// is "x = foo(1)"; LCS 9 of 10 + 10 chars
    assert m.code_sim_score(pred, "x = foo(2)") == pytest.approx(0.9)
    assert m.code_sim_score("# comment\nreturn a + b", "return a + b") == 1.0
    assert m.code_sim_score("", "abc") == 0.0
    assert m.code_sim_score("# only a comment", "") == 1.0  # fuzz.ratio("", "") is 100 (equal strings)
    assert m.code_sim_score("abcd", "abce") == 0.75


def test_dataset_scoring_rules():
    assert set(m.DATASET2METRIC) >= {"qasper", "lcc", "repobench-p", "trec", "vcsum", "passage_count"}
    classes = ["Location", "Person"]
    # trec: only the first line counts
    assert m.longbench_sample_score("trec", "Location\nPerson", ["Location"], classes) == 1.0
    assert m.longbench_sample_score("qasper", "Location\nPerson", ["Location"]) == pytest.approx(2 / 3)
    # max over ground truths
    assert m.longbench_sample_score("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    assert m.longbench_sample_score("qasper_e", "Paris", ["Paris"]) == 1.0
    assert m.longbench_score("hotpotqa", ["Paris", "Paris France"], [["Paris"], ["Paris"]]) == pytest.approx(83.33)


def test_ruler_and_needle_matching():
    answers = ["1234", "5678", "ABC"]
    assert m.string_match_all("1234 and abc", answers) == pytest.approx(2 / 3)
    assert m.string_match_part("1234 and abc", answers) == 1.0
    assert m.string_match_all("", answers) == 0.0
    assert m.string_match_part("", answers) == 0.0
    assert m.ruler_score(["1234 5678 abc", "1234"], [answers, answers], "all") == pytest.approx(66.67)
    assert m.ruler_score(["nope", "1234"], [answers, answers], "part") == 50.0
    assert m.needle_score("The magic number is 7654321.", ["7654321"]) == 1.0


def test_score_sample_dispatch():
    assert m.score_sample("all", "a b", ["a", "c"]) == 0.5
    assert m.score_sample("part", "a b", ["a", "c"]) == 1.0
    assert m.score_sample("contains", "A", ["a"]) == 1.0
    assert m.score_sample("lcc", "x = 1", ["x = 1"]) == 1.0
    with pytest.raises(KeyError):
        m.score_sample("nope", "", [])


def test_score_prediction_uses_sample_fields():
    from slake.eval.sample import Sample

    s = Sample("trec", "ctx", "q", ["City"], "trec", 64, metadata={"all_classes": ["City", "Country"]})
    assert m.score_prediction(s, "City\nCountry") == 1.0
    assert m.score_prediction(s, "City or Country") == 0.5


def test_summary_rows_count_a_sample_once_like_the_tables():
    # sample "a" written twice (a rerun appending to results.jsonl): the tables keep its later row
    # (stats.score_table), and so must the --json rows: a = 1.0 (later row), b = 0.0 -> 50.0 over n = 2
    from slake.eval.summary import summary_rows, summary_tables

    base = {"model": "m", "suite": "ruler", "task": "vt", "length": 4096, "method": "full", "budget": None}
    rows = [
        {**base, "sample_id": "a", "score": 0.0},
        {**base, "sample_id": "b", "score": 0.0},
        {**base, "sample_id": "a", "score": 1.0},
    ]
    (row,) = summary_rows(rows)
    assert (row["n"], row["score"]) == (2, 50.0)
    (table,) = summary_tables(rows, resamples=10)
    assert table.lines[0].cells["vt"] == (50.0, 2)
