"""``slake calibrate``: tune VABS's ``(alpha, beta)`` and CAKE's ``(tau1, tau2)`` for one model and budget.

The SLAKE paper tunes ``alpha``/``beta`` per model and budget (Table 3) and CAKE's reference code tunes
``tau1``/``tau2`` the same way, for a few 7-8B models only; every other model would otherwise get Llama-2's values.
This search finds values for any model without touching the evaluation data:

1. calibration prompts from real text that no evaluation suite uses (the Python language reference shipped with
   CPython, :func:`slake.quality.continuations.calibration_text`): ``samples`` text continuations and ``samples``
   question prompts answered by the full cache (:mod:`slake.quality.continuations`), each prefilled once;
2. for each candidate value pair, the method replays every prefill (the prefill-once replay of
   :mod:`slake.engines.transformers.prefill_once`, so no candidate pays for a prefill) and is scored by the
   output-level distance of
   :mod:`slake.quality.output_fidelity`: the mean KL(full || compressed) of the next-token distributions over the
   teacher-forced continuations;
3. a grid (:data:`GRIDS`), then a local refinement around the best point (each value x {1/sqrt 2, 1, sqrt 2});
4. the best pair, the method's values before calibration and both distances go into the model's profile
   (:mod:`slake.methods.profiles`), which ``slake generate/eval/bench/fidelity`` and :class:`slake.SlakeCache` then use
   unless the user sets the values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from slake.methods.profiles import SEARCHED
from slake.quality.output_fidelity import OutputReference, mean_distance, measure_outputs

__all__ = ["GRIDS", "CALIBRATION_SOURCE", "NothingMeasured", "calibration_reference", "calibrate_method"]

#: first-stage grids per method (values of the searched hyperparameters)
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    "slake": {"alpha": (0.0, 0.25, 0.5, 1.0, 2.0), "beta": (0.0, 0.25, 0.5, 1.0, 2.0)},
    "cake": {"tau1": (0.25, 0.5, 1.0, 2.0, 4.0), "tau2": (0.25, 0.5, 1.0, 2.0, 4.0)},
}
CALIBRATION_SOURCE = "pydoc_data.topics (the Python language reference shipped with CPython)"


class NothingMeasured(ValueError):
    """Every candidate of a search gave the same distance (the budget evicts nothing on the calibration prompts, for
    one): the search measured nothing, and no profile entry may be written from it."""


def calibration_reference(
    model: Any, tokenizer: Any, length: int, samples: int, tokens: int, seed: int = 0
) -> OutputReference:
    """Build the calibration prompts (``samples`` of each kind) and prefill them once."""
    from slake.quality.continuations import (
        CALIBRATION_QUESTIONS,
        answer_continuations,
        calibration_text,
        text_continuations,
    )
    from slake.quality.output_fidelity import prepare_reference

    text = calibration_text()
    conts = text_continuations(tokenizer, text, length, tokens, samples, seed=seed, name="calib-text")
    conts += answer_continuations(
        model, tokenizer, text, length, tokens, samples, CALIBRATION_QUESTIONS, seed=seed, name="calib-answer"
    )
    return prepare_reference(model, conts)


def _score(rows: list[dict]) -> dict:
    return {
        "kl": mean_distance(rows),
        "delta_nll": mean_distance(rows, "delta_nll"),
        "top1": mean_distance(rows, "top1"),
    }


def _reported(score: dict) -> dict:
    """``score`` as the entry reports it: a distance that is not a finite number is None (``null`` in the profile),
    since ``NaN`` and ``Infinity`` are not JSON (a "before" point that overflowed wrote them into the profile, which
    then only Python's lenient parser read)."""
    return {k: v if math.isfinite(v) else None for k, v in score.items()}


def _finite(cache: dict[tuple, dict]) -> list[tuple]:
    """The candidates of ``cache`` whose distance is a finite number, in the order they were measured."""
    return [v for v, c in cache.items() if math.isfinite(c["kl"])]


def calibrate_method(
    model: Any,
    ref: OutputReference,
    method: Any,
    budget: int | float,
    grid: dict[str, Sequence[float]] | None = None,
    refine: bool = True,
    on_candidate: Callable[[], None] | None = None,
) -> dict:
    """Search the method's profile hyperparameters at one budget; return a profile entry.

    Parameters
    ----------
    model : transformers model
        The model ``ref`` was prefilled with.
    ref : OutputReference
        Calibration prompts, prefilled once (:func:`calibration_reference`).
    method : Method
        The method as it will be used (its other hyperparameters are the entry's ``context``); the values it holds
        for the searched hyperparameters are the "before" point.
    budget : int | float
        The budget.
    grid : dict, optional
        Values per searched hyperparameter (default :data:`GRIDS`).
    refine : bool
        Run the local refinement after the grid.
    on_candidate : callable, optional
        Called after each evaluated candidate (progress bars).

    Returns
    -------
    dict
        ``{"method", "budget", "values", "context", "before", "after", "search"}`` where ``before``/``after`` hold
        the values and their distances (``kl``, ``delta_nll``, ``top1``; None where a distance is not a finite
        number, as the "before" point's can be: the entry is plain JSON).

    Raises
    ------
    NothingMeasured
        When every candidate gave the same distance (the budget evicts nothing on these prompts, for one): the search
        measured nothing, and no entry should be written from it.
    """
    keys = SEARCHED.get(method.name)
    if not keys:
        raise ValueError(
            f"slake calibrate tunes {', '.join(sorted(SEARCHED))}; {method.name!r} has no profile hyperparameters"
        )
    grid = grid or GRIDS[method.name]
    cache: dict[tuple, dict] = {}

    def evaluate(values: tuple[float, ...]) -> dict:
        values = tuple(round(v, 4) for v in values)
        if values not in cache:
            m = replace(method, **dict(zip(keys, values)))
            cache[values] = _score(measure_outputs(model, ref, m, budget))
            if on_candidate is not None:
                on_candidate()
        return cache[values]

    start = time.perf_counter()
    before_values = tuple(float(getattr(method, k)) for k in keys)
    before = evaluate(before_values)
    for a in grid[keys[0]]:
        for b in grid[keys[1]]:
            evaluate((a, b))
    if refine and _finite(cache):
        best = min(_finite(cache), key=lambda v: cache[v]["kl"])
        steps = (1 / math.sqrt(2), 1.0, math.sqrt(2))
        for fa in steps:
            for fb in steps:
                a, b = best[0] * fa, best[1] * fb
                if min(a, b) >= 0 and (a, b) != best:
                    evaluate((a, b))
    # a candidate whose distance is NaN or infinite (an overflow) is no candidate: min() kept a NaN met first, and an
    # infinite one made every finite difference look like nothing
    finite = _finite(cache)
    if not finite:
        raise NothingMeasured(
            f"the search of {method.name} at budget {budget} measured nothing: all {len(cache)} candidates gave a "
            f"distance that is not a finite number (an overflow in the model's dtype?)"
        )
    kls = [cache[v]["kl"] for v in finite]
    if max(kls) - min(kls) <= 1e-9 * max(1.0, abs(max(kls))):
        if len(finite) < len(cache):
            # "all 34 candidates gave the same distance" was said of 1 finite candidate and 33 that overflowed
            raise NothingMeasured(
                f"the search of {method.name} at budget {budget} measured nothing: {len(cache) - len(finite)} of "
                f"{len(cache)} candidates gave a distance that is not a finite number (an overflow in the model's "
                f"dtype?) and the {len(finite)} others the same distance ({kls[0]:.4g} nats/token)"
            )
        raise NothingMeasured(
            f"the search of {method.name} at budget {budget} measured nothing: all {len(cache)} candidates gave the "
            f"same distance ({kls[0]:.4g} nats/token), so {' and '.join(keys)} change nothing here: either the "
            f"method's other settings do not read them (slake[vabs=false] allocates no budgets by VABS), or the budget "
            f"keeps every token the calibration prompts have"
        )
    best = min(finite, key=lambda v: (cache[v]["kl"], v != tuple(round(x, 4) for x in before_values)))
    context = {k: v for k, v in method.hyperparameters().items() if k not in keys}
    return {
        "method": method.name,
        "budget": budget,
        "values": dict(zip(keys, best)),
        "context": context,
        "before": {"values": dict(zip(keys, before_values)), **_reported(before)},
        "after": {"values": dict(zip(keys, best)), **_reported(cache[best])},
        "search": {
            "candidates": len(cache),
            "objective": "mean KL(full || compressed), nats/token",
            "seconds": round(time.perf_counter() - start, 1),
        },
    }
