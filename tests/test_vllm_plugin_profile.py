"""The vLLM plugin applies the model's profile itself, from the config of the model vLLM loads, so that ``vllm serve
--additional-config '{"slake": {"method": "slake", "budget": 128}}'`` runs the method as ``slake generate`` does, and
``set`` still overrides it (no vLLM needed: :mod:`slake.engines.vllm.plugin.config` imports none)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from packaged_shapes import SMOLLM2
from slake.budgets.budget import Budget
from slake.engines.vllm.plugin.config import parse_config, plugin_config
from slake.methods import make_method
from slake.methods.profiles import resolve_method

#: the shipped profile's SLAKE entry for the default model at budget 128
SHIPPED = {"alpha": 1.4142, "beta": 0.0}


@pytest.fixture(autouse=True)
def no_user_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path / "no-user-profiles"))


def converted_default_model() -> LlamaConfig:
    """The config vLLM loads from the converted default model (``slake.engines.vllm.converted.local_model_dir``): the
    default model's architecture, named ``smollm2`` in its ``config.json`` as :func:`slake.load_model` names it."""
    config = LlamaConfig(**SMOLLM2)
    config.slake_model_name = "smollm2"
    return config


def test_a_bare_configuration_gets_the_models_profile():
    cfg = parse_config({"slake": {"method": "slake", "budget": 128}}, converted_default_model())
    assert cfg is not None and cfg.profile is not None
    assert cfg.profile["values"] == SHIPPED and cfg.profile["source"].endswith("smollm2.json")
    assert (cfg.method.alpha, cfg.method.beta) == (1.4142, 0.0)
    assert cfg.method.max_layer_budget == 256  # vLLM's layer cap, as without a profile
    assert "smollm2.json" in cfg.describe_profile() and "alpha=1.4142" in cfg.describe_profile()
    # exactly what the transformers engine resolves for the same model, method and budget (and vLLM's cap)
    hf, profile = resolve_method("slake", Budget(128), converted_default_model(), max_layer_budget=256)
    assert cfg.method == hf and cfg.profile == profile


def test_the_profile_is_found_by_the_hub_name_too():
    config = LlamaConfig(**SMOLLM2, name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = parse_config({"slake": {"method": "slake", "budget": 128}}, config)
    assert cfg is not None and cfg.profile is not None and cfg.profile["values"] == SHIPPED


def test_set_and_the_spec_override_the_profile():
    model = converted_default_model()
    cfg = parse_config({"slake": {"method": "slake", "budget": 128, "set": {"alpha": 0.5}}}, model)
    assert cfg is not None and (cfg.method.alpha, cfg.method.beta) == (0.5, 0.0)  # beta still the profile's
    assert cfg.profile is not None and cfg.profile["values"] == {"beta": 0.0}
    cfg = parse_config({"slake": {"method": "slake[alpha=0.5,beta=2.0]", "budget": 128}}, model)
    assert cfg is not None and (cfg.method.alpha, cfg.method.beta) == (0.5, 2.0) and cfg.profile is None


def test_no_profile_without_a_model_or_for_another_model():
    defaults = make_method("slake")
    for model in (None, LlamaConfig(**SMOLLM2, name_or_path="some-other-model")):
        cfg = parse_config({"slake": {"method": "slake", "budget": 128}}, model)
        assert cfg is not None and cfg.profile is None
        assert (cfg.method.alpha, cfg.method.beta) == (defaults.alpha, defaults.beta)
        assert cfg.describe_profile().startswith("no profile entry applies")
    cfg = parse_config({"slake": {"method": "snapkv", "budget": 128}}, converted_default_model())
    assert cfg is not None and cfg.profile is None  # no profile for a method without tuned exponents


def test_drivers_pass_what_the_user_set_and_nothing_of_the_profile():
    b = Budget(128)
    assert plugin_config("slake", b) == {"method": "slake", "budget": 128}
    assert plugin_config("slake[beta=1.0]", b, alpha=0.5) == {
        "method": "slake[beta=1.0]",
        "budget": 128,
        "set": {"alpha": 0.5},
    }
    assert plugin_config("full", b) is None and plugin_config(make_method("full"), b) is None
    built = make_method("cake", tau1=2.0)  # a built method is used exactly as given: every hyperparameter is set
    cfg = plugin_config(built, b)
    assert cfg is not None and cfg["set"] == built.hyperparameters()
    parsed = parse_config({"slake": cfg}, converted_default_model())
    assert parsed is not None and parsed.profile is None and parsed.method.tau1 == 2.0
