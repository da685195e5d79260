"""RULER variable tracking (vt): chains of variable assignments hidden in noise."""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from slake.eval.haystack import insert_at_depths, noise_units
from slake.eval.sample import Draft
from slake.eval.vocab import random_number

__all__ = ["vt_renderer"]


def _variable(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in taken:
            taken.add(name)
            return name


def vt_renderer(seed: int | str, num_chains: int = 1, num_hops: int = 4) -> Callable[[int], Draft]:
    """Draw the chains of one vt sample and return a renderer over the number of noise sentences.

    Each chain starts ``VAR A = <5-digit value>.`` and continues ``VAR B = VAR A.`` for
    ``num_hops`` hops; the first chain is asked about, the others (different values) distract.
    Statements keep their chain order and sit at random depths of a noise haystack.

    Parameters
    ----------
    seed : int or str
        Sample seed.
    num_chains : int
        Number of chains.
    num_hops : int
        Assignments after the initial one in each chain.

    Returns
    -------
    callable
        ``render(size)`` gives the :class:`Draft` for ``size`` noise sentences.
    """
    rng = random.Random(f"vt:{seed}")
    taken: set[str] = set()
    values: list[str] = []
    statements: list[str] = []
    chains: list[list[str]] = []
    for _ in range(num_chains):
        value = random_number(rng, 5)
        while value in values:
            value = random_number(rng, 5)
        values.append(value)
        names = [_variable(rng, taken) for _ in range(num_hops + 1)]
        chains.append(names)
        statements.append(f"VAR {names[0]} = {value}.")
        statements.extend(f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names)))
    # random depths, sorted within each chain so every assignment follows the one it copies
    depths: list[float] = []
    for _ in range(num_chains):
        depths.extend(sorted(rng.random() for _ in range(num_hops + 1)))
    value = values[0]
    instruction = (
        "Memorize every variable assignment hidden in the text below; you will be asked to "
        "trace the assignments afterwards.\n\n"
    )
    question = (
        f"Which variables hold the value {value}, either directly or through a chain of "
        "assignments in the text above? List all of them."
    )
    # the count of variables asked for, as RULER's prefix gives it ("{num_v} variables are assigned the value ...")
    prefix = f" Following the assignments in the text above, {num_hops + 1} variables hold the value {value}; they are:"

    def render(n: int) -> Draft:
        units, positions = insert_at_depths(noise_units(n), statements, depths)
        return Draft(
            context=instruction + " ".join(units) + "\n\n",
            question=question,
            answers=list(chains[0]),
            answer_prefix=prefix,
            metadata={"value": value, "statement_positions": positions},
        )

    return render
