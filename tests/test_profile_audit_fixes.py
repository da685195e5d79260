"""Fixes from the 2026-11-30 (thirty-fourth) audit of calibration and profiles.

A new calibration stayed beside an older entry of the same method and budget whose context differed only by a key
profiles never match on (``max_layer_budget``) or lacked one (written before it existed), and the older, first in the
file, kept being applied; a NaN distance met first became the calibration's pick, and one infinite distance made the
search report that it measured nothing; and the papers' values matched models whose names differ from the papers'
only by where the separators fall (``Qwen2-57B`` took ``Qwen2.5-7B``'s CAKE temperatures).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import slake.quality.calibrate as cal
from slake.methods.base import make_method
from slake.methods.cake import cake_taus, match_family
from slake.methods.profiles import model_identity, resolve_method, write_entry
from slake.methods.slake import slake_alpha_beta

CFG = SimpleNamespace(slake_model_name="mymodel", model_type="llama", num_hidden_layers=3, hidden_size=64,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)  # fmt: skip


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path))
    return tmp_path


def _context(**changes):
    ctx = {k: v for k, v in make_method("slake").hyperparameters().items() if k not in ("alpha", "beta")}
    return {**ctx, **changes}


def _entry(values, context):
    return {"method": "slake", "budget": 128, "values": dict(zip(("alpha", "beta"), values)), "context": context}


def test_a_new_calibration_replaces_an_entry_written_before_a_hyperparameter_existed(profile_dir):
    ident = model_identity(CFG)
    old = {k: v for k, v in _context().items() if k != "max_layer_budget"}
    write_entry(ident, _entry((2.0, 0.0), old))
    path = write_entry(ident, _entry((0.25, 1.0), _context()))
    assert [e["values"] for e in json.loads(path.read_text())["entries"]] == [{"alpha": 0.25, "beta": 1.0}]
    m, _ = resolve_method("slake", 128, CFG)
    assert (m.alpha, m.beta) == (0.25, 1.0)


def test_a_calibration_with_another_layer_cap_replaces_the_plain_one(profile_dir):
    ident = model_identity(CFG)
    write_entry(ident, _entry((2.0, 0.0), _context()))
    write_entry(ident, _entry((0.25, 1.0), _context(max_layer_budget=100)))
    for spec in ("slake", "slake[max_layer_budget=100]"):
        m, _ = resolve_method(spec, 128, CFG)
        assert (m.alpha, m.beta) == (0.25, 1.0), spec


def test_entries_of_other_variants_stay(profile_dir):
    ident = model_identity(CFG)
    write_entry(ident, _entry((2.0, 0.0), _context()))
    path = write_entry(ident, _entry((0.25, 1.0), _context(vabs_split="window")))
    assert len(json.loads(path.read_text())["entries"]) == 2
    assert (
        resolve_method("slake", 128, CFG)[0].alpha,
        resolve_method("slake[vabs_split=window]", 128, CFG)[0].alpha,
    ) == (2.0, 0.25)


def _fake_scores(monkeypatch, bad):
    def measure_outputs(model, ref, m, budget):  # the true optimum at (1.0, 0.5)
        kl = bad.get((round(m.alpha, 4), round(m.beta, 4)), (m.alpha - 1.0) ** 2 + (m.beta - 0.5) ** 2 + 0.1)
        return [{"kl": kl, "delta_nll": 0.0, "top1": 1.0, "tokens": 10}]

    monkeypatch.setattr(cal, "measure_outputs", measure_outputs)


@pytest.mark.parametrize(
    "bad,expected",
    [
        ({(0.5, 0.4): float("nan")}, {"alpha": 1.0, "beta": 0.5}),  # before: the NaN before-point was kept
        ({(2.0, 2.0): float("inf")}, {"alpha": 1.0, "beta": 0.5}),  # before: "measured nothing"
        ({(1.0, 0.5): float("nan")}, None),  # the optimum itself NaN: the best finite one
    ],
)
def test_calibration_skips_non_finite_distances(monkeypatch, bad, expected):
    _fake_scores(monkeypatch, bad)
    entry = cal.calibrate_method(None, None, make_method("slake"), 128)
    assert entry["after"]["kl"] == entry["after"]["kl"] and entry["after"]["kl"] < 0.2
    if expected is not None:
        assert entry["values"] == expected
    else:
        assert entry["values"] != {"alpha": 1.0, "beta": 0.5}


def test_calibration_with_no_finite_distance_measured_nothing(monkeypatch):
    monkeypatch.setattr(
        cal, "measure_outputs", lambda *a: [{"kl": float("nan"), "delta_nll": 0.0, "top1": 1.0, "tokens": 1}]
    )
    with pytest.raises(cal.NothingMeasured, match="not a finite number"):
        cal.calibrate_method(None, None, make_method("slake"), 128)


@pytest.mark.parametrize(
    "name,family",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("llama3.1_8b", "llama-3.1-8b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
        ("meta-llama/Llama-2-13b-chat-hf", "llama-2-13b"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),
        ("Qwen/Qwen2-57B-A14B-Instruct", None),  # before: Qwen2.5-7B's
        ("meta-llama/Llama-2-70b-chat-hf", None),
        ("mistralai/Mistral-7B-Instruct-v0.2", None),
        ("Qwen/Qwen2.5-72B-Instruct", None),
    ],
)
def test_paper_families_match_the_papers_models_only(name, family):
    from slake.methods.cake import _MODEL2TAU

    found = match_family(name, list(_MODEL2TAU))
    assert (found[0] if found else None) == family
    if family is None:
        assert cake_taus(name, 128) == (1.0, 1.0)
    assert slake_alpha_beta("Qwen/Qwen2-57B-A14B-Instruct", 128) == (0.5, 0.4)


def test_a_calibration_under_an_alias_goes_into_the_profile_that_answers_to_it(profile_dir):
    """``calibrate --model mymodel --alias Org/MyModel-Instruct`` then ``calibrate --model Org/MyModel-Instruct``:
    the second wrote ``mymodelinstruct.json``, read after ``mymodel.json``, which kept being applied."""
    write_entry(model_identity(CFG), _entry((2.0, 0.0), _context()), aliases=["Org/MyModel-Instruct"])
    other = SimpleNamespace(**{**vars(CFG), "slake_model_name": "Org/MyModel-Instruct"})
    path = write_entry(model_identity(other), _entry((0.25, 1.0), _context()))
    assert [p.name for p in profile_dir.glob("*.json")] == ["mymodel.json"] == [path.name]
    for cfg in (CFG, other):
        m, _ = resolve_method("slake", 128, cfg)
        assert (m.alpha, m.beta) == (0.25, 1.0)


@pytest.mark.parametrize("name", [".", "./"])
def test_a_model_run_from_its_own_folder_reads_back_its_profile(profile_dir, tmp_path, monkeypatch, name):
    folder = tmp_path / "models" / "mymodel"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(folder)
    cfg = SimpleNamespace(**{**vars(CFG), "slake_model_name": name})
    path = write_entry(model_identity(cfg), _entry((2.0, 0.0), _context()))
    assert path.name == "mymodel.json"
    m, prof = resolve_method("slake", 128, cfg)
    assert (m.alpha, m.beta) == (2.0, 0.0) and prof is not None  # before: the defaults (0.5, 0.4)
