"""Method specs: a method name with hyperparameter overrides in one string, e.g. ``slake[vabs=false]``.

Command-line lists (``--methods snapkv,slake[vabs=false],snapkv[linear_cache=true]``) and results rows name a method
variant by its spec, so an ablation runs beside its base method in one evaluation and gets its own line in every
table. :func:`slake.methods.make_method` accepts specs directly.

Grammar: ``name`` or ``name[key=value,key=value,...]``. Values are read as JSON where they parse (``true``,
``false``, ``16``, ``0.5``, ``null``); ``True``/``False`` are accepted too; anything else is a string
(``cake[layer_budgets=uniform]``). :func:`format_method_spec` gives the canonical form: lower-case name, keys
sorted, JSON literals, so that ``slake[VABS=False]`` and ``slake[vabs=false]`` name the same rows.
:func:`check_hyperparameters` checks the values against the types a method class declares.
"""

from __future__ import annotations

import json
import numbers
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

__all__ = [
    "check_hyperparameters",
    "format_method_spec",
    "parse_assignments",
    "parse_method_spec",
    "parse_value",
    "split_method_list",
]


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

    ``parse_method_spec(format_method_spec(n, o)) == (n.lower(), o)`` for every spec it returns: a name, key or
    value that would not read back so is refused.

    Parameters
    ----------
    name : str
        The method's name (lower-cased).
    overrides : dict, optional
        Hyperparameter name -> value: a bool, number or None (written as a JSON literal), or a string that does not
        itself read as a JSON literal or boolean (``"16"``, ``"true"``, ``"True"``).

    Returns
    -------
    str
        ``"slake[alpha=1.0,vabs=false]"``; the bare name without overrides.

    Raises
    ------
    ValueError
        For an empty name or one holding ``[``, ``]``, ``=`` or ``,``; a key that is not a lower-case name without
        those characters and surrounding spaces; a value that would read back as something else: a string holding
        ``,``, ``[`` or ``]``, with leading or trailing whitespace, or reading as a JSON literal, and any value
        JSON cannot write without those characters (a list, an object JSON cannot write at all).
    """
    name = str(name).strip().lower()
    if not name or any(c in name for c in "[]=,"):
        raise ValueError(f"method name {name!r} cannot be written in a spec: it must be non-empty, without [ ] = ,")
    if not overrides:
        return name
    parts = []
    for key in sorted(overrides, key=str):
        if not isinstance(key, str) or not key or key != key.strip().lower() or any(c in key for c in "[]=,"):
            raise ValueError(
                f"hyperparameter name {key!r} cannot be written in a method spec: it must be a non-empty lower-case "
                "string without surrounding spaces or [ ] = ,"
            )
        value = overrides[key]
        parts.append(f"{key}={_spec_value(key, value)}")
    return f"{name}[{','.join(parts)}]"


def _spec_value(key: str, value: Any) -> str:
    """``value`` as a spec writes it, or ValueError when :func:`parse_value` would not read it back."""
    try:
        text = value if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):
        text = None
    if text is not None and not any(c in text for c in ",[]"):
        back = parse_value(text)
        same = back == value or (back != back and value != value)  # NaN reads back as NaN
        if same and all(isinstance(back, t) == isinstance(value, t) for t in (bool, str)):
            return text
    raise ValueError(
        f"hyperparameter {key}={value!r} cannot be written in a method spec so that it reads back: a spec value is a "
        "JSON literal (bool, number, null) or a string without ',', '[' or ']', without surrounding whitespace, that "
        "does not itself read as a literal"
    )


#: :func:`_declared_types` of each class asked, read once: every construction of a method checks its values
#: (:meth:`slake.methods.base.Method.__new__`)
_DECLARED: dict[type, dict[str, Any]] = {}


def _declared_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of ``cls``'s fields (``{}`` where they cannot be resolved)."""
    if cls not in _DECLARED:
        try:
            _DECLARED[cls] = typing.get_type_hints(cls)
        except Exception:  # an annotation naming something out of reach (a class defined in a function)
            _DECLARED[cls] = {}
    return _DECLARED[cls]


def _kind(declared: Any, default: Any) -> tuple[type | None, bool]:
    """``(base type, optional)`` of a hyperparameter: its annotation's ``bool``/``int``/``float``/``str``, possibly
    ``| None``; where the annotation says nothing usable, the type of its default. ``(None, ...)``: not checked."""
    optional = False
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        args = typing.get_args(declared)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        declared = rest[0] if len(rest) == 1 else None
    if declared in (bool, int, float, str):
        return declared, optional
    if default is not None and type(default) in (bool, int, float, str):
        return type(default), False
    return None, optional


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_hyperparameters(cls: type, values: dict[str, Any], *, label: str = "") -> dict[str, Any]:
    """Validate hyperparameter values for the method class ``cls`` as a spec's values are validated.

    Used by :func:`slake.methods.make_method`, by a method's constructor for the values it is given
    (:meth:`slake.methods.base.Method.__new__`) and for overrides applied to a built Method
    (:func:`slake.methods.profiles.resolve_method`), so that all refuse the same things.

    Parameters
    ----------
    cls : type[Method]
        The method class.
    values : dict
        Hyperparameter name -> value (a spec's JSON literals, or Python values).
    label : str
        What the values belong to, for messages (default the method's name).

    Returns
    -------
    dict
        The values, integers given for floats converted to float and numpy-style integer scalars to int.

    Raises
    ------
    ValueError
        For an unknown hyperparameter (listing those that exist) or a value not of the hyperparameter's declared
        type (``bool``, ``int``, ``float``, ``str``, each possibly optional: ``None`` is then accepted); a bool is
        never an integer or a number, and a string is never parsed; or a number past a float's range (an
        integer such as ``10**400``) for a number.
    """
    name = getattr(cls, "name", cls.__name__)  # a Method class (this module does not import slake.methods.base)
    label = label or repr(name)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"method {name!r} has no hyperparameter {', '.join(unknown)}; it has: {', '.join(sorted(known))}"
        )
    declared = _declared_types(cls)
    out = dict(values)
    for k, value in values.items():
        default = known[k].default
        kind, optional = _kind(declared.get(k), None if default is MISSING else default)
        if kind is None or (optional and value is None):
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is str:
            ok = isinstance(value, str)
        elif kind is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        else:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{label}: {k} must be {_KIND_WORDS[kind]}{' or null' if optional else ''}, got {value!r}")
        if kind is int:
            out[k] = int(value)
        elif kind is float:
            try:
                out[k] = float(value)
            except OverflowError:  # an integer past a float's range (10**400): the OverflowError named nothing
                raise ValueError(
                    f"{label}: {k} must be a finite number within float32's range, got a number past a float's range"
                ) from None
    return out
