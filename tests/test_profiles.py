"""Per-model hyperparameter profiles: where alpha/beta and tau1/tau2 come from, and in which order."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from packaged_shapes import GEMMA3_270M, QWEN_CODER_05B, SMOLLM2
from slake import SlakeCache
from slake.methods import make_method
from slake.methods.profiles import (
    find_entry,
    load_profiles,
    model_identity,
    normalise_name,
    profile_path,
    resolve_method,
    write_entry,
)


def _config(name="my-org/Tiny-Model-1B", layers=3):
    return SimpleNamespace(
        slake_model_name=name,
        model_type="llama",
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )


def _entry(budget=128, alpha=0.9, beta=0.1, **context):
    ctx = {k: v for k, v in make_method("slake").hyperparameters().items() if k not in ("alpha", "beta")}
    ctx.update(context)
    return {"method": "slake", "budget": budget, "values": {"alpha": alpha, "beta": beta}, "context": ctx}


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path))
    monkeypatch.delenv("SLAKE_NO_PROFILE", raising=False)
    return tmp_path


def test_no_model_or_no_profile_gives_the_method_defaults(profile_dir):
    m, applied = resolve_method("slake", 128)
    assert applied is None and (m.alpha, m.beta) == (0.5, 0.4)
    m, applied = resolve_method("slake", 128, _config())
    assert applied is None and (m.alpha, m.beta) == (0.5, 0.4)
    m, applied = resolve_method("snapkv", 128, _config())
    assert applied is None and m.name == "snapkv"


def test_user_profile_applies_at_the_nearest_budget_within_a_factor_two(profile_dir):
    cfg = _config()
    path = write_entry(model_identity(cfg), _entry(128, 0.9, 0.1))
    write_entry(model_identity(cfg), _entry(512, 0.2, 0.3))
    assert path == profile_dir / "tinymodel1b.json" == profile_path(model_identity(cfg))
    m, applied = resolve_method("slake", 128, cfg)
    assert (m.alpha, m.beta) == (0.9, 0.1) and applied["budget"] == 128 and applied["source"].startswith("user:")
    assert (resolve_method("slake", 200, cfg)[0].alpha, resolve_method("slake", 300, cfg)[0].alpha) == (0.9, 0.2)
    assert resolve_method("slake", 40, cfg)[1] is None  # more than a factor 2 from any calibrated budget
    assert resolve_method("slake", 0.25, cfg)[1] is None  # ratios only match ratio entries
    write_entry(model_identity(cfg), _entry(0.2, 0.7, 0.7))
    assert resolve_method("slake", 0.25, cfg)[0].alpha == 0.7
    # re-calibrating the same (method, budget, context) replaces the entry
    write_entry(model_identity(cfg), _entry(128, 1.5, 0.5))
    data = json.loads(path.read_text())
    assert [e["budget"] for e in data["entries"]] == [0.2, 128, 512]
    assert resolve_method("slake", 128, cfg)[0].alpha == 1.5


def test_user_values_win_and_profiles_never_apply_to_other_configurations(profile_dir):
    cfg = _config()
    write_entry(model_identity(cfg), _entry(128, 0.9, 0.1))
    m, applied = resolve_method("slake[alpha=0.3]", 128, cfg)
    assert (m.alpha, m.beta) == (0.3, 0.1) and applied["values"] == {"beta": 0.1}
    m, applied = resolve_method("slake", 128, cfg, alpha=0.3, beta=0.2)
    assert (m.alpha, m.beta) == (0.3, 0.2) and applied is None
    built = make_method("slake")
    assert resolve_method(built, 128, cfg) == (built, None)  # a built Method is used exactly as given
    m, applied = resolve_method("slake[linear_cache=false]", 128, cfg)  # calibrated with PTAA on: not this
    assert applied is None and m.alpha == 0.5


def test_model_matching_by_name_and_architecture(profile_dir):
    write_entry(model_identity(_config()), _entry(128, 0.9, 0.1), aliases=["tiny-alias"])
    assert resolve_method("slake", 128, _config("Tiny-Model-1B"))[0].alpha == 0.9  # organisation dropped
    assert resolve_method("slake", 128, _config("tiny-alias"))[0].alpha == 0.9
    assert resolve_method("slake", 128, _config("other-model"))[1] is None
    assert resolve_method("slake", 128, _config(layers=4))[1] is None  # same name, other architecture
    with pytest.raises(ValueError, match="another architecture"):
        write_entry(model_identity(_config(layers=4)), _entry())
    assert normalise_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2135minstruct"


def test_papers_tables_for_the_papers_models(profile_dir):
    llama31 = _config("meta-llama/Llama-3.1-8B-Instruct")
    m, applied = resolve_method("slake", 128, llama31)
    assert (m.alpha, m.beta) == (0.4, 0.2) and applied["source"] == "paper"  # SLAKE Table 3
    assert resolve_method("slake", 256, llama31)[0].alpha == 0.6
    m, applied = resolve_method("cake", 128, _config("mistralai/Mistral-7B-Instruct-v0.3"))
    assert (m.tau1, m.tau2) == (1.0, 0.8) and applied["source"] == "paper"
    assert resolve_method("cake", 256, llama31)[1] is None  # the reference code tunes 128 and 1024 only


def test_bad_profile_file_is_a_clear_error(profile_dir):
    (profile_dir / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable slake profile"):
        load_profiles(model_identity(_config()))
    (profile_dir / "broken.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a slake profile"):
        load_profiles(model_identity(_config()))


def test_slake_cache_applies_the_profile_of_profile_model(profile_dir, llama_gqa):
    cfg = llama_gqa.config
    cfg.slake_model_name = "tiny-llama-gqa"
    try:
        write_entry(model_identity(cfg), _entry(64, 1.25, 0.75))
        cache = SlakeCache("slake", 64, cfg.num_hidden_layers, profile_model=llama_gqa)
        assert (cache.method.alpha, cache.method.beta) == (1.25, 0.75) and cache.profile["values"]["alpha"] == 1.25
        plain = SlakeCache("slake", 64, cfg.num_hidden_layers)
        assert plain.profile is None and plain.method.alpha == 0.5
        for cache in (SlakeCache("slake", 64, config=cfg), SlakeCache("slake", 64, cfg)):  # as transformers' caches
            assert cache.method.alpha == 1.25 and len(cache.layers) == cfg.num_hidden_layers
        assert SlakeCache("slake[alpha=0.5]", 64, config=cfg).method.alpha == 0.5
    finally:
        del cfg.slake_model_name


def test_find_entry_ignores_other_methods(profile_dir):
    cfg = _config()
    write_entry(model_identity(cfg), _entry(128))
    profiles = load_profiles(model_identity(cfg))
    assert find_entry(profiles, make_method("cake"), 128) is None
    assert find_entry(profiles, make_method("slake"), 128)[1]["values"]["alpha"] == 0.9


def test_the_default_models_shipped_profile_covers_budgets_64_to_2048(profile_dir):
    """The shipped profile of SmolLM2-135M-Instruct has SLAKE entries at 128, 512 and 1024 and CAKE entries at 512 and
    1024 (issue: users run budgets 512-1024), each applying at the nearest calibrated budget on a log scale."""
    cfg = SimpleNamespace(slake_model_name="smollm2", model_type="llama", **SMOLLM2)
    profiles = load_profiles(model_identity(cfg))
    assert profiles and profiles[0][0].endswith("smollm2.json")  # the shipped file (the user folder is empty)
    for name, budget, calibrated in [
        ("slake", 64, 128),
        ("slake", 300, 512),
        ("slake", 700, 512),
        ("slake", 800, 1024),
        ("slake", 2048, 1024),
        ("cake", 256, 512),
        ("cake", 1500, 1024),
    ]:
        found = find_entry(profiles, make_method(name), budget)
        assert found is not None and found[1]["budget"] == calibrated, (name, budget)
    for name, budget in [("slake", 4096), ("cake", 200)]:
        assert find_entry(profiles, make_method(name), budget) is None
    m, applied = resolve_method("slake", 1024, cfg)
    assert applied is not None and (m.alpha, m.beta) == (2.0, 0.7071)


def test_gemma3_270m_ships_a_profile_for_slake_and_cake(profile_dir):
    """Gemma 3 270M (the second packaged model) has a shipped profile: SLAKE and CAKE calibrated at 256 and 1024, found
    under its packaged name and under the hub name ``google/gemma-3-270m`` (the organisation is dropped)."""
    for name in ("gemma3-270m", "google/gemma-3-270m"):
        cfg = SimpleNamespace(slake_model_name=name, model_type="gemma3_text", **GEMMA3_270M)
        profiles = load_profiles(model_identity(cfg))
        assert profiles and profiles[0][0].endswith("gemma3270m.json"), name
        for method, budget, calibrated in [("slake", 200, 256), ("slake", 1500, 1024), ("cake", 300, 256)]:
            found = find_entry(profiles, make_method(method), budget)
            assert found is not None and found[1]["budget"] == calibrated, (name, method, budget)
    wrong = SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 26})  # another Gemma 3 size: not this profile
    assert not load_profiles(model_identity(wrong))


def test_qwen_coder_ships_its_validated_8k_calibration_for_slake(profile_dir):
    """Qwen2.5-Coder-0.5B (the third packaged model) ships the entry of SLAKE's 8K calibration that validated on
    held-out samples (docs/results-qwen.md#calibrating-slake-and-cake-for-this-model): (0, 0) at 128, applied within
    a factor of 2 (64-256). The 512 entry (farther from the full model at 8K and 16K) and CAKE's calibration
    (farther at 256-1024) were left out: those budgets and CAKE keep the papers' values."""
    cfg = SimpleNamespace(slake_model_name="qwen2.5-coder-0.5b", model_type="qwen2", **QWEN_CODER_05B)
    profiles = load_profiles(model_identity(cfg))
    assert profiles and profiles[0][0].endswith("qwen25coder05b.json")
    for budget in (64, 100, 256):
        found = find_entry(profiles, make_method("slake"), budget)
        assert found is not None and found[1]["budget"] == 128, budget
    for budget in (400, 512, 1024):
        assert find_entry(profiles, make_method("slake"), budget) is None, budget
    assert find_entry(profiles, make_method("cake"), 128) is None
    m, applied = resolve_method("slake", 128, cfg)
    assert applied is not None and (m.alpha, m.beta) == (0.0, 0.0)
    m, applied = resolve_method("slake", 512, cfg)
    assert applied is None and (m.alpha, m.beta) == (0.5, 0.4)
    other = SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 28})  # another Qwen2 size: not this profile
    assert not load_profiles(model_identity(other))


