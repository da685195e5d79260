"""Rows record the code that made them (``code_version``), and a rerun that resumes rows of other code says so:
before, nothing recorded the code, and a rerun into an old ``--out`` after a method change summarised the old code's
rows as its own without a word."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

import slake
from slake.eval import provenance
from slake.eval.needle import needle_grid
from slake.eval.results import read_results
from slake.eval.runner import run_suite
from test_eval_runner import ESSAYS, TinyTokenizer

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
    """A git work tree with a committed package folder ``src/pkg``."""
    repo = tmp_path / "repo"
    package = repo / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("venv/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return repo, package


@needs_git
def test_a_committed_checkout_names_its_commit_and_uncommitted_changes(checkout):
    repo, package = checkout
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert provenance.checkout_suffix(package) == f"+g{head}"
    (package / "__init__.py").write_text("x = 2\n")
    assert provenance.checkout_suffix(package) == f"+g{head}.dirty"
    (package / "__init__.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("outside the package\n")
    _git(repo, "add", "notes.txt")
    assert provenance.checkout_suffix(package) == f"+g{head}"  # changes outside slake's sources do not count


@needs_git
def test_an_untracked_file_in_the_package_makes_it_dirty_and_an_ignored_one_does_not(checkout):
    """Before: ``git status --untracked-files=no``, so a new module not yet added (code that runs) left the suffix
    clean."""
    repo, package = checkout
    clean = provenance.checkout_suffix(package)
    (repo / ".gitignore").write_text("venv/\n__pycache__/\n")
    _git(repo, "add", ".gitignore")
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert provenance.checkout_suffix(package) == clean
    (package / "new_method.py").write_text("y = 1\n")
    assert provenance.checkout_suffix(package) == clean + ".dirty"


@needs_git
def test_another_repository_in_git_dir_is_not_asked(checkout, tmp_path, monkeypatch):
    """Before: with ``GIT_DIR`` set (a git hook, a user working on another repository) git answered for that
    repository: its commit, or none."""
    repo, package = checkout
    clean = provenance.checkout_suffix(package)
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "f").write_text("f\n")
    _git(other, "add", ".")
    _git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "other")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    assert provenance.checkout_suffix(package) == clean


@needs_git
def test_a_copy_git_does_not_track_names_no_commit(checkout, tmp_path):
    repo, package = checkout
    ignored = repo / "venv" / "site-packages" / "pkg"  # an installed copy inside an ignored folder of a checkout
    shutil.copytree(package, ignored)
    assert provenance.checkout_suffix(ignored) == ""
    outside = tmp_path / "snapshot" / "pkg"  # a git archive snapshot: no work tree at all
    shutil.copytree(package, outside)
    assert provenance.checkout_suffix(outside) == ""


def test_no_git_on_the_machine_names_no_commit(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert provenance.checkout_suffix(Path(slake.__file__).resolve().parent) == ""


def test_code_version_starts_with_the_release():
    version = provenance.code_version()
    assert version == slake.__version__ or version.startswith(slake.__version__ + "+g")


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


def _rerun_rows(llama_gqa, tok, tmp_path, caplog, stored_version):
    samples = needle_grid(tok, [200], [0, 100], seed=1, essays=ESSAYS, max_new_tokens=2)
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    first = run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], tmp_path, **kw)
    assert {r["code_version"] for r in first} == {provenance.code_version()}
    if stored_version is not None:
        rows = [{**r, "code_version": stored_version} for r in first]
        (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slake"):
        ran = run_suite(llama_gqa, tok, samples, ["snapkv"], [40], tmp_path, **kw)
    assert len(ran) == 2 and len(read_results(tmp_path)) == 4  # the first sample resumed, the second ran
    return [r.getMessage() for r in caplog.records if "other code" in r.getMessage()]


def test_resuming_rows_of_other_code_warns(llama_gqa, tok, tmp_path, caplog):
    warned = _rerun_rows(llama_gqa, tok, tmp_path, caplog, "0.0.1+gdeadbeef0000")
    assert len(warned) == 1
    assert "2 row(s)" in warned[0] and "0.0.1+gdeadbeef0000" in warned[0] and provenance.code_version() in warned[0]


def test_resuming_rows_of_this_code_does_not_warn(llama_gqa, tok, tmp_path, caplog):
    assert _rerun_rows(llama_gqa, tok, tmp_path, caplog, None) == []


def test_rows_that_record_no_code_or_that_this_run_does_not_resume_are_not_counted():
    from slake.eval.results import row_key

    base = dict(task="t", sample_id="s", method="m", budget=8, length=10, model="x", prefill_chunk=None)
    rows = [
        {**base, "code_version": "0.0.1"},
        {**base, "sample_id": "other", "code_version": "0.0.1"},
        {**base, "sample_id": "old"},  # written before the field was recorded
        {**base, "sample_id": "same", "code_version": "9.9"},
    ]
    keys = {row_key(r) for r in rows if r["sample_id"] != "other"}
    assert provenance.rows_of_other_code(rows, keys, "9.9") == [rows[0]]
