"""A package's release string as comparable integers (``"2.8.0+cu128"``, ``"3.4.0+rocm6.4"``, ``"3.7.0rc1"``)."""

from __future__ import annotations

import itertools

__all__ = ["release"]


def release(version: str) -> tuple[int, ...]:
    """The leading numeric parts of ``version``: the local part (``+...``) dropped, each dotted part read up to its
    first non-digit, stopping at a part that starts with none (``"2.8.0+cu128"`` -> ``(2, 8, 0)``, ``"3.7.0rc1"`` ->
    ``(3, 7, 0)``, ``"2.10.0a0"`` -> ``(2, 10, 0)``)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
