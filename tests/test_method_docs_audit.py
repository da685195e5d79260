"""The method pages agree with the code (``docs/methods/``): every hyperparameter table names hyperparameters the
method has, with the defaults :func:`slake.methods.make_method` builds, and lists every hyperparameter of the method
but the two that ``docs/methods/README.md`` says most tables leave out (``sinks``, ``linear_cache``).

The tables share one format: a first column of backticked names (several names in one cell take comma-separated
values in the same order), then a default column, or one default column per method (``default (`a`)``), or one column
for two methods (``default (`a` / `b`)``, values split by `` / ``). ``-`` marks a method without the hyperparameter,
``X (`m`: Y)`` a default that differs for ``m``, and a meaning starting with ```m` only`` a hyperparameter only ``m``
has. Which methods a single-default table describes comes from its page and section (:data:`SECTIONS`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from slake.methods import available_methods, make_method

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "methods"

#: (page, the level-2 section a table sits in, or None for the whole page) -> the methods its table describes
SECTIONS: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("baselines.md", "Full cache"): ("full",),
    ("baselines.md", "StreamingLLM"): ("streamingllm",),
    ("baselines.md", "H2O"): ("h2o",),
    ("baselines.md", "TOVA"): ("tova",),
    ("baselines.md", "SnapKV"): ("snapkv",),
    ("baselines.md", "PyramidKV"): ("pyramidkv",),
    ("cake.md", None): ("cake",),
    ("slake.md", None): ("slake",),
    ("lava.md", "LAVa"): ("lava",),
    ("ahakv.md", None): ("ahakv",),
    ("sagekv.md", None): ("sagekv",),
    ("keydiff.md", None): ("keydiff",),
    ("kvzip.md", None): ("kvzip",),
    ("expected-attention.md", None): ("expected-attention", "ada-expected-attention"),
    ("criticalkv.md", None): ("criticalkv", "ada-criticalkv"),
}

#: hyperparameters every method has that a table may leave out (docs/methods/README.md)
MAY_OMIT = {"sinks", "linear_cache"}

_ABSENT = object()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside parentheses and backticks."""
    parts, depth, tick, cur, i = [], 0, False, "", 0
    while i < len(text):
        ch = text[i]
        if ch == "`":
            tick = not tick
        elif not tick and ch == "(":
            depth += 1
        elif not tick and ch == ")":
            depth -= 1
        if not tick and depth == 0 and text.startswith(sep, i):
            parts.append(cur)
            cur, i = "", i + len(sep)
            continue
        cur += ch
        i += 1
    return [p.strip() for p in [*parts, cur]]


def _strip_remark(text: str) -> str:
    """``text`` without a trailing parenthesised remark (``20, true ([PyramidKV](...))`` -> ``20, true``)."""
    tick = False
    for i, ch in enumerate(text):
        if ch == "`":
            tick = not tick
        elif not tick and text.startswith(" (", i) and text.rstrip().endswith(")"):
            return text[:i].strip()
    return text.strip()


def parse_value(text: str):
    """A table cell's default as Python: ``none`` -> None, ``true``/``false``, numbers, ```avg``` -> ``"avg"``."""
    t = text.strip()
    if t == "-":
        return _ABSENT
    if t.startswith("`") and t.endswith("`") and t.count("`") == 2:
        return t[1:-1]
    low = t.lower()
    if low == "none":
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        pass
    raise ValueError(f"cannot read the default {text!r}")


def _per_method(cell: str, methods: tuple[str, ...]) -> dict[str, str]:
    """One default cell for ``methods``: ``X`` or ``X (`m`: Y)``."""
    m = re.fullmatch(r"(.*?)\s*\(`([\w-]+)`:\s*(.*)\)", cell.strip())
    if m and m.group(2) in methods:
        return {name: (m.group(3) if name == m.group(2) else m.group(1)) for name in methods}
    return dict.fromkeys(methods, cell)


