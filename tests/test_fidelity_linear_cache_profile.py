"""``slake fidelity --linear-cache on|off|both`` switches PTAA on the method as its profile resolves it: both sides of
the ablation run the same VABS exponents. Before, the switched spec was resolved instead, and a profile entry
calibrated with the linear cache (every shipped SLAKE entry) applied to the "on" side only: the "off" side ran the
paper's defaults, and a warning said the model had no profile for ``slake`` at that budget."""

from __future__ import annotations

import json
import logging

import pytest

import slake.engines.transformers.models as models
from slake.methods.profiles import model_identity, write_entry
from slake.quality import fidelity
from test_fidelity_fixes import _args, _Tokenizer
from test_profiles import _entry, profile_dir  # noqa: F401  (the fixture)
from tiny_models import random_ids

pytestmark = pytest.mark.usefixtures("profile_dir")  # profiles read from a temporary folder only


def test_both_linear_cache_settings_run_the_profile_of_the_method_as_given(llama_gqa, monkeypatch):
    cfg = llama_gqa.config
    monkeypatch.setattr(cfg, "slake_model_name", "tiny-llama-gqa", raising=False)
    write_entry(model_identity(cfg), _entry(40, 1.25, 0.75))  # calibrated with the linear cache on
    built = []

    class Recording(fidelity.CompressedKV):
        def __init__(self, method, *args, **kwargs):
            built.append(method)
            super().__init__(method, *args, **kwargs)

    monkeypatch.setattr(fidelity, "CompressedKV", Recording)
    rec = fidelity.record(llama_gqa, random_ids(120, seed=40), steps=2)
    rows = {lin: fidelity.measure(rec, "slake", 40, linear_cache=lin, profile_model=llama_gqa) for lin in (False, True)}
    assert [(m.linear_cache, m.alpha, m.beta) for m in built] == [(False, 1.25, 0.75), (True, 1.25, 0.75)]
    assert rows[False][0]["profile"] == rows[True][0]["profile"] and rows[True][0]["profile"]["values"]["alpha"] == 1.25
    # what the user set still wins, and a spec the profile does not cover keeps its own values on both sides
    built.clear()
    for lin in (False, True):
        fidelity.measure(rec, "slake[alpha=0.3]", 40, linear_cache=lin, profile_model=llama_gqa)
        fidelity.measure(rec, "slake[vabs_split=window]", 40, linear_cache=lin, profile_model=llama_gqa)
    assert [(m.alpha, m.beta) for m in built] == [(0.3, 0.75), (0.5, 0.4)] * 2


def test_the_cli_measures_both_settings_with_one_profile_and_says_nothing_of_missing_ones(
    llama_gqa, tmp_path, monkeypatch, capsys, caplog
):
    cfg = llama_gqa.config
    monkeypatch.setattr(cfg, "slake_model_name", "tiny-llama-gqa", raising=False)
    write_entry(model_identity(cfg), _entry(40, 1.25, 0.75))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(100)))
    args = _args(
        "--prompt-file", str(prompt), "--methods", "slake", "--budgets", "40", "--length", "120", "--steps", "2",
        "--output-tokens", "3", "--output-samples", "1", "--linear-cache", "both", "--no-progress", "--json",
    )  # fmt: skip
    from slake.cli.fidelity import cmd_fidelity

    with caplog.at_level(logging.WARNING):
        assert cmd_fidelity(args) == 0
    data = json.loads(capsys.readouterr().out)
    for level in ("rows", "output_rows"):
        profiles = {r["linear_cache"]: r["profile"] for r in data[level]}
        assert set(profiles) == {False, True} and profiles[False] == profiles[True]
        assert profiles[False]["values"] == {"alpha": 1.25, "beta": 0.75}
    assert "no calibrated profile" not in caplog.text
