"""Method specs: a method name with hyperparameter overrides in one string, e.g. ``slake[vabs=false]``.

Command-line lists (``--methods snapkv,slake[vabs=false],snapkv[linear_cache=true]``) and results rows name a method
variant by its spec, so an ablation runs beside its base method in one evaluation and gets its own line in every
table. :func:`slake.methods.make_method` accepts specs directly.

Grammar: ``name`` or ``name[key=value,key=value,...]``. Values are read as JSON where they parse (``true``,
``false``, ``16``, ``0.5``, ``null``); ``True``/``False`` are accepted too; anything else is a string
(``cake[layer_budgets=uniform]``). :func:`format_method_spec` gives the canonical form: lower-case name, keys
sorted, JSON literals, so that ``slake[VABS=False]`` and ``slake[vabs=false]`` name the same rows.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["format_method_spec", "parse_assignments", "parse_method_spec", "parse_value", "split_method_list"]


def split_method_list(text: str) -> list[str]:
    """Split a comma-separated method list, ignoring commas inside ``[...]``.

    Parameters
    ----------
    text : str
        e.g. ``"snapkv, slake[vabs=false,window=16]"``.

    Returns
    -------
    list of str
        The stripped, non-empty items: ``["snapkv", "slake[vabs=false,window=16]"]``.

    Raises
    ------
    ValueError
        For unbalanced brackets.
    """
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in str(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in method list {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in method list {text!r}")
    items.append("".join(current).strip())
    return [i for i in items if i]


def parse_value(raw: str) -> Any:
    """A hyperparameter value from text: a JSON literal where it parses (``true``, ``16``, ``0.5``, ``null``),
    ``True``/``False`` as booleans, else the stripped string."""
    text = raw.strip()
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``name[key=value,...]`` into the lower-case name and the overrides.

    Parameters
    ----------
    spec : str
        A method name, optionally followed by bracketed ``key=value`` overrides.

    Returns
    -------
    (str, dict)
        ``("slake", {"vabs": False})`` for ``"slake[vabs=false]"``; ``("snapkv", {})`` for ``"snapkv"``.

    Raises
    ------
    ValueError
        For an empty name, text after ``]``, an item without ``=``, an empty key or a key given twice.
    """
    text = str(spec).strip()
    if "[" not in text:
        if "]" in text or "=" in text:
            raise ValueError(f"bad method spec {spec!r}; expected name or name[key=value,...]")
        if not text:
            raise ValueError("empty method name")
        return text.lower(), {}
    name, _, rest = text.partition("[")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"method spec {spec!r} has no name before '['")
    if not rest.endswith("]"):
        raise ValueError(f"method spec {spec!r} must end with ']'")
    body = rest[:-1]
    if "[" in body or "]" in body:
        raise ValueError(f"method spec {spec!r} has nested brackets")
    return name, parse_assignments([i for i in body.split(",") if i.strip()], f"method spec {spec!r}")


def parse_assignments(items: list[str], source: str) -> dict[str, Any]:
    """``key=value`` items as a dict of hyperparameters, read alike wherever they come from (a method spec's
    brackets, ``--set``): names stripped and lower-cased, values parsed by :func:`parse_value`.

    Parameters
    ----------
    items : list of str
        The ``key=value`` items.
    source : str
        Where they come from, for the errors (``"method spec 'snapkv[...]'"``, ``"--set"``).

    Raises
    ------
    ValueError
        For an item without ``=``, an empty name, or a name given twice.
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{source}: expected key=value, got {item.strip()!r}")
        key, _, value = item.partition("=")
        key = key.strip().lower()
        if not key:
            raise ValueError(f"{source}: empty hyperparameter name in {item.strip()!r}")
        if key in out:
            raise ValueError(f"{source} sets {key!r} twice")
        out[key] = parse_value(value)
    return out


def format_method_spec(name: str, overrides: dict[str, Any] | None = None) -> str:
    """The canonical spec string: ``name`` alone, or ``name[k=v,...]`` with keys sorted and JSON literal values.

    ``parse_method_spec(format_method_spec(n, o)) == (n.lower(), o)`` for bool, number and None values, and for
    strings that do not themselves parse as JSON.
    """
    name = str(name).strip().lower()
    if not overrides:
        return name
    parts = []
    for key in sorted(overrides):
        value = overrides[key]
        parts.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
    return f"{name}[{','.join(parts)}]"
