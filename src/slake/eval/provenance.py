"""Which code wrote a result row: slake's version, and the commit where slake runs from a git checkout.

A results directory resumes: a rerun skips the rows it finds under its keys (:func:`slake.eval.results.row_key`) and
reports them as its own. The key does not name the code, so after a change to a method a rerun into the old
directory would summarise rows the old code made. Rows record :func:`code_version`, and :func:`rows_of_other_code`
finds the resumed rows another version wrote, so that the run can say so.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

__all__ = ["code_version", "rows_of_other_code", "describe_other_code"]

#: seconds one git query may take before the commit is left out
_GIT_TIMEOUT_S = 10.0


def _git(package: Path, *args: str) -> str | None:
    """The stripped output of ``git -C package ARGS``, or None where git is missing, fails or times out. git finds the
    repository from ``package`` alone: the environment's ``GIT_*`` variables (``GIT_DIR``, ``GIT_WORK_TREE``,
    ``GIT_INDEX_FILE``, set by a git hook or by a user working on another repository) are left out, since with them
    git answered for that other repository (before 2026-12-02)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(
            ["git", "-C", str(package), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
            env=env,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout_suffix(package: Path) -> str:
    """``+g<commit>`` (12 hex digits), with ``.dirty`` where files under ``package`` differ from that commit or are
    not tracked by it (ignored files aside), when
    ``package``'s files are tracked by a git work tree; ``""`` otherwise: an installed copy (a wheel, a
    ``git archive`` snapshot), a copy in an ignored folder of some other repository (a virtual environment inside a
    checkout), or no git on the machine.

    Parameters
    ----------
    package : Path
        The folder of slake's sources (``slake/``).
    """
    if _git(package, "ls-files", "--error-unmatch", "--", "__init__.py") is None:
        return ""
    commit = _git(package, "rev-parse", "--short=12", "HEAD")
    if not commit:
        return ""
    # untracked files count (a new module not yet added runs too; before 2026-12-02 it did not make the tree
    # dirty); ignored ones (__pycache__) do not
    changes = _git(package, "status", "--porcelain", "--untracked-files=normal", "--", ".")
    return f"+g{commit}" + (".dirty" if changes else "")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The code this process runs: ``slake.__version__``, followed by ``+g<commit>`` (and ``.dirty`` with uncommitted
    changes to slake's sources) where slake runs from a git checkout (:func:`checkout_suffix`): ``"0.1.0"``,
    ``"0.1.0+gdea0264a1b2c"``, ``"0.1.0+gdea0264a1b2c.dirty"``. Read once per process.

    A version alone does not tell two commits of one release apart, and ``.dirty`` does not tell two sets of
    uncommitted changes apart: the field says which code wrote a row where it can, and that it cannot say more where
    it ends in ``.dirty``.
    """
    import slake

    return slake.__version__ + checkout_suffix(Path(slake.__file__).resolve().parent)


def rows_of_other_code(rows: Iterable[dict[str, Any]], keys: Collection[Any], version: str) -> list[dict[str, Any]]:
    """The rows among ``rows`` whose resume key (:func:`slake.eval.results.row_key`) is in ``keys`` and that record a
    ``code_version`` other than ``version``. Rows that do not record one (written before it was recorded, or merged
    from kvpress's side, which slake's code did not make) are not counted."""
    from slake.eval.results import row_key

    return [r for r in rows if r.get("code_version") not in (None, version) and row_key(r) in keys]


def describe_other_code(rows: list[dict[str, Any]], version: str, path: Any) -> str:
    """One line for :func:`rows_of_other_code`'s ``rows``: how many, which versions wrote them, and what to do."""
    versions = sorted({str(r["code_version"]) for r in rows})
    shown = ", ".join(versions[:3]) + (f" and {len(versions) - 3} more" if len(versions) > 3 else "")
    return (
        f"{len(rows)} row(s) of {path} this run resumes as its own were written by other code ({shown}; this run is "
        f"{version}): the resume key does not name the code, so they are not run again; write to a new --out to "
        "measure this code"
    )
