"""Hyperparameter validation: overrides on a built Method, optional (None-default) hyperparameters, options a method
cannot use, integer domains, and numpy scalars as budgets."""

from __future__ import annotations

import numpy as np
import pytest

from slake.budgets.budget import Budget
from slake.methods import make_method
from slake.methods.profiles import resolve_method


# ====================================================================== overrides given with a Method object
def test_overrides_on_a_method_object_are_parsed_like_a_spec():
    built, profile = resolve_method(make_method("slake"), 64, None, vabs=False, window=16)
    assert profile is None
    assert built == make_method("slake[vabs=false,window=16]")
    alpha = resolve_method(make_method("slake"), 64, None, alpha=1)[0].alpha
    assert isinstance(alpha, float) and alpha == 1.0  # an integer for a float, converted as a spec does


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"vabs": "false"}, "vabs must be true or false"),
        ({"linear_cache": "false"}, "linear_cache must be true or false"),
        ({"window": "8"}, "window must be an integer"),
        ({"alpha": "high"}, "alpha must be a number"),
        ({"bogus": 1}, "has no hyperparameter bogus; it has: .*vabs"),
        ({"max_layer_budget": "abc"}, "max_layer_budget must be an integer or null"),
    ],
)
def test_overrides_on_a_method_object_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(make_method("slake"), 64, None, **overrides)


def test_slake_cache_validates_overrides_on_a_method_object():
    from slake import SlakeCache

    with pytest.raises(ValueError, match="linear_cache must be true or false"):
        SlakeCache(make_method("slake"), 64, 2, linear_cache="false")
    with pytest.raises(ValueError, match="has no hyperparameter bogus"):
        SlakeCache(make_method("slake"), 64, 2, bogus=1)
    assert SlakeCache(make_method("slake"), 64, 2, vabs=False).method == make_method("slake[vabs=false]")


# ====================================================================== hyperparameters whose default is None
@pytest.mark.parametrize(
    "spec, message",
    [
        ("slake[max_layer_budget=abc]", "max_layer_budget must be an integer or null"),
        ("slake[max_layer_budget=1.5]", "max_layer_budget must be an integer or null"),
        ("slake[max_layer_budget=true]", "max_layer_budget must be an integer or null"),
        ("slake[budget_hint=abc]", "budget_hint must be an integer or null"),
        ("cake[max_layer_budget=abc]", "max_layer_budget must be an integer or null"),
        ("sagekv[k=abc]", "k must be an integer or null"),
        ("sagekv[k=1.5]", "k must be an integer or null"),
        ("sagekv[k=true]", "k must be an integer or null"),
        ("lava[gqa=1]", "gqa must be a string"),
    ],
)
def test_optional_and_string_hyperparameters_are_type_checked(spec, message):
    with pytest.raises(ValueError, match=message):
        make_method(spec)


def test_optional_hyperparameters_accept_integers_and_null():
    assert make_method("sagekv[k=3]").k == 3
    assert make_method("sagekv[k=null]").k is None
    assert make_method("slake[max_layer_budget=100,budget_hint=64]").max_layer_budget == 100
    assert make_method("sagekv", k=np.int64(3)).k == 3 and type(make_method("sagekv", k=np.int64(3)).k) is int


def test_cli_refuses_a_mistyped_optional_hyperparameter_with_one_line(capsys):
    from slake.cli import main

    assert main(["generate", "--prompt", "hello there", "--method", "slake[max_layer_budget=abc]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_layer_budget must be an integer or null" in err[0], err


# ====================================================================== options a method cannot use; integer domains
@pytest.mark.parametrize(
    "spec", ["full[linear_cache=true]", "full[window=8]", "full[sinks=4]", "full[decode_eviction=true]"]
)
def test_full_refuses_options_that_cannot_apply(spec):
    with pytest.raises(ValueError, match="full keeps every token"):
        make_method(spec)


def test_full_accepts_its_own_defaults():
    assert make_method("full[linear_cache=false,window=0]") == make_method("full")


@pytest.mark.parametrize("spec", ["h2o[chunk=0]", "h2o[chunk=-1]"])
def test_h2o_chunk_must_be_positive(spec):
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        make_method(spec)


# ====================================================================== numpy scalars as budgets
def test_budget_accepts_numpy_integers_and_floats_alike():
    b = Budget(np.int64(64))
    assert b.value == 64 and type(b.value) is int and not b.is_ratio
    r = Budget(np.float32(0.5))
    assert r.value == 0.5 and type(r.value) is float and r.is_ratio
    assert type(Budget(np.float64(0.5)).value) is float
    assert Budget(np.float64(64.0)).value == 64 and type(Budget(np.float64(64.0)).value) is int
    for bad in (True, np.bool_(True), np.int64(0)):
        with pytest.raises(ValueError):
            Budget(bad)


def test_fidelity_refuses_a_forced_linear_cache_on_full_before_loading(capsys, monkeypatch):
    import slake.engines.transformers.models
    from slake.cli import main

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were validated")

    monkeypatch.setattr(slake.engines.transformers.models, "load_model", refuse)
    assert main(["fidelity", "--methods", "full,snapkv", "--budgets", "64", "--linear-cache", "on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "full keeps every token" in err[0], err
