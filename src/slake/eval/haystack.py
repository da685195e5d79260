"""Haystack building blocks: noise sentences, essay words, sentence-boundary insertion."""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = [
    "NOISE_SENTENCES",
    "LazyStream",
    "noise_units",
    "essay_words",
    "cycle_prefix",
    "word_boundaries",
    "check_haystack_words",
    "insert_at_depths",
    "nearest_boundary",
    "essay_offset",
    "default_essays",
]

T = TypeVar("T")

#: Bland filler sentences repeated to form a "noise" haystack (our own wording).
NOISE_SENTENCES: tuple[str, ...] = (
    "The river keeps flowing toward the sea.",
    "The hills stay green through the spring.",
    "A light wind moves across the open field.",
    "Here we are once more.",
    "Round and round it goes.",
)

#: a sentence-final word: it ends with . ! ? (or a CJK full stop, exclamation or question mark), then closing quotes
#: or brackets
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"')\]\u201d\u2019\u300d\u300f\uff09]*$")


class LazyStream(Generic[T]):
    """A deterministic, lazily extended sequence drawn from its own random generator.

    Prefixes are stable: the first ``n`` items do not depend on how many items are requested
    later, which lets a length search grow a haystack without reshuffling it.

    Parameters
    ----------
    make : callable
        ``make(rng)`` returns the next item.
    seed : int or str
        Seed of the stream's private :class:`random.Random`.
    """

    def __init__(self, make: Callable[[random.Random], T], seed: int | str) -> None:
        self._make = make
        self._rng = random.Random(seed)
        self._items: list[T] = []

    def get(self, i: int) -> T:
        """Return item ``i``."""
        while len(self._items) <= i:
            self._items.append(self._make(self._rng))
        return self._items[i]

    def take(self, n: int) -> list[T]:
        """Return the first ``n`` items."""
        while len(self._items) < n:
            self._items.append(self._make(self._rng))
        return self._items[:n]


def cycle_prefix(items: Sequence[T], n: int, offset: int = 0) -> list[T]:
    """The first ``n`` items of ``items`` repeated cyclically, starting at ``offset``."""
    if not items:
        raise ValueError("cannot cycle an empty sequence")
    k = len(items)
    return [items[(offset + i) % k] for i in range(n)]


def noise_units(n: int) -> list[str]:
    """The first ``n`` noise sentences (cycling through :data:`NOISE_SENTENCES`)."""
    return cycle_prefix(NOISE_SENTENCES, n)


def _refuse_one_text(essays: object) -> None:
    """Raise ``TypeError`` for one text given where a sequence of texts is expected.

    A ``str`` is a sequence of one-character strings, so it would be read as one essay per character: a haystack of
    single letters between spaces, built without a word.
    """
    if isinstance(essays, (str, bytes)):
        raise TypeError(f"essays must be a sequence of texts, not one {type(essays).__name__}: pass [text]")


def essay_words(essays: Sequence[str]) -> list[str]:
    """All whitespace-separated words of the essays, in order; ``TypeError`` for one ``str`` (pass ``[text]``)."""
    _refuse_one_text(essays)
    words: list[str] = []
    for essay in essays:
        words.extend(essay.split())
    return words


def word_boundaries(words: Sequence[str]) -> list[int]:
    """Indices where a sentence may be inserted: 0 and right after each sentence-final word.

    The end of a text cut mid-sentence is not a boundary, so a needle at depth 100% goes before
    the trailing partial sentence.
    """
    out = [0]
    out.extend(i + 1 for i, w in enumerate(words) if _SENTENCE_END.search(w))
    return out


def check_haystack_words(words: Sequence[str]) -> None:
    """Raise ``ValueError`` for essay words a needle cannot be placed in: none, or no sentence end among them.

    Needles go between sentences (:func:`word_boundaries`): in a text without a sentence-final word the only
    boundary is its start, so every depth would become 0 and every seed the same haystack while the sample still
    recorded the depth asked for.
    """
    if not words:
        raise ValueError("the essays are empty")
    if len(word_boundaries(words)) < 2:
        raise ValueError(
            "the essays have no sentence end (a word ending in . ! ? or a CJK full stop, exclamation or question "
            "mark, between whitespace): a needle goes between sentences, so every depth would be 0"
        )


def nearest_boundary(boundaries: Sequence[int], position: float) -> int:
    """The boundary closest to ``position`` (ties go to the earlier one)."""
    i = bisect.bisect_left(boundaries, position)
    near = boundaries[max(i - 1, 0) : i + 1]
    return min(near, key=lambda b: (abs(b - position), b))


def insert_at_depths(
    units: Sequence[str],
    items: Sequence[str],
    depths: Sequence[float],
    boundaries: Sequence[int] | None = None,
) -> tuple[list[str], list[int]]:
    """Insert ``items`` into ``units`` at relative depths, snapping to boundaries.

    Parameters
    ----------
    units : sequence of str
        Haystack units (words or sentences).
    items : sequence of str
        Sentences to insert (needles), one per depth.
    depths : sequence of float
        Relative positions in ``[0, 1]``.
    boundaries : sequence of int, optional
        Allowed insertion indices into ``units``; every index when omitted.

    Returns
    -------
    units : list of str
        The haystack with the items inserted (items with the same boundary keep their order).
    positions : list of int
        The unit index (in the original ``units``) where each item was inserted.
    """
    if len(items) != len(depths):
        raise ValueError("need one depth per item")
    n = len(units)
    bounds = list(range(n + 1)) if boundaries is None else list(boundaries)
    positions = [nearest_boundary(bounds, min(max(d, 0.0), 1.0) * n) for d in depths]
    order = sorted(range(len(items)), key=lambda i: (positions[i], i))
    out: list[str] = []
    prev = 0
    for i in order:
        out.extend(units[prev : positions[i]])
        out.append(items[i])
        prev = positions[i]
    out.extend(units[prev:])
    return out, positions


def essay_offset(words: Sequence[str], rng: random.Random) -> int:
    """A random sentence-start index into ``words`` (0 for an empty or unpunctuated text)."""
    bounds = [b for b in word_boundaries(words) if b < len(words)]
    return rng.choice(bounds) if bounds else 0


def default_essays(essays: Sequence[str] | None) -> Sequence[str]:
    """``essays`` or, when None, the Paul Graham essays from :mod:`slake.eval.data_sources`.

    ``TypeError`` for one ``str`` instead of a sequence of texts (pass ``[text]``).
    """
    if essays is not None:
        _refuse_one_text(essays)
        return essays
    from slake.eval.data_sources import paul_graham_essays

    return paul_graham_essays()
