"""The plugin's configuration and start-up checks (no engine)."""

from __future__ import annotations

import pytest

from slake.engines.vllm.plugin.config import ENV_VAR, SUPPORTED_METHODS, parse_config


def test_no_configuration_means_no_plugin(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert parse_config({}) is None
    assert parse_config({"other_plugin": {"x": 1}}) is None


def test_additional_config_wins_over_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, '{"method": "h2o", "budget": 256}')
    cfg = parse_config({"slake": {"method": "snapkv", "budget": 128, "set": {"window": 16}}})
    assert cfg.method.name == "snapkv" and cfg.budget == 128 and cfg.method.window == 16
    env = parse_config({})
    assert env.method.name == "h2o" and env.budget == 256


def test_blocks_and_slots():
    cfg = parse_config({"slake": {"method": "snapkv", "budget": 128}})
    assert cfg.slots() == 129 and cfg.slots(4000) == 129
    assert cfg.blocks(32) == 5 and cfg.blocks(128) == 2
    assert cfg.compresses(129) and not cfg.compresses(128)


def test_preference_methods_get_a_layer_cap_and_hold_its_slots():
    """CAKE/SLAKE layers keep up to max_layer_budget tokens (2x the budget unless set), at most the prompt."""
    cfg = parse_config({"slake": {"method": "slake", "budget": 128}})
    assert cfg.method.max_layer_budget == 256 and cfg.method.linear_cache
    assert cfg.slots() == 257 and cfg.blocks(32, 4000) == 9
    assert cfg.slots(200) == 201 and cfg.blocks(32, 192) == 7  # a 192-token prompt may keep all 192, plus the new
    cfg = parse_config({"slake": {"method": "cake", "budget": 128, "set": {"max_layer_budget": 160}}})
    assert cfg.method.max_layer_budget == 160 and cfg.blocks(32, 4000) == 6


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"method": "pyramidkv", "budget": 128}, "not supported by the vLLM plugin"),
        ({"method": "ada-snapkv", "budget": 128}, "not supported by the vLLM plugin"),
        ({"method": "kvzip", "budget": 128}, "second pass (reconstruction)"),
        ({"method": "ada-criticalkv", "budget": 128}, "per-head budgets"),
        ({"method": "ada-expected-attention", "budget": 128}, "per-head budgets"),
        ({"method": "keydiff[linear_cache=true]", "budget": 128}, "linear_cache"),
        ({"method": "cake[max_layer_budget=100]", "budget": 128}, "is below the average budget"),
        ({"method": "slake[max_layer_budget=100]", "budget": 128}, "max_layer_budget >= the budget"),
        # a "set" that is not an object, falsy or not, was taken for no overrides (2026-11-30)
        ({"method": "snapkv", "budget": 128, "set": []}, '"set" must be an object'),
        ({"method": "snapkv", "budget": 128, "set": ""}, '"set" must be an object'),
        ({"method": "snapkv", "budget": 128, "set": False}, '"set" must be an object'),
        ({"method": ["snapkv"], "budget": 128}, '"method" must be a string'),
        ({"method": "slake[decode_eviction=false]", "budget": 128}, "decode_eviction=false"),
        ({"method": "snapkv", "budget": 0.25}, "absolute budget"),
        ({"method": "snapkv", "budget": 16}, "exceed the budget"),
        ({"method": "snapkv[decode_eviction=false]", "budget": 128}, "decode_eviction=false"),
        ({"method": "snapkv[linear_cache=true]", "budget": 128}, "linear_cache"),
        ({"method": "snapkv"}, 'needs "method" and "budget"'),
        ({"method": "snapkv", "budget": 128, "ratio": 2}, "unknown configuration key"),
        ({"method": "nosuch", "budget": 128}, "unknown method"),
    ],
)
def test_what_the_plugin_cannot_honour_fails_with_one_line(raw, message):
    with pytest.raises(ValueError, match="^slake: ") as exc:
        parse_config({"slake": raw})
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_bad_environment_json(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "snapkv:128")
    with pytest.raises(ValueError, match=ENV_VAR):
        parse_config({})


def test_supported_methods_are_registered():
    from slake.methods import available_methods

    assert set(SUPPORTED_METHODS) <= set(available_methods())
