"""Low-level string similarity helpers used by the metrics (our own implementations)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

__all__ = ["lcs_length", "token_f1", "rouge_l_f", "indel_ratio"]


def lcs_length(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common subsequence of two sequences (O(len(a) * len(b)) time)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Bag-of-tokens F1 (SQuAD style): overlap counted with multiplicity."""
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def rouge_l_f(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """ROUGE-L F1 (beta = 1) from the LCS of two token sequences; 0.0 if either is empty."""
    if not prediction or not reference:
        return 0.0
    lcs = lcs_length(prediction, reference)
    if lcs == 0:
        return 0.0
    precision = lcs / len(prediction)
    recall = lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def indel_ratio(a: str, b: str) -> float:
    """Normalised indel similarity ``2 * LCS / (len(a) + len(b))`` in ``[0, 1]``.

    This is the similarity that ``Levenshtein.ratio`` / ``rapidfuzz.fuzz.ratio`` (and so
    ``fuzzywuzzy.fuzz.ratio`` with python-Levenshtein installed) compute; two empty strings give 1.
    """
    if not a and not b:
        return 1.0
    return 2 * lcs_length(a, b) / (len(a) + len(b))
