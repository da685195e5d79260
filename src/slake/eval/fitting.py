"""Search for the haystack size that makes a generated prompt hit a target token length."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from slake.eval.sample import TokenizerLike, count_tokens

__all__ = ["LengthFitError", "Fit", "fit_to_length", "DEFAULT_TOLERANCE"]

T = TypeVar("T")

DEFAULT_TOLERANCE = 0.02


class LengthFitError(ValueError):
    """Raised when no haystack size gives a prompt within tolerance of the target length."""


@dataclass
class Fit(Generic[T]):
    """Result of :func:`fit_to_length`.

    Attributes
    ----------
    size : int
        The chosen haystack size (units are generator-specific: words, sentences ...).
    value : T
        What ``render(size)`` returned.
    length : int
        Token count of ``text_of(value)``.
    """

    size: int
    value: T
    length: int


def fit_to_length(
    render: Callable[[int], T],
    text_of: Callable[[T], str],
    tokenizer: TokenizerLike,
    target: int,
    max_size: int,
    *,
    min_size: int = 0,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Fit[T]:
    """Find a size whose rendered prompt has at most ``target`` tokens, as close as possible.

    The search stops at the first size within ``tolerance / 4`` below the target, otherwise it
    returns the largest size that fits.  Token counts are assumed (nearly) non-decreasing in the
    size.  The search interpolates
    between measured points and falls back to bisection, so a long prompt is tokenized only a
    handful of times.

    The target is a maximum, as RULER's ``max_seq_length`` is (which also counts the tokens to
    generate: RULER keeps a haystack whose prompt plus ``tokens_to_generate`` fits, so its prompts
    are up to 128 tokens shorter than these; ``slake.eval.ruler``): RULER searches each haystack's
    size in whole units (sentences, needles or documents) and keeps the largest that stays within
    the maximum, however far below it that is.  Here the step is one unit too, and a fit
    more than ``tolerance`` short is still accepted when the next size overshoots the target: the
    haystack unit is then coarser than the tolerance (a UUID key-value needle of about 60 tokens
    is 3% of 2,048), so no size gets closer without going over, and the shortfall is below one
    unit.  It is an error only when the largest allowed size, ``max_size``, still falls short.

    Parameters
    ----------
    render : callable
        ``render(size)`` builds the prompt payload for a haystack of ``size`` units; it must be
        deterministic.
    text_of : callable
        Extracts the text to measure from a payload.
    tokenizer : TokenizerLike
        Measures lengths with ``encode(text, add_special_tokens=False)``.
    target : int
        Target length in tokens.
    max_size : int
        Largest size ``render`` accepts.
    min_size : int
        Smallest size.
    tolerance : float
        Allowed relative shortfall ``(target - length) / target`` when a larger size would still
        fit; a shortfall of less than one unit is always allowed.

    Returns
    -------
    Fit

    Raises
    ------
    LengthFitError
        When even ``min_size`` is too long (the prompt without any haystack exceeds the target),
        or ``max_size`` units still leave the prompt more than ``tolerance`` short.
    """
    if target <= 0:
        raise LengthFitError(f"target length must be positive, got {target}")
    cache: dict[int, tuple[T, int]] = {}

    def measure(size: int) -> int:
        if size not in cache:
            value = render(size)
            cache[size] = (value, count_tokens(tokenizer, text_of(value)))
        return cache[size][1]

    base = measure(min_size)
    if base > target:
        raise LengthFitError(
            f"target length {target} is too small: the prompt without any haystack (instruction, inserted "
            f"items, question) already has {base} tokens"
        )
    lo, hi = min_size, max_size + 1  # measure(lo) <= target; sizes >= hi are too long / out of range
    slack = int(target * tolerance / 4)  # stop early once this close below the target
    guess = min(max_size, min_size + 64)
    steps = 0
    while hi - lo > 1:
        guess = min(max(guess, lo + 1), hi - 1)
        n = measure(guess)
        if n <= target:
            lo = guess
            if target - n <= slack:
                break
        else:
            hi = guess
        steps += 1
        slope = (n - base) / max(guess - min_size, 1)
        if steps <= 6 and slope > 0:
            # secant step from the best fitting size, using the average tokens per unit
            guess = lo + int((target - cache[lo][1]) / slope)
        else:
            guess = (lo + hi) // 2
    value, length = cache[lo]
    # hi <= max_size: size lo + 1 was measured and overshoots, so the shortfall is under one unit
    if (target - length) > tolerance * target and hi > max_size:
        raise LengthFitError(
            f"could only reach {length} tokens for target {target}: the largest haystack allowed "
            f"({max_size} units) is too short; the source text or vocabulary may be too small"
        )
    return Fit(lo, value, length)