@pytest.mark.parametrize("value", ["1", "yes"])
def test_slake_no_profile_skips_user_and_shipped_profiles(profile_dir, monkeypatch, value):
    """SLAKE_NO_PROFILE runs the papers' values on a model with a profile (a shipped one and a user's); "0" or ""
    leaves profiles on."""
    cfg = SimpleNamespace(slake_model_name="qwen2.5-coder-0.5b", model_type="qwen2", **QWEN_CODER_05B)
    ctx = {k: v for k, v in make_method("cake").hyperparameters().items() if k not in ("tau1", "tau2")}
    cake = {"method": "cake", "budget": 128, "values": {"tau1": 2.0, "tau2": 0.5}, "context": ctx}
    write_entry(model_identity(cfg), cake)  # a user profile beside the shipped one
    for off in ("", "0"):
        monkeypatch.setenv("SLAKE_NO_PROFILE", off)
        assert resolve_method("slake", 128, cfg)[1] is not None and resolve_method("cake", 128, cfg)[1] is not None
    monkeypatch.setenv("SLAKE_NO_PROFILE", value)
    assert load_profiles(model_identity(cfg)) == []
    m, applied = resolve_method("slake", 128, cfg)
    assert applied is None and (m.alpha, m.beta) == (0.5, 0.4)
    m, applied = resolve_method("cake", 128, cfg)
    assert applied is None and (m.tau1, m.tau2) == (1.0, 1.0)


