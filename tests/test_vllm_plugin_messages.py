"""What the vLLM plugin logs at start-up about the model's profile (:meth:`SlakeVllmConfig.describe_profile`, logged by
the scheduler and the attention backend and kept in serve-bench rows' ``plugin_log``) says why no profile applied:
profiles turned off, or every searched hyperparameter set by the configuration, rather than "no profile entry applies
to this model" for a model that has one. No vLLM needed (:mod:`slake.engines.vllm.plugin.config` imports none)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from packaged_shapes import SMOLLM2
from slake.engines.vllm.plugin.config import SlakeVllmConfig, parse_config

NO_ENTRY = "no profile entry applies to this model: the method's own values"


@pytest.fixture(autouse=True)
def no_user_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path / "no-user-profiles"))
    monkeypatch.delenv("SLAKE_NO_PROFILE", raising=False)


def default_model() -> LlamaConfig:
    """The config vLLM loads from the converted default model, which ships a SLAKE profile at budget 128."""
    config = LlamaConfig(**SMOLLM2)
    config.slake_model_name = "smollm2"
    return config


def described(raw: dict, model=None) -> str:
    cfg = parse_config({"slake": raw}, default_model() if model is None else model)
    assert isinstance(cfg, SlakeVllmConfig)
    return cfg.describe_profile()


def test_profiles_turned_off_are_named(monkeypatch):
    """``SLAKE_NO_PROFILE=1`` on a model that ships a profile: the profiles are off, not missing."""
    assert described({"method": "slake", "budget": 128}).startswith("profile shipped:")  # the model has one
    monkeypatch.setenv("SLAKE_NO_PROFILE", "1")
    line = described({"method": "slake", "budget": 128})
    assert line.startswith("profiles are off (SLAKE_NO_PROFILE is set)"), line
    assert "no profile entry applies" not in line and "the method's own values" in line
    assert described({"method": "cake", "budget": 128}).startswith("profiles are off")


@pytest.mark.parametrize(
    "raw",
    [
        {"method": "slake[alpha=0.3,beta=0.1]", "budget": 128},
        {"method": "slake", "budget": 128, "set": {"alpha": 0.3, "beta": 0.1}},
        {"method": "slake[alpha=0.3]", "budget": 128, "set": {"beta": 0.1}},
    ],
)
def test_values_the_configuration_sets_are_named(raw, monkeypatch):
    """Every searched hyperparameter set in the spec or ``set``: the values are the user's, not the method's."""
    line = described(raw)
    assert line.startswith("the configuration sets alpha=0.3, beta=0.1 itself"), line
    assert "no profile entry applies" not in line and "the method's own values" not in line
    monkeypatch.setenv("SLAKE_NO_PROFILE", "1")  # what the user set wins over the reason no profile was read
    assert described(raw) == line


def test_partly_set_values_are_named_without_a_profile(monkeypatch):
    """Without a profile, a searched hyperparameter the configuration sets is not called the method's own."""
    monkeypatch.setenv("SLAKE_NO_PROFILE", "1")
    line = described({"method": "slake[alpha=0.3]", "budget": 128})
    assert line.startswith("profiles are off (SLAKE_NO_PROFILE is set): the method's own values"), line
    assert "alpha=0.3" in line and "set by the configuration" in line
    # with the profile on, the profile gives what the configuration left unset (unchanged wording)
    monkeypatch.delenv("SLAKE_NO_PROFILE")
    assert described({"method": "slake[alpha=0.3]", "budget": 128}).endswith("(entry at budget 128): beta=0.0")


def test_wording_kept_where_no_profile_exists(monkeypatch):
    """A model without a profile, no model at all, or a method without searched hyperparameters: unchanged."""
    other = LlamaConfig(**SMOLLM2, name_or_path="some-other-model")
    assert described({"method": "slake", "budget": 128}, other) == NO_ENTRY
    assert parse_config({"slake": {"method": "slake", "budget": 128}}).describe_profile() == NO_ENTRY
    assert described({"method": "snapkv", "budget": 128, "set": {"window": 16}}) == NO_ENTRY
    monkeypatch.setenv("SLAKE_NO_PROFILE", "1")  # no model: no profile was looked for, whatever the variable says
    assert parse_config({"slake": {"method": "slake", "budget": 128}}).describe_profile() == NO_ENTRY
