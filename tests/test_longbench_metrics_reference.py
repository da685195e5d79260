"""LongBench metrics against the reference implementation's own scores.

Every expected value below was computed by the reference: LongBench v1's ``LongBench/metrics.py`` with the packages
its ``requirements.txt`` installs (``rouge==1.0.1``, ``fuzzywuzzy==0.18.0`` without python-Levenshtein,
``jieba==0.42.1``), in a separate virtual environment (/tmp/audit_metrics/venv, not a dependency of the tests). The
same comparison on a few hundred random inputs per metric found every score equal.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from slake.eval import metrics as m

_GOLD = (
    "The Department of Defense (DOD) spent about $3.5 billion on the program in fiscal year 2019. "
    "GAO found that DOD did not fully assess the risks of the program and that the program's cost estimates "
    "were not reliable. GAO recommends that DOD update its cost estimates and assess the risks of the program "
    "before it makes further investments."
)
_PARAPHRASE = (
    "The Department of Defense spent $3.5 billion on the program in 2019. GAO found that the cost estimates "
    "of the program were not reliable and that DOD did not assess the risks of the program. GAO recommends that "
    "DOD update the estimates of the program's cost."
)

# (prediction, ground truth, reference rouge_score): Rouge().get_scores([p], [g], avg=True)["rouge-l"]["f"], 0.0 on
# an exception. f = 2pr / (p + r + 1e-8), so identical texts give 0.999999995, not 1.
ROUGE_CASES = [
    ("Jack will call Mary back later", "Jack will call Mary back later.", 0.999999995),  # "." splits, is dropped
    ("the the the", "the cat", 0.6666666622222223),  # distinct words: n = 1, m = 2
    ("The cat sat on the mat.", "The cat sat on the mat", 0.999999995),
    (_PARAPHRASE, _GOLD, 0.7826086907792481),  # 3 sentences: union LCS over sentence pairs
    (
        "Tom and Anna will meet at the cinema at 7 pm.",
        "Tom and Anna are meeting at 7 pm at the cinema",
        0.5999999950000001,
    ),
    (
        "GAO found that DOD spent $3.5 billion in 2019.",
        "GAO found DOD spent $3.5 billion in fiscal year 2019.",
        0.8571428521541952,
    ),
    ("A B A B A B", "A B C D", 0.6666666622222223),
    ("c b c", "b c c", 0.4999999950000001),  # the package's LCS tie-breaking decides which words count
    ("c a b. e b", "b e", 0.6666666622222223),  # likewise
    ("a. b", "a.  . b", 0.7999999952000001),  # a whitespace-only sentence is one empty word
    (" . x", " . y", 0.4999999950000001),
    ("", "anything", 0.0),  # ValueError (no sentence) -> 0.0
    ("...", "Something.", 0.0),  # likewise
    ("a b c", "d e f", 0.0),
    # random texts (words, periods, tabs, newlines, doubled spaces), drawn by the comparison script
    ("on.The sat. The\ndog cat.x a ", "x sat The\tis a on  x sat\tParis\nmat dog. ", 0.7058823480968859),
    (
        "cat and.mat , 3 z.The. . cat , 3. 5\tz\ty cat  ",
        "cat Paris. . y  is. . 5 y. mat\tsat .The Paris ",
        0.6315789423822715,
    ),
    ("is.z mat .is\nof x\n", "x. is on mat a. . a z\t", 0.6666666618055556),
    ("of  the x\n5\t3 ", "The .is.is.sat .is dog dog .mat 3\tThe the\t", 0.1666666618055557),
    ("sat. the dog\tis of. ", "5 .sat z .z .Paris on 3..of .mat\nthe and. on..", 0.3749999953125),
    ("the , and  cat..of\n5 5 , a\nand. a\tdog , a.", "dog\nz. the of .of 5 .", 0.6153846106508877),
    ("5 a a .dog. dog .the .5 , cat. . ", "is , dog .mat.3 ", 0.33333332847222225),
    ("y.cat..mat on on\ty , on\tz. . 5 ", "on the , sat\non.dog the  dog  and 3  x The..", 0.23529411266435996),
]


@pytest.mark.parametrize(("prediction", "ground_truth", "expected"), ROUGE_CASES)
def test_rouge_matches_the_rouge_package(prediction, ground_truth, expected):
    assert m.rouge_score(prediction, ground_truth) == pytest.approx(expected, abs=1e-12)


def test_rouge_scores_long_sentences_where_the_package_recurses_too_deep():
    # 700 + 700 words without a ".": rouge 1.0.1 raises RecursionError (LongBench: 0.0); we score the pair. The
    # expected value is the reference's own with sys.setrecursionlimit(100000) (pltrdy/rouge#67).
    prediction = " ".join(f"w{(7 * i) % 97}" for i in range(700))
    ground_truth = " ".join(f"w{(5 * i) % 97}" for i in range(700))
    assert m.rouge_score(prediction, ground_truth) == pytest.approx(0.9793814382989692, abs=1e-12)


# (prediction, ground truth, reference qa_f1_zh_score, reference rouge_zh_score), with jieba 0.42.1
ZH_CASES = [
    ("他在北京大学学习计算机科学。", "北京大学计算机科学", 0.5714285714285715, 0.4999999962500001),
    ("北京是中国的首都。", "中国的首都是北京", 1.0, 0.5454545404958678),
    (
        "会议讨论了产品的发布时间和市场推广计划。",
        "会议主要讨论了产品发布时间以及市场推广的计划。",
        0.8571428571428572,
        0.7826086906616257,
    ),
    ("张三", "张三丰", 0.0, 0.0),  # one jieba word each, no overlap (one token per character gave 0.8)
    ("2019年3月", "2019年", 0.6666666666666666, 0.6666666622222223),
    ("我们的产品的价格和我们的产品的质量都很好", "产品的价格很好，质量也很好", 0.5217391304347826, 0.7058823479584776),
    ("销售额达到3.5亿元", "销售额为3.5亿元", 0.75, 0.7999999950000002),
]


@pytest.mark.parametrize(("prediction", "ground_truth", "qa_f1", "rouge"), ZH_CASES)
def test_chinese_metrics_match_the_reference(prediction, ground_truth, qa_f1, rouge):
    pytest.importorskip("jieba")  # the extra slake[eval], which `make setup` installs
    assert m.qa_f1_zh_score(prediction, ground_truth) == pytest.approx(qa_f1, abs=1e-12)
    assert m.rouge_zh_score(prediction, ground_truth) == pytest.approx(rouge, abs=1e-12)


@pytest.mark.parametrize("dataset", ["multifieldqa_zh", "dureader", "vcsum", "multifieldqa_zh_e"])
def test_chinese_datasets_refuse_to_score_without_jieba(monkeypatch, dataset):
    monkeypatch.setattr(m, "_jieba", None)
    with pytest.raises(ImportError, match=r"pip install 'slake\[eval\]'"):
        m.score_sample(dataset, "张三", ["张三丰"])


def test_eval_extra_installs_jieba():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    extra = pyproject["project"]["optional-dependencies"]["eval"]
    assert any(req.replace(" ", "").startswith("jieba>=") for req in extra)


# (prediction, ground truth, reference code_sim_score): fuzz.ratio of pure-python fuzzywuzzy (difflib) / 100
CODE_CASES = [
    ("self.assertEqual(expected_value, actual_value)", "self.assertEqual(actual_value, expected_value)", 0.7),
    ("x, y = y, x", "y, x = x, y", 0.36),
    ("result = merge(right_half, left_half)", "result = merge(left_half, right_half)", 0.7),
    ("```python\nreturn self.model.predict(x_test)\n", "return self.clf.predict(X_test)", 0.88),
    ("# only a comment", "", 1.0),  # no code line: "" against "" is 100 (equal strings)
    ("# only a comment", "x = 1", 0.0),  # an empty side is 0
    ("\n\n  for i in range(n):\n    pass", "for i in range(len(items)):", 0.77),
    # 200 characters or more: difflib's autojunk ignores the frequent characters
    (
        "private Map<String, List<Integer>> counts = new TreeMap<>();" * 4,
        "private final Map<String, Integer> counts = new HashMap<>();" * 4,
        0.03,
    ),
]


@pytest.mark.parametrize(("prediction", "ground_truth", "expected"), CODE_CASES)
def test_code_sim_matches_pure_python_fuzzywuzzy(prediction, ground_truth, expected):
    assert m.code_sim_score(prediction, ground_truth) == expected


def test_a_chinese_dataset_is_refused_when_the_suite_is_planned_without_jieba(monkeypatch, tmp_path):
    """Without jieba, a run with a Chinese dataset stops before any model loads or any sample is generated, not when
    its first answer is scored."""
    from slake.eval.suites import plan_suite

    monkeypatch.setattr(m, "_jieba", None)
    loaded = []
    monkeypatch.setattr("slake.eval.longbench.load_longbench", lambda *a, **k: loaded.append(a) or [])
    with pytest.raises(ValueError, match=r"multifieldqa_zh: .*pip install 'slake\[eval\]'"):
        plan_suite("longbench", ["hotpotqa", "multifieldqa_zh"], longbench_dir=tmp_path)
    assert not loaded
    plan_suite("longbench", ["hotpotqa"], longbench_dir=tmp_path)  # English datasets need no jieba
    assert loaded