def test_a_model_without_profile_or_paper_values_is_told_once_that_it_runs_on_the_defaults(profile_dir, caplog):
    """SLAKE's defaults are Llama-2-7B's (0.5, 0.4); a model with neither a calibrated profile nor paper values used
    to get them silently. One warning per model and method, naming ``slake calibrate``; none with a profile, none
    when the user set the values, none without a model."""
    import logging

    from slake.methods import profiles

    profiles._TOLD_DEFAULTS.clear()
    caplog.set_level(logging.WARNING, logger="slake")
    cfg = _config("my-org/Unprofiled-1B")
    resolve_method("slake", 128, cfg)
    resolve_method("slake", 128, cfg)
    told = [r.getMessage() for r in caplog.records if "calibrate" in r.getMessage()]
    assert len(told) == 1 and "Unprofiled" in told[0] and "alpha=0.5, beta=0.4" in told[0]
    assert "at budget 128" in told[0]
    caplog.clear()
    resolve_method("slake[alpha=0.3,beta=0.2]", 128, _config("my-org/Other-1B"))  # the user chose
    resolve_method("slake", 128)  # no model
    profiled = _config("my-org/Profiled-1B")
    write_entry(model_identity(profiled), _entry(128, 0.9, 0.1))
    resolve_method("slake", 128, profiled)
    assert not [r for r in caplog.records if "calibrate" in r.getMessage()]
    resolve_method("slake", 0.25, _config("my-org/Ratio-1B"))
    assert "a ratio budget has no paper values" in caplog.records[-1].getMessage()


