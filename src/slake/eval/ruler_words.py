"""RULER aggregation tasks: common words extraction (cwe) and frequent words extraction (fwe)."""

from __future__ import annotations

import bisect
import itertools
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence

from slake.eval.haystack import LazyStream
from slake.eval.sample import Draft
from slake.eval.vocab import coded_word

__all__ = ["cwe_renderer", "fwe_renderer", "vocabulary_from_texts", "FWE_NOISE"]

FWE_NOISE = "...."
_WORD = re.compile(r"^[a-z]{3,12}$")


def vocabulary_from_texts(texts: Sequence[str]) -> list[str]:
    """Distinct lowercase alphabetic words (3-12 letters) of ``texts``, in first-seen order."""
    seen: dict[str, None] = {}
    for text in texts:
        for raw in text.split():
            w = raw.strip(".,;:!?\"'()[]").lower()
            if _WORD.match(w):
                seen.setdefault(w, None)
    return list(seen)


def cwe_renderer(
    seed: int | str,
    vocabulary: Sequence[str],
    *,
    num_common: int = 10,
    freq_common: int = 30,
    freq_uncommon: int = 3,
) -> tuple[Callable[[int], Draft], int]:
    """Draw one cwe sample; the renderer's size is the number of uncommon words.

    A numbered list repeats ``num_common`` words ``freq_common`` times each and every uncommon
    word ``freq_uncommon`` times, in random order; the answer is the common words.

    Returns
    -------
    render : callable
        ``render(size)`` gives the :class:`Draft` with ``size`` distinct uncommon words.
    max_size : int
        Number of uncommon words the vocabulary allows.
    """
    if freq_common <= freq_uncommon:
        raise ValueError("freq_common must exceed freq_uncommon")
    vocab = list(dict.fromkeys(vocabulary))
    if len(vocab) <= num_common:
        raise ValueError(f"the vocabulary needs more than {num_common} distinct words")
    rng = random.Random(f"cwe:{seed}")
    rng.shuffle(vocab)
    common, uncommon = vocab[:num_common], vocab[num_common:]
    instruction = "Below is a numbered list of words. A few words occur much more often than all the others.\n\n"
    question = f"What are the {num_common} most common words in the list above?"
    prefix = f" Answer: The {num_common} most common words in the list are:"

    def render(n: int) -> Draft:
        words = common * freq_common + uncommon[:n] * freq_uncommon
        random.Random(f"cwe-order:{seed}:{n}").shuffle(words)
        listing = " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))
        return Draft(
            context=instruction + listing + "\n\n",
            question=question,
            answers=list(common),
            answer_prefix=prefix,
            metadata={"freq_common": freq_common, "freq_uncommon": freq_uncommon, "num_uncommon": n},
        )

    return render, len(uncommon)


def _zipf_cumulative(size: int, alpha: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (k**alpha) for k in range(1, size + 1)))


def fwe_renderer(
    seed: int | str, *, alpha: float = 2.0, vocab_size: int = 1000, num_answers: int = 3
) -> Callable[[int], Draft]:
    """Draw one fwe sample; the renderer's size is the number of coded words in the text.

    Coded words (random letter strings) are sampled from a Zipf law with exponent ``alpha``
    over ``vocab_size`` ranks; rank 1 is the noise token ``"...."``, and the answers are the
    ``num_answers`` most frequent coded words of the rendered text.  ``metadata["tie"]`` is True
    when the answers are ambiguous (the caller should then redraw).
    """
    rng = random.Random(f"fwe:{seed}")
    coded: list[str] = []
    seen: set[str] = set()
    while len(coded) < vocab_size - 1:
        w = coded_word(rng, 3, 6)
        if w not in seen:
            seen.add(w)
            coded.append(w)
    vocab = [FWE_NOISE] + coded
    cum = _zipf_cumulative(vocab_size, alpha)
    total = cum[-1]
    stream = LazyStream(lambda r: vocab[bisect.bisect_right(cum, r.random() * total)], f"fwe-draws:{seed}")
    instruction = "Read the following coded text and keep track of how often each coded word occurs.\n\n"
    question = f"Ignoring the dots '{FWE_NOISE}', which {num_answers} coded words appear most often in the text above?"
    prefix = f" Answer: The {num_answers} most frequent coded words in the text above are:"

    def render(n: int) -> Draft:
        words = stream.take(n)
        counts = Counter(w for w in words if w != FWE_NOISE).most_common()
        answers = [w for w, _ in counts[:num_answers]]
        tie = len(counts) < num_answers or (
            len(counts) > num_answers and counts[num_answers - 1][1] == counts[num_answers][1]
        )
        return Draft(
            context=instruction + " ".join(words) + "\n\n",
            question=question,
            answers=answers,
            answer_prefix=prefix,
            metadata={"tie": tie, "counts": [c for _, c in counts[: num_answers + 1]]},
        )

    return render