def documented(page: Path) -> dict[str, dict[str, object]]:
    """``{method: {hyperparameter: default}}`` from every hyperparameter table of ``page``."""
    out: dict[str, dict[str, object]] = {}
    section: str | None = None
    lines = page.read_text().splitlines()
    i, fenced = 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            section = line[3:].strip()
        if fenced or not line.startswith("| hyperparameter |"):
            i += 1
            continue
        header = _cells(line)
        rows = []
        i += 2  # header and separator
        while i < len(lines) and lines[i].startswith("|"):
            rows.append(_cells(lines[i]))
            i += 1
        columns: list[tuple[int, tuple[str, ...]]] = []  # (column, methods whose value it holds, split by " / ")
        for c, head in enumerate(header[1:], 1):
            named = re.fullmatch(r"default \((.*)\)", head)
            if named:
                columns.append((c, tuple(re.findall(r"`([\w-]+)`", named.group(1)))))
            elif head == "default":
                key = (page.name, section) if (page.name, section) in SECTIONS else (page.name, None)
                assert key in SECTIONS, f"{page.name}: a table in section {section!r} that the test does not map"
                columns.append((c, SECTIONS[key]))
        assert columns, f"{page.name}: a hyperparameter table without a default column: {header}"
        for row in rows:
            names = re.findall(r"`(\w+)`", row[0])
            assert names, f"{page.name}: no hyperparameter name in {row[0]!r}"
            meaning = row[-1] if header[-1] == "meaning" else ""
            only = re.match(r"`([\w-]+)` only\b", meaning)
            for c, methods in columns:
                per = _split_top(row[c], " / ") if len(methods) > 1 and " / " in row[c] else None
                for k, method in enumerate(methods):
                    if only and only.group(1) != method:
                        continue
                    cell = _strip_remark(per[k] if per is not None else _per_method(row[c], methods)[method])
                    values = _split_top(cell, ", ") if len(names) > 1 else [cell]
                    if len(values) == 1 and len(names) > 1:
                        values = values * len(names)  # "`tau1`, `tau2` | 1.0, 1.0" or one value for all
                    assert len(values) == len(names), f"{page.name}: {row[0]} has {len(values)} values: {cell!r}"
                    for name, value in zip(names, values):
                        v = parse_value(value)
                        if v is not _ABSENT:
                            out.setdefault(method, {})[name] = v
    return out


def all_documented() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for page in sorted(PAGES.glob("*.md")):
        for method, table in documented(page).items():
            assert method not in out, f"{method} has tables on two pages"
            out[method] = table
    return out


def _same(doc, code) -> bool:
    if isinstance(code, bool) or isinstance(doc, bool) or code is None or doc is None:
        return doc is code
    if isinstance(code, (int, float)) and isinstance(doc, (int, float)):
        return math.isclose(float(doc), float(code), rel_tol=1e-12, abs_tol=0.0)
    return doc == code


def test_every_method_has_a_table() -> None:
    assert set(all_documented()) == set(available_methods())


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_documented_defaults_match_the_code(name: str) -> None:
    doc = all_documented()[name]
    code = make_method(name).hyperparameters()
    unknown = sorted(set(doc) - set(code))
    assert not unknown, f"{name}: the page documents hyperparameters the method does not have: {unknown}"
    wrong = {k: (doc[k], code[k]) for k in doc if not _same(doc[k], code[k])}
    assert not wrong, f"{name}: documented default != code default (doc, code): {wrong}"
    missing = sorted(set(code) - set(doc) - MAY_OMIT)
    assert not missing, f"{name}: hyperparameters missing from its page's table: {missing}"


def test_parser_reads_the_formats() -> None:
    assert parse_value("`avg`") == "avg" and parse_value("none") is None and parse_value("1e-4") == 1e-4
    assert parse_value("false") is False and parse_value("20") == 20 and parse_value("-") is _ABSENT
    assert _per_method("0 (`b`: 0.01)", ("a", "b")) == {"a": "0", "b": "0.01"}
    assert _split_top("5, `avg`, false / 7, `max`, true", " / ") == ["5, `avg`, false", "7, `max`, true"]
    assert _strip_remark("20, true ([PyramidKV](baselines.md#pyramidkv))") == "20, true"
    with pytest.raises(ValueError):
        parse_value("twenty")


def test_slake_budget_hint_below_the_protected_tokens_is_refused():
    """``budget_hint`` took any value >= 0: below the window, VABS's ``C - window`` went negative and the uniform split
    became the window split without a word, for a budget the engines refuse."""
    from slake.methods.slake import Slake

    for bad in (0, 7):
        with pytest.raises(ValueError, match="budget_hint must be at least"):
            Slake(window=8, budget_hint=bad)
    assert Slake(window=8, budget_hint=8).budget_hint == 8
