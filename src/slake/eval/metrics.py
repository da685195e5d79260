"""Scoring: LongBench's official metrics, RULER string matching and needle containment.

The LongBench functions follow the official ``LongBench/metrics.py`` and ``LongBench/eval.py`` of LongBench v1 with
the packages its ``requirements.txt`` installs, rewritten here (no scoring package is imported):

* ``rouge_score`` / ``rouge_zh_score``: the ROUGE-L F score of the ``rouge`` package (pltrdy/rouge 1.0.1), by
  :func:`slake.eval.text_similarity.rouge_l_summary`: the same number on every input the package scores.
  Remaining deviation: where the package raises ``RecursionError`` (a sentence pair of about 500 + 500 words
  without a ``"."``; LongBench then scores 0.0) we score the pair (pltrdy/rouge issue #67).
* ``qa_f1_zh_score`` / ``rouge_zh_score`` segment Chinese with ``jieba`` (``pip install 'slake[eval]'``), as the
  official code; without it they raise :class:`ImportError` rather than score differently.
* ``code_sim_score``: ``fuzzywuzzy.fuzz.ratio`` as pure-python fuzzywuzzy 0.18.0 computes it (``difflib``), by
  :func:`slake.eval.text_similarity.difflib_ratio`.

How a run's LongBench numbers differ from the published ones (not from the metrics; see ``docs/cli.md``,
"LongBench"):

* LongBench-E datasets (``<name>_e``) are summarised per ``--lengths`` truncation length, not in the official
  ``eval.py --e`` buckets (0-4k, 4-8k, 8k+ of each record's ``length`` field).
* The summaries' average is the mean over the datasets run, English and Chinese together, not LongBench's
  published "Avg" (the mean of the six category means, each language apart): it is not comparable with the
  leaderboard.
* samsum: LongBench's ``pred.py`` stops generating at the first newline; we generate up to the dataset's length and
  score the first line (the official ``eval.py`` cut), which is the same text unless the first generated token is a
  newline.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from slake.eval.text_similarity import difflib_ratio, rouge_l_summary, token_f1

__all__ = [
    "normalize_answer",
    "normalize_zh_answer",
    "zh_tokens",
    "qa_f1_score",
    "qa_f1_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "classification_score",
    "retrieval_score",
    "retrieval_zh_score",
    "count_score",
    "code_sim_score",
    "DATASET2METRIC",
    "FIRST_LINE_DATASETS",
    "longbench_sample_score",
    "longbench_score",
    "string_match_all",
    "string_match_part",
    "ruler_score",
    "kvpress_clean",
    "kvpress_ruler_metric",
    "needle_score",
    "score_sample",
    "score_prediction",
    "JIEBA_AVAILABLE",
    "require_jieba",
    "check_scorable",
]

try:  # the extra slake[eval]; the Chinese metrics refuse to score without it (require_jieba)
    import jieba as _jieba

    JIEBA_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    _jieba = None
    JIEBA_AVAILABLE = False

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


# --------------------------------------------------------------------------- normalisation


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and English articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop Chinese and English punctuation, remove all whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _ZH_PUNCT and ch not in _EN_PUNCT)
    return "".join(s.split())


def require_jieba() -> Any:
    """The ``jieba`` module, which the Chinese LongBench metrics segment with.

    Returns
    -------
    module
        ``jieba``.

    Raises
    ------
    ImportError
        When ``jieba`` is not installed (it comes with ``pip install 'slake[eval]'``). Another segmentation (e.g.
        one token per character) would give other scores than the official ones, so there is no fallback.
    """
    if _jieba is None:
        raise ImportError(
            "the Chinese LongBench metrics (multifieldqa_zh, dureader, vcsum) segment text with jieba, "
            "which is not installed: pip install 'slake[eval]'"
        )
    return _jieba


def zh_tokens(text: str) -> list[str]:
    """Segment Chinese text as LongBench does: ``list(jieba.cut(text, cut_all=False))``.

    Raises
    ------
    ImportError
        Without ``jieba`` (:func:`require_jieba`).
    """
    return list(require_jieba().cut(text, cut_all=False))


def _answer_list(answers: Sequence[str]) -> Sequence[str]:
    """``answers`` unchanged; ``TypeError`` for one ``str`` (or ``bytes``), which would be scored per character."""
    if isinstance(answers, (str, bytes)):
        kind = type(answers).__name__
        raise TypeError(f"answers must be a sequence of answers, not one {kind} (its characters): pass [{answers!r}]")
    return answers


def _check_counts(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> None:
    """``ValueError`` unless there are as many answer lists as predictions (also when there is no prediction)."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists: give one per prediction")


