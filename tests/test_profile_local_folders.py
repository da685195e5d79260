"""Profiles of models named by local paths: two folders of one name (two runs' ``checkpoint-500``) each keep their
own calibration. Before, ``slake calibrate`` on the second rewrote the first's profile file, and the second ran
with the first's values without a word (the tests marked "before" failed)."""

from __future__ import annotations

import logging

import pytest

import slake.methods.profiles as profiles
from slake.methods.profiles import model_identity, resolve_method, write_entry
from tiny_models import tiny_model


def _entry(alpha: float) -> dict:
    return {"method": "slake", "budget": 128, "values": {"alpha": alpha, "beta": 0.0}, "context": {}}


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.delenv("SLAKE_NO_PROFILE", raising=False)
    monkeypatch.setattr(profiles, "_TOLD_OTHER_FOLDER", set())
    models = []
    for run in ("run-a", "run-b"):
        folder = tmp_path / run / "checkpoint-500"
        folder.mkdir(parents=True)
        m = tiny_model("llama-gqa")
        m.config.slake_model_name = str(folder)  # what slake.load_model sets for --model PATH
        models.append(m)
    return models


def test_calibrating_a_second_folder_of_the_same_name_keeps_the_first_profile(two_runs):
    a, b = two_runs
    path_a = write_entry(model_identity(a), _entry(3.0))
    path_b = write_entry(model_identity(b), _entry(0.5))
    assert path_a != path_b  # before: one file, b's entry replacing a's
    assert resolve_method("slake", 128, a)[0].alpha == 3.0
    assert resolve_method("slake", 128, b)[0].alpha == 0.5


def test_a_folder_running_another_folders_profile_is_told_once(two_runs, caplog):
    a, b = two_runs
    write_entry(model_identity(a), _entry(3.0))
    with caplog.at_level(logging.WARNING, logger="slake"):
        built, profile = resolve_method("slake", 128, b)
        resolve_method("slake", 128, b)
    # a fine-tune saved under its base's folder name finds the base's profile (docs/profiles.md), and is told so
    assert built.alpha == 3.0 and profile is not None
    told = [r.getMessage() for r in caplog.records if "another folder of the same name" in r.getMessage()]
    assert len(told) == 1 and "run-a" in told[0]  # before: nothing said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slake"):
        resolve_method("slake", 128, a)  # its own profile: nothing to tell
    assert not [r for r in caplog.records if "another folder" in r.getMessage()]


def test_a_folder_named_like_a_packaged_model_does_not_make_it_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # slake eval --out smollm2
    assert profiles._local_path("smollm2") is None  # an --out folder, not a model: the packaged name
    assert profiles._local_path("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert profiles._local_path("./smollm2") == str(tmp_path / "smollm2")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert profiles._local_path("ckpt") == str(tmp_path / "ckpt")
