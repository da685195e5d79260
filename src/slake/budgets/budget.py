"""Budgets the way papers state them (``docs/conventions.md#budgets``).

A budget is the average number of cached tokens per layer and KV head, the observation window included (the papers'
"cache size 128"), or a ratio of the prompt length. :class:`Budget` validates the user's input and resolves it to
an absolute per-sequence number.
"""

from __future__ import annotations

import decimal
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True, init=False)
class Budget:
    """A KV-cache budget.

    Parameters
    ----------
    value : int | float | str | Budget
        An integer ``>= 1``: average cached tokens per layer and KV head (window included). A float in ``(0, 1)``:
        a ratio of each prompt's length (rounded up). Any integer or real scalar counts (numpy's and ``Decimal``
        included, a ratio read from its shortest decimal; a bool does not). Strings such as ``"128"`` or ``"0.25"``
        are parsed; a Budget is copied. The attribute ``value`` holds the resolved plain int or float. A whole float
        above 1 (``128.0``, ``"128.0"``) counts tokens; the float ``1.0`` (or ``"1.0"``) is refused: read as a ratio
        it would be the whole prompt, read as tokens one token, and either silent reading would surprise someone
        (pass ``1`` for one token, a ratio below 1, or the method ``full`` to keep every token).

    Raises
    ------
    ValueError
        For anything but a positive integer, a ratio in ``(0, 1)`` or a whole float above 1, the float ``1.0``
        included.
    """

    value: int | float

    def __init__(self, value: int | float | str | Budget | Any) -> None:
        object.__setattr__(self, "value", value)
        self._validate()

    def _validate(self) -> None:
        v: Any = self.value
        if isinstance(v, Budget):
            object.__setattr__(self, "value", v.value)
            v = self.value
        if isinstance(v, str):
            object.__setattr__(self, "value", _parse(v))
            v = self.value
        if isinstance(v, decimal.Decimal):  # a real number outside Python's numeric tower
            v = float(v)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"budget must be a positive integer (tokens) or a ratio in (0, 1), got {v!r}")
        # numpy and other integer / real scalars alike: the value is a plain int or float from here on
        v = int(v) if isinstance(v, numbers.Integral) else _as_written(v)
        object.__setattr__(self, "value", v)
        if isinstance(v, float) and v == 1.0:
            # a whole float counts tokens (128.0 is 128), but 1.0 also reads as "a ratio of 1, the whole prompt":
            # silently taken as ONE token it compressed every prompt to a single token per layer and KV head
            raise ValueError(
                "budget 1.0 is ambiguous: a float budget is a ratio of the prompt in (0, 1), and 1.0 is not one; "
                "give the integer 1 for one token per layer and KV head, a ratio below 1 (e.g. 0.5), "
                "or the method 'full' to keep every token"
            )
        if isinstance(v, float) and v.is_integer() and v >= 1:
            object.__setattr__(self, "value", int(v))
            v = self.value
        if isinstance(v, float):
            if v > 1.0 and math.isfinite(v):  # a token count with a fraction, not a ratio gone wrong
                raise ValueError(
                    f"budget {v!r} is neither a token count (an integer >= 1, per layer and KV head) nor a ratio "
                    "budget, which must lie strictly between 0 and 1"
                )
            if not (0.0 < v < 1.0) or math.isnan(v):
                raise ValueError(f"a ratio budget must lie strictly between 0 and 1, got {v!r}")
        elif v < 1:
            raise ValueError(f"budget must be >= 1 token, got {v!r}")
        elif v >= 1 << 62:  # budgets travel as int64 tensors; no prompt comes near
            raise ValueError(f"budget must be below 2**62 tokens, got {v!r}")

    @property
    def is_ratio(self) -> bool:
        """True when the budget is a fraction of the prompt length."""
        return isinstance(self.value, float)

    def tokens(self, prompt_len: int) -> int:
        """Absolute average per-layer budget for a prompt of ``prompt_len`` real tokens: ``ceil(ratio * prompt_len)``
        for a ratio, at least 1.

        The product is taken on the ratio as written (its shortest decimal, ``repr``), not on its binary float:
        ``0.07 * 100`` is ``7.000000000000001`` in floating point, whose ceiling kept 8 tokens where 7 are 7% of
        100."""
        if self.is_ratio:
            return max(1, math.ceil(Fraction(repr(self.value)) * int(prompt_len)))
        return int(self.value)

    def __str__(self) -> str:
        return str(self.value)


def _as_written(v: Any) -> float:
    """A real scalar as a plain float, read from its shortest decimal where it has one: ``numpy.float32(0.07)`` is
    ``0.07``, not the ``0.07000000029802322`` its binary value widens to (whose ratio of 100 tokens rounds up to 8)."""
    if type(v) is float:
        return v
    try:
        return float(str(v))
    except ValueError:  # e.g. a Fraction, written "7/100"
        return float(v)


def _parse(text: str) -> int | float:
    t = text.strip()
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"budget must be a positive integer (tokens) or a ratio in (0, 1), got {text!r}") from None
