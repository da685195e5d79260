"""RULER needle-in-a-haystack tasks (8 variants), with our own wording."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from slake.eval.haystack import (
    LazyStream,
    check_haystack_words,
    cycle_prefix,
    default_essays,
    essay_offset,
    essay_words,
    insert_at_depths,
    noise_units,
    word_boundaries,
)
from slake.eval.sample import Draft
from slake.eval.vocab import random_number, random_uuid, word_keys

__all__ = ["NiahConfig", "NIAH_TASKS", "niah_renderer"]

Haystack = Literal["noise", "essay", "needle"]
ValueType = Literal["numbers", "uuids"]
KeyType = Literal["words", "uuids"]


@dataclass(frozen=True)
class NiahConfig:
    """Definition of one NIAH variant.

    Attributes
    ----------
    haystack : {"noise", "essay", "needle"}
        Repeated filler sentences, Paul Graham essays, or distractor needles with other keys.
    key_type : {"words", "uuids"}
        Needle keys: ``adjective-noun`` words or UUIDs.
    value_type : {"numbers", "uuids"}
        Needle values: 7-digit numbers or UUIDs.
    num_keys : int
        Needles with distinct keys (the first ``num_queries`` are asked, the rest distract).
    num_values : int
        Values per key (each in its own needle).
    num_queries : int
        Keys asked about.
    """

    haystack: Haystack
    key_type: KeyType
    value_type: ValueType
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_keys=4, num_queries=4),
}

_SINGULAR = {"numbers": "number", "uuids": "uuid"}


def _value(value_type: ValueType, rng: random.Random) -> str:
    return random_number(rng) if value_type == "numbers" else random_uuid(rng)


def _keys(key_type: KeyType, rng: random.Random, k: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    if key_type == "words":
        return word_keys(rng, k, exclude)
    return [random_uuid(rng) for _ in range(k)]


def _needle(cfg: NiahConfig, key: str, value: str) -> str:
    return f"Remember that a special magic {_SINGULAR[cfg.value_type]} for {key} is: {value}."


def _join_keys(keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + f", and {keys[-1]}"


def niah_renderer(
    cfg: NiahConfig, seed: int | str, essays: Sequence[str] | None = None, depth: float | None = None
) -> Callable[[int], Draft]:
    """Draw all random choices of one NIAH sample and return a renderer over haystack size.

    Parameters
    ----------
    cfg : NiahConfig
        The variant.
    seed : int or str
        Sample seed.
    essays : sequence of str, optional
        Essay source for ``haystack="essay"``.
    depth : float, optional
        Depth in percent of the first queried needle; random when omitted (all other needles
        always get random depths).  The achieved depth is ``metadata["depth"]``.

    Returns
    -------
    callable
        ``render(size)`` gives the :class:`Draft` for ``size`` haystack units (words for essays,
        sentences for noise, distractor needles for a needle haystack).
    """
    if depth is not None and not 0.0 <= depth <= 100.0:  # NaN fails both
        raise ValueError(f"depth must be in [0, 100], got {depth}")
    rng = random.Random(f"niah:{seed}")
    keys = _keys(cfg.key_type, rng, cfg.num_keys)
    needles: list[str] = []
    values_by_key: dict[str, list[str]] = {}
    for key in keys:
        vals = [_value(cfg.value_type, rng) for _ in range(cfg.num_values)]
        values_by_key[key] = vals
        needles.extend(_needle(cfg, key, v) for v in vals)
    rng.shuffle(needles)
    depths = [rng.random() for _ in needles]
    queried = keys[: cfg.num_queries]
    target_index = needles.index(_needle(cfg, queried[0], values_by_key[queried[0]][0]))
    if depth is not None:
        depths[target_index] = depth / 100.0
    answers = [v for k in queried for v in values_by_key[k]]

    key_text = _join_keys(queried)
    if cfg.num_queries * cfg.num_values == 1:  # one answer: asked in the singular, as RULER asks it
        one = _SINGULAR[cfg.value_type]
        instruction = (
            f"A special magic {one} is hidden inside the following text. Memorize it carefully: you will be "
            f"asked about the {one} at the end.\n\n"
        )
        question = f"What is the special magic {one} for {key_text} mentioned in the text above?"
        prefix = f" The special magic {one} for {key_text} mentioned in the text above is"
    else:
        plural = cfg.value_type
        instruction = (
            f"Some special magic {plural} are hidden inside the following text. Memorize them "
            f"carefully: you will be asked about the {plural} at the end.\n\n"
        )
        question = f"What are all the special magic {plural} for {key_text} mentioned in the text above?"
        prefix = f" The special magic {plural} for {key_text} mentioned in the text above are"

    if cfg.haystack == "essay":
        words = essay_words(default_essays(essays))
        check_haystack_words(words)
        offset = essay_offset(words, rng)

        def units_of(n: int) -> tuple[list[str], list[int] | None]:
            hay = cycle_prefix(words, n, offset)
            return hay, word_boundaries(hay)

    elif cfg.haystack == "noise":

        def units_of(n: int) -> tuple[list[str], list[int] | None]:
            return noise_units(n), None

    else:
        taken = frozenset(keys)

        def make_distractor(r: random.Random) -> str:
            key = _keys(cfg.key_type, r, 1, taken)[0]
            return _needle(cfg, key, _value(cfg.value_type, r))

        stream = LazyStream(make_distractor, f"niah-hay:{seed}")

        def units_of(n: int) -> tuple[list[str], list[int] | None]:
            return stream.take(n), None

    def render(n: int) -> Draft:
        hay, bounds = units_of(n)
        units, positions = insert_at_depths(hay, needles, depths, bounds)
        return Draft(
            context=instruction + " ".join(units) + "\n\n",
            question=question,
            answers=list(answers),
            answer_prefix=prefix,
            metadata={
                "depth": 100.0 * positions[target_index] / n if n else 0.0,
                "needle_depths": [100.0 * p / n if n else 0.0 for p in positions],
                "keys": list(queried),
            },
        )

    return render
