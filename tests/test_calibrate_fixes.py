"""``slake calibrate`` and profiles: fixes for budgets that evict nothing, entries applied to other variants, the
reported "before" values, ``--alias`` on an existing profile and an unwritable ``--out-dir``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import slake.engines.transformers.models as models_module
import slake.quality.calibrate as calibrate_module
import test_calibrate
from packaged_shapes import SMOLLM2
from slake.cli import build_parser, main
from slake.cli.calibrate import _check_args
from slake.methods import make_method
from slake.methods.profiles import load_profiles, model_identity, profile_path, resolve_method, write_entry
from slake.quality.calibrate import calibrate_method
from slake.quality.output_fidelity import mean_distance, measure_outputs

#: test_calibrate's fixture: the tiny model's two prefilled calibration prompts (80 and 64 tokens)
reference = test_calibrate.reference

SPEC = "slake[window=8]"
GRID = {"alpha": (0.0, 3.0), "beta": (0.0, 2.0)}


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    folder = tmp_path / "profiles"
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(folder))
    monkeypatch.delenv("SLAKE_NO_PROFILE", raising=False)
    return folder


@pytest.fixture
def fake_load(monkeypatch, llama_gqa, reference):
    """``slake calibrate`` on the tiny model and its two prefilled prompts (80 and 64 tokens), on a 2x2 grid."""
    monkeypatch.setattr(llama_gqa.config, "slake_model_name", "tiny-calib", raising=False)
    monkeypatch.setattr(models_module, "load_model", lambda *a, **k: (llama_gqa, None))
    monkeypatch.setattr(calibrate_module, "calibration_reference", lambda *a, **k: reference)
    monkeypatch.setitem(calibrate_module.GRIDS, "slake", GRID)
    return llama_gqa


def _calibrate(out_dir, *extra: str, budgets: str = "24") -> list[str]:
    return [
        "calibrate",
        "--methods",
        SPEC,
        "--budgets",
        budgets,
        "--length",
        "256",
        "--samples",
        "1",
        "--tokens",
        "2",
        "--no-refine",
        "--out-dir",
        str(out_dir),
        *extra,
    ]


# 1. budgets that evict nothing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["256", "512", "128,300"])
def test_budget_at_or_above_the_calibration_length_is_refused_before_loading(budget):
    args = build_parser().parse_args(["calibrate", "--budgets", budget, "--length", "256"])
    with pytest.raises(ValueError, match="--length"):
        _check_args(args)


def test_budget_below_the_length_and_ratios_are_accepted(profile_dir):
    _check_args(build_parser().parse_args(["calibrate", "--budgets", "255,0.5", "--length", "256"]))


def test_search_that_measured_nothing_raises(llama_gqa, reference):
    # a budget above both prompts (80 and 64 tokens) evicts nothing: every candidate has the same distance
    with pytest.raises(ValueError, match="measured nothing"):
        calibrate_method(llama_gqa, reference, make_method(SPEC), 100, grid=GRID, refine=False)


def test_cli_writes_no_entry_whose_search_measured_nothing(fake_load, tmp_path, profile_dir, capsys):
    out = tmp_path / "out"
    assert main(_calibrate(out, "--json", budgets="100")) == 2
    assert "measured nothing" in capsys.readouterr().err
    assert not out.is_dir() or not list(out.glob("*.json"))
    # one budget that measures something still gets its entry, the other is skipped with a message
    assert main(_calibrate(out, "--json", budgets="24,100")) == 0
    captured = capsys.readouterr()
    assert "measured nothing" in captured.err
    entries = json.loads(captured.out)["entries"]
    assert [e["budget"] for e in entries] == [24]
    data = json.loads(profile_path(model_identity(fake_load), out).read_text())
    assert [e["budget"] for e in data["entries"]] == [24]


# 2. an entry applies only to the variant it was calibrated for --------------------------------------------------


def _config():
    return SimpleNamespace(
        slake_model_name="my-org/Tiny-Model-1B",
        model_type="llama",
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )


def test_a_key_missing_from_the_context_means_the_default(profile_dir):
    cfg = _config()
    ctx = {k: v for k, v in make_method("slake").hyperparameters().items() if k not in ("alpha", "beta")}
    del ctx["budget_hint"]
    write_entry(
        model_identity(cfg), {"method": "slake", "budget": 128, "values": {"alpha": 0.9, "beta": 0.1}, "context": ctx}
    )
    m, applied = resolve_method("slake", 128, cfg)
    assert applied is not None and (m.alpha, m.beta) == (0.9, 0.1)
    m, applied = resolve_method("slake[budget_hint=300]", 128, cfg)
    assert applied is None and (m.alpha, m.beta) == (0.5, 0.4)


def test_a_layer_cap_is_not_matched_it_bounds_the_profile(profile_dir):
    """The shipped entries at 128 predate max_layer_budget and those at 512 record it as None: a capped variant gets
    them, capped, at both (as vLLM's plugin caps after resolving), not one and not the other."""
    cfg = SimpleNamespace(slake_model_name="smollm2", model_type="llama", **SMOLLM2)
    for budget in (128, 512):
        m, applied = resolve_method("slake[max_layer_budget=1000]", budget, cfg)
        assert applied is not None and m.max_layer_budget == 1000, budget
        assert (m.alpha, m.beta) == tuple(applied["values"][k] for k in ("alpha", "beta"))


# 3. "before" is what was in force ------------------------------------------------------------------------------


def test_before_is_the_profile_in_force_and_its_measured_distance(fake_load, reference, tmp_path, profile_dir, capsys):
    identity = model_identity(fake_load)
    ctx = {k: v for k, v in make_method(SPEC).hyperparameters().items() if k not in ("alpha", "beta")}
    write_entry(identity, {"method": "slake", "budget": 24, "values": {"alpha": 1.7, "beta": 0.3}, "context": ctx})
    assert main(_calibrate(tmp_path / "out", "--json")) == 0
    (entry,) = json.loads(capsys.readouterr().out)["entries"]
    assert entry["before"]["values"] == {"alpha": 1.7, "beta": 0.3}
    rows = measure_outputs(fake_load, reference, make_method(SPEC, alpha=1.7, beta=0.3), 24)
    assert abs(mean_distance(rows) - entry["before"]["kl"]) < 1e-6
    assert entry["after"]["kl"] <= entry["before"]["kl"]


# 4. --alias on an existing profile ----------------------------------------------------------------------------


def test_alias_is_added_to_an_existing_profile(profile_dir):
    cfg = _config()
    ctx = {k: v for k, v in make_method("slake").hyperparameters().items() if k not in ("alpha", "beta")}
    entry = {"method": "slake", "budget": 128, "values": {"alpha": 0.9, "beta": 0.1}, "context": ctx}
    write_entry(model_identity(cfg), entry)
    write_entry(model_identity(cfg), entry, aliases=["Other-Name"])
    write_entry(model_identity(cfg), entry, aliases=["Other-Name"])
    data = json.loads(profile_path(model_identity(cfg)).read_text())
    assert data["aliases"] == ["Other-Name"]
    other = model_identity(SimpleNamespace(**{**vars(cfg), "slake_model_name": "other-name"}))
    assert load_profiles(other)


# 5. an unwritable --out-dir -----------------------------------------------------------------------------------


def test_unwritable_out_dir_is_refused_before_loading(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = build_parser().parse_args(["calibrate", "--out-dir", str(blocker / "x")])
    with pytest.raises(ValueError, match="--out-dir"):
        _check_args(args)


# messages ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["slake[alpha=0.3]", "cake[tau2=2.0,window=8]"])
def test_a_searched_value_in_a_spec_is_refused_before_loading(spec):
    """``slake calibrate --methods slake[alpha=0.3]`` searched alpha anyway and wrote an entry that applied to plain
    slake: the value set was silently dropped."""
    args = build_parser().parse_args(["calibrate", "--methods", spec, "--budgets", "24", "--length", "256"])
    with pytest.raises(ValueError, match="searches .*drop (alpha|tau2)"):
        _check_args(args)


def test_calibrate_does_not_tell_the_user_to_calibrate(fake_load, tmp_path, profile_dir, caplog):
    """The "before" point of a model without a profile was resolved with the warning "no calibrated profile ...
    `slake calibrate` fits them", printed by slake calibrate itself."""
    import logging

    from slake.methods import profiles

    profiles._TOLD_DEFAULTS.clear()
    caplog.set_level(logging.WARNING, logger="slake")
    assert main(_calibrate(tmp_path / "out", "--json")) == 0
    assert not [r for r in caplog.records if "slake calibrate" in r.getMessage()]


def test_a_search_that_measured_nothing_names_the_searched_values(llama_gqa, reference):
    """With VABS off SLAKE's alpha and beta allocate nothing: the message asked whether the budget was at or above
    the prompts' length, which the command line refuses already."""
    with pytest.raises(ValueError, match="alpha and beta change nothing here.*vabs=false"):
        calibrate_method(llama_gqa, reference, make_method("slake[window=8,vabs=false]"), 24, grid=GRID, refine=False)


# the written profile is plain JSON, the progress bar ends at its total, --out-dir says how to use it --------------


def _strict_json(text: str):
    """``json.loads`` refusing ``NaN`` and ``Infinity``, which JSON does not have (jq and JavaScript reject them)."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_before_point_that_overflowed_is_written_as_null(fake_load, monkeypatch, tmp_path, profile_dir, capsys):
    """The "before" point's distance was written as ``NaN`` into the profile and the ``--json`` output when it
    overflowed (the other candidates being finite): only Python's lenient parser read the file."""
    measure = calibrate_module.measure_outputs

    def overflowing_before(model, ref, m, budget):
        rows = measure(model, ref, m, budget)
        if (m.alpha, m.beta) == (0.5, 0.4):  # slake's defaults, not on GRID: the "before" point
            rows = [{**r, "kl": float("nan"), "delta_nll": float("inf")} for r in rows]
        return rows

    monkeypatch.setattr(calibrate_module, "measure_outputs", overflowing_before)
    out = tmp_path / "out"
    assert main(_calibrate(out, "--json")) == 0
    (entry,) = _strict_json(capsys.readouterr().out)["entries"]
    assert entry["before"]["kl"] is None and entry["before"]["delta_nll"] is None
    assert entry["after"]["kl"] >= 0 and entry["values"] != {"alpha": 0.5, "beta": 0.4}
    (written,) = _strict_json(profile_path(model_identity(fake_load), out).read_text())["entries"]
    assert written["before"]["kl"] is None and written["after"] == entry["after"]
    assert main(_calibrate(out)) == 0  # the table shows what is not a number
    assert "| n/a |" in capsys.readouterr().out


def test_a_search_whose_candidates_overflowed_says_so(monkeypatch):
    """Of 26 candidates 25 overflowed and one was finite: the message said "all 26 candidates gave the same
    distance" and blamed the budget or vabs=false."""

    def one_finite(model, ref, m, budget):
        kl = 0.3 if (m.alpha, m.beta) == (1.0, 1.0) else float("nan")
        return [{"kl": kl, "delta_nll": 0.0, "top1": 1.0, "tokens": 4}]

    monkeypatch.setattr(calibrate_module, "measure_outputs", one_finite)
    with pytest.raises(ValueError, match="25 of 26 candidates gave a distance that is not a finite number"):
        calibrate_method(None, None, make_method("slake"), 128, refine=False)


def test_the_progress_bar_ends_at_its_total(fake_load, monkeypatch, tmp_path, profile_dir):
    """A "before" point on the grid is measured once: the bar planned 1 + grid candidates per search and ended at
    4/5 (with the refinement, often 28/34), as if the run had stopped short."""
    import tqdm.auto

    ends = []

    class Bar(tqdm.auto.tqdm):
        def close(self):
            ends.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setitem(calibrate_module.GRIDS, "slake", {"alpha": (0.0, 0.5), "beta": (0.0, 0.4)})
    assert main(_calibrate(tmp_path / "out", "--json", budgets="24,100")) == 0  # 100: measured nothing, skipped
    assert ends and set(ends) == {(10, 10)}  # tqdm closes again when collected


def test_an_out_dir_slake_does_not_read_is_named_with_the_variable_to_set(fake_load, tmp_path, profile_dir, capsys):
    """``--out-dir DIR`` wrote a profile that generate/eval/bench never read (they read ``$SLAKE_PROFILE_DIR``),
    and nothing said so: the next runs used the former values."""
    out = tmp_path / "elsewhere"
    assert main(_calibrate(out, "--json")) == 0
    assert f"SLAKE_PROFILE_DIR={out}" in capsys.readouterr().err
    assert main(_calibrate(profile_dir, "--json")) == 0
    assert "SLAKE_PROFILE_DIR=" not in capsys.readouterr().err