def test_the_defaults_warning_names_each_budget_and_variant_that_runs_on_them(profile_dir, caplog):
    """A profile covers some budgets of a model: the one warning per model and method said "at this budget" for the
    first budget without an entry, and every later budget or variant of the method ran on the defaults without a
    word (``slake eval --budgets 64,...,4096`` could not tell which). Now one per (model, spec, budget), naming them;
    none inside :func:`defaults_untold` (``slake calibrate``'s "before" point)."""
    import logging

    from slake.methods import profiles
    from slake.methods.profiles import defaults_untold

    profiles._TOLD_DEFAULTS.clear()
    caplog.set_level(logging.WARNING, logger="slake")
    profiled = _config("my-org/Partly-1B")
    write_entry(model_identity(profiled), _entry(128, 0.9, 0.1))
    with defaults_untold():
        assert resolve_method("slake", 8192, profiled)[1] is None
    assert not caplog.records
    for method, budget in (("slake", 128), ("slake", 8192), ("slake", 0.5), ("slake[vabs_split=uniform]", 8192)):
        resolve_method(method, budget, profiled)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 3, told
    assert "slake at budget 8192" in told[0] and "ratio 0.5" in told[1] and "slake[vabs_split=uniform]" in told[2]


def test_with_profiles_off_the_defaults_warning_says_so(profile_dir, caplog, monkeypatch):
    """With ``SLAKE_NO_PROFILE=1`` a model whose profile exists runs on the defaults because the user turned the
    profiles off: the warning said it had no calibrated profile and asked for ``slake calibrate``."""
    import logging

    from slake.methods import profiles

    profiles._TOLD_DEFAULTS.clear()
    caplog.set_level(logging.WARNING, logger="slake")
    profiled = _config("my-org/Profiled-2B")
    write_entry(model_identity(profiled), _entry(128, 0.9, 0.1))
    monkeypatch.setenv("SLAKE_NO_PROFILE", "1")
    m, applied = resolve_method("slake", 128, profiled)
    assert applied is None and (m.alpha, m.beta) == (0.5, 0.4)
    told = [r.getMessage() for r in caplog.records if "Profiled-2B" in r.getMessage()]
    assert len(told) == 1 and "SLAKE_NO_PROFILE" in told[0] and "calibrate" not in told[0], told


