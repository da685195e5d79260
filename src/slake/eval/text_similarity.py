"""Low-level string similarity helpers used by the metrics (our own implementations).

* :func:`token_f1`: SQuAD-style bag-of-tokens F1 (LongBench's ``f1_score``).
* :func:`rouge_l_summary`: the ROUGE-L F score that LongBench's ``rouge_score`` reads from the ``rouge`` package
  (pltrdy/rouge 1.0.1, ``Rouge().get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]``), rewritten from its
  definition, with that package's sentence splitting, token counting and tie-breaking.
* :func:`difflib_ratio`: ``fuzzywuzzy.fuzz.ratio`` (fuzzywuzzy 0.18.0 without python-Levenshtein, as LongBench's
  ``requirements.txt`` installs it), from the standard library's :class:`difflib.SequenceMatcher`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from difflib import SequenceMatcher

__all__ = ["token_f1", "rouge_sentences", "rouge_l_summary", "difflib_ratio"]


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Bag-of-tokens F1 (SQuAD style): overlap counted with multiplicity."""
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def rouge_sentences(text: str) -> list[list[str]]:
    """A text as the ``rouge`` package (1.0.1) tokenises it: sentences of words.

    The text is split on ``"."`` (the periods are dropped, also inside numbers such as ``3.5``); empty pieces are
    dropped *before* whitespace is collapsed, so a piece of whitespace only is kept as the sentence ``[""]`` (one
    empty word, which the package counts as a word). Other pieces are split on whitespace.

    Parameters
    ----------
    text : str
        Hypothesis or reference text.

    Returns
    -------
    list of list of str
        The sentences, each a non-empty list of words; empty when the text has no character besides ``"."``.
    """
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def _lcs_words(x: Sequence[str], y: Sequence[str]) -> set[str]:
    """The distinct words of the longest common subsequence of ``x`` (a reference sentence) and ``y`` (a hypothesis
    sentence) that the ``rouge`` package reconstructs: walking back from the end, a match is taken when the two words
    are equal, else the step goes up (``x`` shorter) when that keeps a strictly longer LCS, else left. The walk is a
    loop, not the package's recursion, so long sentences do not exhaust the interpreter's stack."""
    if not x or not y or set(x).isdisjoint(y):
        return set()
    width = len(y)
    table = [[0] * (width + 1)]
    for xi in x:
        prev = table[-1]
        cur = [0] * (width + 1)
        for j in range(width):
            if xi == y[j]:
                cur[j + 1] = prev[j] + 1
            else:
                up, left = prev[j + 1], cur[j]
                cur[j + 1] = up if up > left else left
        table.append(cur)
    words: set[str] = set()
    i, j = len(x), width
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i -= 1
            j -= 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_summary(prediction: str, reference: str) -> float:
    """ROUGE-L F score of the ``rouge`` package (pltrdy/rouge 1.0.1), the value LongBench's ``rouge_score`` returns.

    The package's ``rouge_l_summary_level`` with its default ``exclusive=True``: both texts are cut into sentences by
    :func:`rouge_sentences`; ``m`` and ``n`` are the numbers of *distinct* words of the reference and of the
    hypothesis; the overlap is the number of distinct words in the union, over every (reference sentence,
    hypothesis sentence) pair, of the words of the pair's reconstructed LCS; then ``p = overlap / n``,
    ``r = overlap / m`` and ``f = 2 * (p * r) / (p + r + 1e-8)`` (so identical texts give 0.99999999..., not 1).

    Parameters
    ----------
    prediction, reference : str
        Hypothesis and reference texts.

    Returns
    -------
    float
        The F score in ``[0, 1]``; 0.0 when either text has no sentence (empty, or only periods), where the package
        raises ``ValueError`` and LongBench's ``except`` returns 0.0.

    Notes
    -----
    Remaining deviation: the package reconstructs each LCS by recursion, which raises ``RecursionError`` on a
    sentence pair longer than Python's recursion limit allows (about 500 + 500 words without a ``"."``, e.g. long
    Chinese summaries, whose ``"。"`` does not split); LongBench's ``except`` then scores 0.0. We walk the table in a
    loop and score such inputs (pltrdy/rouge issue #67, fixed upstream after the 1.0.1 release).
    """
    hyp = rouge_sentences(prediction)
    ref = rouge_sentences(reference)
    if not hyp or not ref:
        return 0.0
    m = len({w for s in ref for w in s})
    n = len({w for s in hyp for w in s})
    union: set[str] = set()
    for ref_sentence in ref:
        for hyp_sentence in hyp:
            union |= _lcs_words(ref_sentence, hyp_sentence)
    overlap = len(union)
    r_lcs = overlap / m
    p_lcs = overlap / n
    return 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))


def difflib_ratio(a: str | None, b: str | None) -> int:
    """``fuzzywuzzy.fuzz.ratio(a, b)`` of fuzzywuzzy 0.18.0 without python-Levenshtein: an integer percent.

    As the package's decorators check, in this order: ``None`` on either side gives 0, equal strings 100 (two
    empty strings included), an empty side 0; otherwise ``int(round(100 * SequenceMatcher(None, a, b).ratio()))``
    with :mod:`difflib`'s defaults (``autojunk`` on). With python-Levenshtein installed fuzzywuzzy would use the
    indel ratio instead, which can differ by a few points; LongBench's ``requirements.txt`` does not install it.

    Parameters
    ----------
    a, b : str or None
        The two strings.

    Returns
    -------
    int
        The similarity in whole percent, 0-100.
    """
    if a is None or b is None:
        return 0
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * SequenceMatcher(None, a, b).ratio()))
