"""Needle-in-a-haystack samples: one fact sentence hidden at a chosen depth of real essays."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Sequence
from typing import Literal

from slake.eval.fitting import DEFAULT_TOLERANCE, LengthFitError, fit_to_length
from slake.eval.haystack import (
    check_haystack_words,
    cycle_prefix,
    default_essays,
    essay_offset,
    essay_words,
    insert_at_depths,
    word_boundaries,
)
from slake.eval.metrics import needle_score
from slake.eval.sample import Draft, Sample, TokenizerLike, depth_label
from slake.eval.vocab import CITIES, random_number, random_word

__all__ = [
    "NEEDLE_KINDS",
    "NeedleKind",
    "make_needle",
    "needle_sample",
    "needle_grid",
    "needle_cell_seed",
    "needle_score",
]

NeedleKind = Literal["word", "number"]
NEEDLE_KINDS: tuple[str, ...] = ("word", "number")


def make_needle(kind: NeedleKind, rng: random.Random) -> tuple[str, str, str]:
    """Draw a needle.

    Returns
    -------
    needle : str
        The sentence to hide, e.g. ``"The special magic number for Tokyo is 4720193."``.
    question : str
        The question asking for the value.
    answer : str
        The value.
    """
    if kind not in NEEDLE_KINDS:
        raise ValueError(f"unknown needle kind {kind!r}; expected one of {NEEDLE_KINDS}")
    city = rng.choice(CITIES)
    value = random_word(rng) if kind == "word" else random_number(rng)
    needle = f"The special magic {kind} for {city} is {value}."
    question = f"What is the special magic {kind} for {city} mentioned in the text above?"
    return needle, question, value


def needle_sample(
    tokenizer: TokenizerLike,
    length: int,
    depth: float,
    *,
    kind: NeedleKind = "number",
    seed: int = 0,
    essays: Sequence[str] | None = None,
    max_new_tokens: int = 32,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Sample:
    """Build one needle-in-a-haystack sample.

    The haystack is a run of essay words starting at a seeded sentence start (cycling through the
    essays, so repeating them, when a long context needs more text than they hold), cut so that the
    whole plain prompt (:func:`slake.eval.sample.plain_prompt`: instruction, haystack and question,
    without special tokens or chat template) has at most ``length`` tokens, within ``tolerance``
    below it or, where one haystack word is coarser than that, less than one word below it
    (:func:`slake.eval.fitting.fit_to_length`).  The needle goes at the sentence boundary nearest to
    ``depth`` percent of the haystack's words: 0 before the first word, 100 after the last full
    sentence, so before a trailing partial one.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Measures lengths.
    length : int
        Target plain prompt length in tokens (a maximum).
    depth : float
        Needle depth in percent of the haystack's words, 0 (start) to 100 (end).
    kind : {"word", "number"}
        Value type of the needle.
    seed : int
        Seed for the needle, its value and the haystack start.
    essays : sequence of str, optional
        Haystack source, a sequence of texts (one ``str`` is refused); the Paul Graham essays by default.
    max_new_tokens : int
        Generation budget stored on the sample.
    tolerance : float
        Allowed relative shortfall of the length.

    Returns
    -------
    Sample
        ``metric="contains"``; ``metadata`` has ``actual_depth`` (percent of haystack words
        before the needle), ``needle``, ``kind``, ``seed`` and ``target_length``.

    Raises
    ------
    LengthFitError
        When no haystack fits ``length`` (below the tokens of the prompt without any haystack, or
        ``length`` < 1); the message names the length, depth and seed.
    ValueError
        For a depth outside ``[0, 100]``, an unknown ``kind``, or essays without a sentence end.
    TypeError
        For ``essays`` given as one ``str``.
    """
    if not 0.0 <= depth <= 100.0:
        raise ValueError(f"depth must be in [0, 100], got {depth}")
    rng = random.Random(f"needle:{kind}:{seed}")
    needle, question_text, answer = make_needle(kind, rng)
    words = essay_words(default_essays(essays))
    check_haystack_words(words)
    offset = essay_offset(words, rng)
    instruction = (
        f"Below is a long text. Somewhere in it, one sentence states a special magic {kind} "
        "for a city. Read the text carefully; a question about it follows.\n\n"
    )

    def render(n: int) -> Draft:
        hay = cycle_prefix(words, n, offset)
        units, (pos,) = insert_at_depths(hay, [needle], [depth / 100.0], word_boundaries(hay))
        actual = 100.0 * pos / n if n else 0.0
        return Draft(
            context=instruction + " ".join(units) + "\n\n",
            question=f"Question: {question_text}",
            answers=[answer],
            metadata={"actual_depth": actual, "needle": needle},
        )

    try:
        fit = fit_to_length(render, Draft.text, tokenizer, length, 4 * length + 1000, tolerance=tolerance)
    except LengthFitError as e:
        raise LengthFitError(f"needle, length {length}, depth {depth:g}, seed {seed}: {e}") from e
    return fit.value.to_sample(
        task="needle",
        metric="contains",
        max_new_tokens=max_new_tokens,
        length=fit.length,
        sample_id=f"needle-{kind}-{length}-{depth_label(depth)}-{seed}",
        depth=float(depth),
        extra={"kind": kind, "seed": seed, "target_length": length},
    )


def needle_cell_seed(seed: int, length: int, depth: float) -> int:
    """The seed of the grid cell at ``length`` tokens and ``depth`` percent, for sample seed ``seed``.

    It depends on the values only, not on where they stand in the lists of a grid, so a cell gets
    the same needle whatever other lengths and depths are asked with it (and a rerun with more of
    them resumes the cells already run).  A 31-bit CRC of ``"seed:length:depth"``.
    """
    return zlib.crc32(f"{int(seed)}:{int(length)}:{float(depth)!r}".encode()) & 0x7FFFFFFF


def needle_grid(
    tokenizer: TokenizerLike,
    lengths: Iterable[int],
    depths: Iterable[float],
    *,
    kind: NeedleKind = "number",
    seed: int = 0,
    essays: Sequence[str] | None = None,
    max_new_tokens: int = 32,
) -> list[Sample]:
    """Samples for every (length, depth) pair, for a depth x length heatmap.

    Each cell's sample seed is :func:`needle_cell_seed` of ``seed`` and the cell's length and depth
    values (the sample ids embed it).

    Parameters
    ----------
    tokenizer : TokenizerLike
        The model's tokenizer; lengths count its tokens.
    lengths : iterable of int
        Target lengths in tokens.
    depths : iterable of float
        Needle depths in percent of the haystack's words, in ``[0, 100]``.
    kind : NeedleKind
        The needle's kind, as in :func:`needle_sample`.
    seed : int
        The grid's seed.
    essays : sequence of str, optional
        Haystack essays; Paul Graham's essays by default.
    max_new_tokens : int
        Generation cap stored in each sample.

    Returns
    -------
    list of Sample
        One per (length, depth), lengths outermost, in the order given.

    Raises
    ------
    ValueError
        For a depth outside ``[0, 100]``.
    TypeError
        For ``essays`` given as one ``str``.
    LengthFitError
        When a cell's haystack cannot fit its length (:func:`needle_sample`).
    """
    essays = default_essays(essays)
    depths = list(depths)
    out = []
    for n in lengths:
        for d in depths:
            out.append(
                needle_sample(
                    tokenizer,
                    n,
                    d,
                    kind=kind,
                    seed=needle_cell_seed(seed, n, d),
                    essays=essays,
                    max_new_tokens=max_new_tokens,
                )
            )
    return out
