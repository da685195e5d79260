"""Integration: ``slake calibrate`` on the default model writes a profile that ``slake generate`` picks up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slake.methods.profiles import model_identity, normalise_name

pytestmark = pytest.mark.integration


def _slake(args, env):
    # the bound only stops a hung run (this calibration takes about 4 min on 2 loaded cores; a run sharing them with
    # three other jobs failed at the former 15-min bound)
    return subprocess.run(
        [sys.executable, "-m", "slake.cli", *args], capture_output=True, text=True, env=env, timeout=2400
    )


def test_calibrate_writes_a_profile_that_generate_uses(tmp_path):
    env = {**os.environ, "SLAKE_PROFILE_DIR": str(tmp_path)}
    run = _slake(
        [
            "calibrate",
            "--methods",
            "slake",
            "--budgets",
            "64",
            "--length",
            "256",
            "--samples",
            "1",
            "--tokens",
            "4",
            "--no-refine",
            "--json",
        ],
        env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    (entry,) = out["entries"]
    assert entry["method"] == "slake" and entry["budget"] == 64 and entry["after"]["kl"] <= entry["before"]["kl"]
    assert entry["search"]["candidates"] >= 25 and entry["calibration"]["source"].startswith("pydoc_data")
    (path,) = out["profiles"]
    profile = json.loads(open(path).read())
    assert normalise_name(profile["model"]) == "smollm2" and profile["entries"][0]["values"] == entry["values"]
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "What jumps over the dog?")
    gen = _slake(
        [
            "generate",
            "--method",
            "slake",
            "--budget",
            "64",
            "--prompt-file",
            str(prompt),
            "--max-new-tokens",
            "2",
            "--json",
        ],
        env,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    res = json.loads(gen.stdout)
    assert res["profile"]["source"].startswith("user:") and res["profile"]["values"] == entry["values"]
    assert {k: res["hyperparameters"][k] for k in entry["values"]} == entry["values"]
    # a value set by the user wins over the profile
    gen = _slake(
        [
            "generate",
            "--method",
            "slake[alpha=0.123]",
            "--budget",
            "64",
            "--prompt-file",
            str(prompt),
            "--max-new-tokens",
            "2",
            "--json",
        ],
        env,
    )
    assert json.loads(gen.stdout)["hyperparameters"]["alpha"] == 0.123


def test_shipped_profile_matches_the_default_model():
    """The package ships the default model's profile, and it matches the model slake.load_model() loads."""
    import slake

    model, _ = slake.load_model()
    from slake.methods.profiles import load_profiles, resolve_method

    found = [src for src, _ in load_profiles(model_identity(model)) if src.startswith("shipped:")]
    assert found, "no shipped profile matches the default model"
    method, applied = resolve_method("slake", 128, model)
    assert applied is not None and applied["source"].startswith(("user:", "shipped:"))


def test_demo_answers_correctly_with_slake_and_reports_memory():
    """`make demo` (slake demo): the default budget was chosen so that SLAKE answers this question; keep it so."""
    run = subprocess.run(
        [sys.executable, "-m", "slake.cli", "demo", "--json"], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["full"]["correct"], out["full"]["text"]
    assert out["compressed"]["correct"], out["compressed"]["text"]
    assert 0 < out["kept_percent"] < 50
    assert out["compressed"]["kv_bytes"]["kept"] < out["full"]["kv_bytes"]["kept"]