def test_a_value_the_user_set_is_never_replaced_by_the_papers(profile_dir):
    """On a paper's model, setting one of the pair kept the paper's value for both: ``cake[tau1=0.5]`` on
    Llama-3.1-8B at 128 ran tau1 = 1.6, ``slake[alpha=0.9]`` alpha = 0.4. The other one still comes from the paper."""
    llama31 = _config("meta-llama/Llama-3.1-8B-Instruct")
    m, applied = resolve_method("cake[tau1=0.5]", 128, llama31)
    assert (m.tau1, m.tau2) == (0.5, 0.6) and applied["values"] == {"tau2": 0.6}
    m, applied = resolve_method("cake", 128, llama31, tau2=3.0)
    assert (m.tau1, m.tau2) == (1.6, 3.0) and applied["values"] == {"tau1": 1.6}
    m, applied = resolve_method("slake[alpha=0.9]", 128, llama31)
    assert (m.alpha, m.beta) == (0.9, 0.2) and applied["source"] == "paper"
    assert resolve_method("slake[alpha=0.9,beta=0.1]", 128, llama31)[1] is None


def test_the_defaults_warning_names_the_variant_run_and_the_entry_it_misses(profile_dir, caplog):
    """``slake generate --method slake --no-linear-cache`` on the default model said "smollm2 has no calibrated
    profile for slake at budget 128": it has one, for the linear cache on, and the variant that ran (the linear cache
    off, passed beside the spec) was not named. Now the variant is named, and the entry's differing values."""
    import logging

    from slake.methods import profiles

    profiles._TOLD_DEFAULTS.clear()
    caplog.set_level(logging.WARNING, logger="slake")
    profiled = _config("my-org/Variant-1B")
    write_entry(model_identity(profiled), _entry(128, 0.9, 0.1))  # calibrated with the linear cache on
    m, applied = resolve_method("slake", 128, profiled, linear_cache=False)
    assert applied is None and (m.alpha, m.linear_cache) == (0.5, False)
    resolve_method("slake[vabs_split=uniform]", 128, profiled, window=16)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2, told
    assert "for slake[linear_cache=false] at budget 128" in told[0]
    assert "calibrated with linear_cache=true and applies only to that variant" in told[0]
    assert "for slake[vabs_split=uniform,window=16] at budget 128" in told[1]
    assert 'calibrated with vabs_split="taylor", window=32' in told[1]
    caplog.clear()
    resolve_method("slake", 8192, profiled, linear_cache=False)  # no entry near this budget: nothing to point at
    assert "applies only to that variant" not in caplog.records[-1].getMessage()


def test_slake_without_vabs_is_not_told_to_calibrate_alpha_and_beta(profile_dir, caplog):
    """``slake[vabs=false]`` splits its layers' budgets by CAKE's preference and reads no alpha or beta: a model
    without a profile was warned that it "runs on its defaults (alpha=0.5, beta=0.4)" and that ``slake calibrate``
    fits them, which calibrate refuses for that variant. No warning, no profile values; SLAKE with VABS still told."""
    import logging

    from slake.methods import profiles

    profiles._TOLD_DEFAULTS.clear()
    caplog.set_level(logging.WARNING, logger="slake")
    cfg = _config("my-org/Unprofiled-2B")
    m, applied = resolve_method("slake[vabs=false]", 128, cfg)
    assert applied is None and not m.vabs
    assert not [r for r in caplog.records if "calibrate" in r.getMessage()]
    resolve_method("slake", 128, cfg)
    assert [r for r in caplog.records if "calibrate" in r.getMessage()]