# --------------------------------------------------------------------------- LongBench metrics


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 after English answer normalisation."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 over jieba tokens, each normalised by :func:`normalize_zh_answer`, empty ones dropped.

    LongBench's ``qa_f1_zh_score``, the same values. Raises :class:`ImportError` without ``jieba``
    (:func:`require_jieba`).
    """
    pred = [t for t in (normalize_zh_answer(x) for x in zh_tokens(prediction)) if t]
    gold = [t for t in (normalize_zh_answer(x) for x in zh_tokens(ground_truth)) if t]
    return token_f1(pred, gold)


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F score as LongBench's ``rouge_score`` computes it with the ``rouge`` package (pltrdy/rouge 1.0.1).

    ``Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]``, 0.0 where that raises; see
    :func:`slake.eval.text_similarity.rouge_l_summary` for the definition (sentences split on ``"."``, distinct
    words counted, union LCS over sentence pairs).

    Parameters
    ----------
    prediction, ground_truth : str
        Generated and reference text.

    Returns
    -------
    float
        In ``[0, 1]``; 0.0 when either text is empty or only periods (the package's ``ValueError``).

    Notes
    -----
    Remaining deviation: where the package raises ``RecursionError`` (a sentence pair of about 500 + 500 words
    without a ``"."``), LongBench scores 0.0 and we score the texts (pltrdy/rouge issue #67, fixed upstream after
    the 1.0.1 release).
    """
    return rouge_l_summary(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """:func:`rouge_score` of the texts' jieba tokens joined by spaces (LongBench's ``rouge_zh_score``).

    Chinese full stops (``"。"``) do not split sentences, so long Chinese texts are single sentences, which is where
    the reference's ``RecursionError`` (scored 0.0 by LongBench, scored by us) is met. Raises :class:`ImportError`
    without ``jieba`` (:func:`require_jieba`).
    """
    return rouge_score(" ".join(zh_tokens(prediction)), " ".join(zh_tokens(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Class-name matching, as in the official code.

    Every class name found in the prediction is a candidate; candidates that are substrings of
    the ground truth (but not equal to it) are dropped; the score is ``1 / #candidates`` if the
    ground truth is a candidate.  The official loop removes items from the list it iterates
    over, which skips the element after each removal; we reproduce that behaviour.
    """
    all_classes: Sequence[str] = kwargs.get("all_classes") or []
    matches = [c for c in all_classes if c in prediction]
    kept = list(matches)
    i = 0
    while i < len(kept):  # same visiting order as `for x in lst: lst.remove(x)`
        term = kept[i]
        if term in ground_truth and term != ground_truth:
            kept.remove(term)
        i += 1
    return 1.0 / len(kept) if ground_truth in kept else 0.0


def _id_match(prediction: str, ground_truth: str, pattern: str) -> float:
    found = re.findall(pattern, ground_truth)
    if not found:
        return 0.0
    gold = found[0]
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == gold) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Share of numbers in the prediction equal to the id in ``"Paragraph N"``."""
    return _id_match(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Share of numbers in the prediction equal to the id in ``"段落N"``."""
    return _id_match(prediction, ground_truth, r"段落(\d+)")


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Share of numbers in the prediction equal to the ground-truth count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == str(ground_truth)) / len(numbers)


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Similarity of the first code line of the prediction to the ground truth (LongBench's ``code_sim_score``).

    The first line (after leading newlines) without a backtick, ``#`` or ``//`` is kept (empty if none), then
    compared with ``fuzz.ratio`` of pure-python fuzzywuzzy 0.18.0
    (:func:`~slake.eval.text_similarity.difflib_ratio`), a whole percent, divided by 100.

    Returns
    -------
    float
        In ``[0, 1]``, a multiple of 0.01.
    """
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return difflib_ratio(line, ground_truth) / 100


Metric = Callable[..., float]

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

#: Datasets whose prediction is cut to its first line before scoring.
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def _base_dataset(dataset: str) -> str:
    return dataset[:-2] if dataset.endswith("_e") else dataset


def check_scorable(datasets: Sequence[str]) -> None:
    """Refuse, before anything is generated, datasets whose metric this installation cannot compute: the Chinese
    ones (``qa_f1_zh``, ``rouge_zh``) without ``jieba`` (:func:`require_jieba`).

    Raises
    ------
    ValueError
        Naming the datasets and the extra that installs ``jieba``: a refusal of the run as asked, which the command
        line reports in one line (exit status 2), as it does any other.
    """
    chinese = [d for d in datasets if DATASET2METRIC.get(_base_dataset(d)) in (qa_f1_zh_score, rouge_zh_score)]
    if chinese:
        try:
            require_jieba()
        except ImportError as e:
            raise ValueError(f"{', '.join(chinese)}: {e}") from None


def _dataset_metric(dataset: str) -> tuple[str, Metric]:
    """``(base name, metric)`` of a LongBench dataset or its ``_e`` variant; ValueError naming an unknown one."""
    name = _base_dataset(dataset) if isinstance(dataset, str) else dataset
    if name not in DATASET2METRIC:
        raise ValueError(
            f"unknown LongBench dataset {dataset!r}; expected one of {', '.join(DATASET2METRIC)} (or a name + '_e')"
        )
    return name, DATASET2METRIC[name]


def longbench_sample_score(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """Score of one prediction in ``[0, 1]``: the max over ground truths (``answers``, a list) of the dataset metric.

    Raises
    ------
    ValueError
        For an unknown dataset, or a classification dataset without ``all_classes``.
    TypeError
        For ``answers`` given as one ``str`` (each character would be a ground truth).
    """
    name, metric = _dataset_metric(dataset)
    _answer_list(answers)
    if metric is classification_score and not all_classes:
        # the official code fails here (iterating None); an empty list scored every answer, even the exact one, 0
        raise ValueError(f"{dataset} is scored by class names: give its record's all_classes")
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    best = 0.0
    for gt in answers:
        best = max(best, metric(prediction, gt, all_classes=all_classes))
    return best


def longbench_score(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Dataset score in percent, rounded to 2 decimals (official ``scorer``).

    Parameters
    ----------
    dataset : str
        A LongBench v1 dataset (:data:`DATASET2METRIC`) or its LongBench-E variant (``"<name>_e"``).
    predictions : sequence of str
        One prediction per record.
    answers : sequence of sequence of str
        The ground truths of each record, as many as ``predictions``.
    all_classes : sequence of str, optional
        The class labels of the classification datasets (trec, lsht).

    Returns
    -------
    float
        The mean over records of the best score over each record's ground truths, in percent; 0.0 for no
        predictions.

    Raises
    ------
    ValueError
        For an unknown dataset, or ``predictions`` and ``answers`` of different lengths (also for no predictions
        but some answers).
    TypeError
        For a record's answers given as one ``str``.
    """
    _dataset_metric(dataset)
    _check_counts(predictions, answers)
    if not predictions:
        return 0.0
    total = sum(longbench_sample_score(dataset, p, a, all_classes) for p, a in zip(predictions, answers, strict=True))
    return round(100 * total / len(predictions), 2)


# --------------------------------------------------------------------------- RULER and needle


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` (a list, not one ``str``: :class:`TypeError`) contained in the prediction,
    case-insensitive (RULER's ``string_match_all`` of one sample); 0.0 for no answer."""
    if not _answer_list(answers):
        return 0.0
    pred = prediction.lower()
    return sum(1.0 for a in answers if a.lower() in pred) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` (a list, not one ``str``: :class:`TypeError`) is contained in the prediction,
    case-insensitive, else 0.0 (RULER's ``string_match_part`` of one sample)."""
    pred = prediction.lower()
    return max((1.0 if a.lower() in pred else 0.0 for a in _answer_list(answers)), default=0.0)


#: what kvpress's RULER scorer removes from a prediction before matching (``evaluation/benchmarks/ruler/
#: calculate_metrics.py``: ``re.compile(r"[\x00-\x1f]")``, newlines and tabs included)
_KVPRESS_CONTROL = re.compile(r"[\x00-\x1f]")


def kvpress_clean(prediction: str) -> str:
    """A prediction as kvpress's RULER scorer reads it: stripped, control characters (``\\x00``-``\\x1f``, newlines
    included) removed, stripped again."""
    return _KVPRESS_CONTROL.sub("", prediction.strip()).strip()


def kvpress_ruler_metric(task: str) -> str:
    """The metric name kvpress's RULER scorer gives a task: ``kvpress:part`` (string_match_part) when the task's
    category, the part of its name before the first ``_``, is ``qa``; ``kvpress:all`` (string_match_all) otherwise."""
    return "kvpress:part" if task.split("_")[0] == "qa" else "kvpress:all"


def needle_score(prediction: str, answers: Sequence[str]) -> float:
    """Needle retrieval: 1.0 if an answer stands in the prediction as a whole word, case-insensitive, else 0.0.

    The answer must not continue a longer word, number or hyphenated compound on either side: ``5867520`` inside
    ``58675201`` and ``old-owl`` inside ``bold-owl`` are other needles, which plain containment (RULER's
    :func:`string_match_part`, which RULER's own tasks keep) scored as found. Punctuation, spaces and markup around
    the answer are allowed (``"... is 5867520."``, ``_5867520_``, ``**5867520**``). The metric keeps its name,
    ``"contains"``. ``answers`` is a list (one ``str``, whose characters would be answers, raises
    :class:`TypeError`); empty answers are ignored.
    """
    pred = prediction.lower()
    return max(
        (
            1.0 if re.search(rf"(?<![^\W_]|-){re.escape(a.lower())}(?![^\W_]|-)", pred) else 0.0
            for a in _answer_list(answers)
            if a
        ),
        default=0.0,
    )


_RULER_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {"all": string_match_all, "part": string_match_part}


def ruler_score(predictions: Sequence[str], answers: Sequence[Sequence[str]], metric: str) -> float:
    """RULER task score in percent (rounded to 2 decimals): the sample mean of the match metric.

    Parameters
    ----------
    predictions : sequence of str
        One prediction per sample.
    answers : sequence of sequence of str
        The answers of each sample, as many as ``predictions``.
    metric : str
        ``"all"`` (:func:`string_match_all`) or ``"part"`` (:func:`string_match_part`), the task's
        :attr:`slake.eval.ruler.RulerTaskSpec.metric`.

    Returns
    -------
    float
        0.0 for no predictions.

    Raises
    ------
    ValueError
        For an unknown ``metric``, or ``predictions`` and ``answers`` of different lengths (also for no predictions
        but some answers).
    TypeError
        For a sample's answers given as one ``str``.
    """
    if metric not in _RULER_METRICS:
        raise ValueError(f"unknown RULER metric {metric!r}; expected one of {', '.join(_RULER_METRICS)}")
    fn = _RULER_METRICS[metric]
    _check_counts(predictions, answers)
    if not predictions:
        return 0.0
    total = sum(fn(p, a) for p, a in zip(predictions, answers, strict=True))
    return round(100 * total / len(predictions), 2)


def score_sample(metric: str, prediction: str, answers: Sequence[str], **kwargs: Any) -> float:
    """Score one prediction in ``[0, 1]`` by a :attr:`Sample.metric` name.

    ``"all"``/``"part"`` (RULER), ``"kvpress:all"``/``"kvpress:part"`` (RULER as kvpress scores it:
    :func:`kvpress_clean` first), ``"contains"`` (needle), or a LongBench dataset name (with
    ``all_classes`` passed as a keyword when needed).

    Parameters
    ----------
    metric : str
        The metric name, as above.
    prediction : str
        The model's answer.
    answers : sequence of str
        The sample's ground truths.
    **kwargs
        ``all_classes`` for the LongBench classification datasets; other keywords are ignored.

    Returns
    -------
    float
        In ``[0, 1]``.

    Raises
    ------
    KeyError
        For an unknown metric name.
    TypeError
        For ``answers`` given as one ``str`` (each character would be an answer).
    """
    if metric == "all":
        return string_match_all(prediction, answers)
    if metric == "part":
        return string_match_part(prediction, answers)
    if metric == "contains":
        return needle_score(prediction, answers)
    if metric in ("kvpress:all", "kvpress:part"):  # the leaderboard protocol: kvpress's cleaning, then RULER's match
        match = string_match_all if metric == "kvpress:all" else string_match_part
        return match(kvpress_clean(prediction), answers)
    if _base_dataset(metric) in DATASET2METRIC:
        return longbench_sample_score(metric, prediction, answers, kwargs.get("all_classes"))
    raise KeyError(f"unknown metric {metric!r}")


def score_prediction(sample: Any, prediction: str) -> float:
    """Score ``prediction`` for a :class:`~slake.eval.sample.Sample` in ``[0, 1]`` (uses its
    ``metric``, ``answers`` and, for LongBench classification, ``metadata["all_classes"]``).

    Parameters
    ----------
    sample : Sample
        The sample the prediction answers.
    prediction : str
        The model's answer.

    Returns
    -------
    float
        :func:`score_sample` of the sample's metric, in ``[0, 1]``.

    Raises
    ------
    KeyError
        For a sample whose metric is unknown.
    """
    return score_sample(sample.metric, prediction, sample.answers, all_classes=sample.metadata.get("all_classes"))
