"""The documentation's links lead somewhere: every relative link of the README and ``docs/`` names a file that
exists and, where it names a section (``file.md#section``), a heading of that file; and every
``docs/<file>.md#<section>`` that the code, the benchmarks and the tests cite names one too. A section renamed or
moved otherwise leaves links that open the top of a 1,000-line page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: fenced code blocks and inline code spans, where brackets and parentheses are code, not links
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CITED = re.compile(r"(docs/[\w/.-]+\.md)#([\w-]+)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, every character but letters, digits, ``_``, ``-`` and spaces
    dropped (backticks, colons, parentheses, commas, dots...), spaces turned into ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced code), a repeated heading's as GitHub numbers them
    (``name``, ``name-1``, ...), and the ``<a id=...>``/``<a name=...>`` anchors it sets by hand."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = _HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
        found.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return found


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def broken_links(path: Path) -> list[str]:
    """The relative links of one Markdown file that lead nowhere, each with why."""
    bad = []
    for m in _LINK.finditer(_CODE.sub("", path.read_text())):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        file, _, section = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif section and dest.suffix == ".md" and section not in anchors(dest):
            bad.append(f"{target}: no such section in {dest.name}")
    return bad


def test_slug_matches_githubs_anchors():
    assert slug("The fused decode step") == "the-fused-decode-step"
    assert (
        slug("A session without a GPU (2026-11-27, seventh): what a launch costs the host")
        == "a-session-without-a-gpu-2026-11-27-seventh-what-a-launch-costs-the-host"
    )
    assert slug("`--compile` on a GPU: what `SlakeCache` needs") == "--compile-on-a-gpu-what-slakecache-needs"


def test_a_broken_link_is_found(tmp_path):
    """The check itself: a missing file and a missing section are reported, a good link and code are not."""
    (tmp_path / "a.md").write_text("# Title\n\n## Some section\n\ntext\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#some-section) [ok](a.md) [gone](c.md) [moved](a.md#other-section) [web](https://x.org/#y)\n"
        "`f[grid](...)` and\n```\n[x](nowhere.md)\n```\n"
    )
    assert broken_links(doc) == ["c.md: no such file", "a.md#other-section: no such section in a.md"]


def test_every_relative_link_of_the_docs_leads_to_a_file_and_section():
    bad = {str(p.relative_to(ROOT)): b for p in _markdown_files() if (b := broken_links(p))}
    assert not bad, bad


def test_every_section_the_code_cites_exists():
    """``docs/<file>.md#<section>`` in the source, the benchmarks, the tests and the Makefile."""
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    files += [ROOT / "benchmarks" / "gpu_session.sh", ROOT / "Makefile"]
    bad = []
    for path in files:
        for m in _CITED.finditer(path.read_text()):
            doc = ROOT / m.group(1)
            if not doc.exists() or m.group(2) not in anchors(doc):
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, bad
