"""Checks of the Python API's own options (:func:`slake.generate`,
:class:`~slake.engines.transformers.cache.SlakeCache`,
:func:`~slake.engines.transformers.generate.prefill`).

The command line's flags are typed by argparse; a Python caller can pass anything, and a plain truth test or
``int()`` would silently turn the string ``"false"`` into true, ``prefill_chunk=2.5`` into 2, or fail later in a bare
``TypeError`` deep inside. Method hyperparameters have their own checks (:mod:`slake.methods.base`); these cover the
engine's options, with a ``ValueError`` that names the option.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_count", "check_flag", "check_generate_options", "check_real"]


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool; a ValueError unless it is one (``True``/``False``, numpy's ``bool_`` included)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):  # numpy.bool_ (numpy.bool)
        item = value.item()
        if isinstance(item, bool):
            return item
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_count(name: str, value: Any, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as an int of at least ``minimum`` (None allowed when ``optional``); a ValueError for a bool, a
    float (``2.5`` is not truncated, ``2.0`` is refused too), a string or a smaller integer."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_real(name: str, value: Any, low: float, high: float, low_open: bool = True) -> float:
    """``value`` as a finite float in ``(low, high]`` (``[low, high]`` when not ``low_open``); a ValueError for NaN,
    an infinity, a bool, a string or a value outside."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    x = float(value)
    if not (math.isfinite(x) and (x > low if low_open else x >= low) and x <= high):
        upper = f"{high}]" if math.isfinite(high) else "inf)"
        raise ValueError(f"{name} must be a finite number in {'(' if low_open else '['}{low}, {upper}, got {value}")
    return x


def check_generate_options(
    *,
    max_new_tokens: Any,
    chat_template: Any,
    do_sample: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    seed: Any,
    charge_linear_state: Any,
    prefill_chunk: Any,
    allow_long_context: Any,
    compile: Any,
) -> None:
    """Refuse (ValueError, naming the option) what :func:`slake.generate` would misread: a flag that is not a bool,
    a count that is not an integer in range (``prefill_chunk`` may be None), and, when ``do_sample`` (greedy decoding
    reads none of them, and ``temperature=0`` is a common way to ask for it): a temperature that is not a finite
    number > 0, a ``top_p`` outside (0, 1], a ``top_k`` or ``seed`` that is not None or an integer >= 0."""
    for name, value in (
        ("chat_template", chat_template),
        ("do_sample", do_sample),
        ("charge_linear_state", charge_linear_state),
        ("allow_long_context", allow_long_context),
        ("compile", compile),
    ):
        check_flag(name, value)
    check_count("max_new_tokens", max_new_tokens)
    check_count("prefill_chunk", prefill_chunk, optional=True)
    if do_sample:
        check_count("top_k", top_k, minimum=0, optional=True)
        check_count("seed", seed, minimum=0, optional=True)
        if seed is not None and seed >= 2**64:  # torch's generators take 64 bits
            raise ValueError(f"seed must be below 2**64, got {seed}")
        check_real("temperature", temperature, 0.0, math.inf)
        check_real("top_p", top_p, 0.0, 1.0)
