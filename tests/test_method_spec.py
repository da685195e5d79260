"""Method specs (``slake[vabs=false]``): parsing, canonical form and validation in make_method."""

from __future__ import annotations

import pytest

from slake.methods import format_method_spec, make_method, parse_method_spec, split_method_list


def test_split_ignores_commas_inside_brackets():
    assert split_method_list("snapkv, slake[vabs=false,window=16] ,h2o") == [
        "snapkv",
        "slake[vabs=false,window=16]",
        "h2o",
    ]
    assert split_method_list(" , ") == []
    for bad in ("slake[vabs=false", "slake]", "a[b=[1]"):
        with pytest.raises(ValueError, match="unbalanced"):
            split_method_list(bad)


def test_parse_reads_json_literals_and_strings():
    assert parse_method_spec("SnapKV") == ("snapkv", {})
    name, over = parse_method_spec("slake[vabs=False, alpha=0.25,window=16,budget_hint=null,pooling=max]")
    assert name == "slake"
    assert over == {"vabs": False, "alpha": 0.25, "window": 16, "budget_hint": None, "pooling": "max"}
    for bad in (
        "[vabs=false]",
        "slake[vabs]",
        "slake[vabs=false]x",
        "slake[=1]",
        "slake[a=1,a=2]",
        "slake=1",
        "slake[a=[1]]",
    ):
        with pytest.raises(ValueError):
            parse_method_spec(bad)


def test_format_is_canonical_and_round_trips():
    spec = format_method_spec("SLAKE", {"window": 16, "vabs": False, "pooling": "max", "alpha": 0.5})
    assert spec == "slake[alpha=0.5,pooling=max,vabs=false,window=16]"
    assert parse_method_spec(spec) == ("slake", {"alpha": 0.5, "pooling": "max", "vabs": False, "window": 16})
    assert format_method_spec("snapkv", {}) == "snapkv"


def test_make_method_accepts_specs():
    m = make_method("slake[vabs=false,window=16]")
    assert (m.name, m.vabs, m.window, m.linear_cache) == ("slake", False, 16, True)
    m = make_method("snapkv[linear_cache=true]", window=8)
    assert (m.linear_cache, m.window) == (True, 8)
    alpha = make_method("slake[alpha=1]").alpha
    assert isinstance(alpha, float) and alpha == 1.0
    assert repr(make_method("slake[vabs=false]")) != repr(make_method("slake"))  # prefill-once memo key


@pytest.mark.parametrize(
    "spec, message",
    [
        ("slake[nope=1]", "has no hyperparameter nope"),
        ("slake[vabs=1]", "must be true or false"),
        ("slake[window=1.5]", "must be an integer"),
        ("slake[window=true]", "must be an integer"),
        ("slake[alpha=high]", "must be a number"),
        ("nope[window=1]", "unknown method 'nope'"),
    ],
)
def test_make_method_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        make_method(spec)


def test_override_may_not_repeat_a_spec_key():
    with pytest.raises(ValueError, match="set both"):
        make_method("snapkv[window=8]", window=16)


def test_canonical_spec_comes_from_the_built_method():
    from slake.methods import canonical_method_spec

    assert canonical_method_spec("SLAKE[alpha=1, VABS=False]") == canonical_method_spec("slake[vabs=false,alpha=1.0]")
    assert canonical_method_spec("slake[alpha=1]") == "slake[alpha=1.0]"
    assert canonical_method_spec("snapkv[linear_cache=true,window=8]", drop=("linear_cache",)) == "snapkv[window=8]"


def test_plain_overrides_are_type_checked_like_spec_values():
    with pytest.raises(ValueError, match="must be true or false"):
        make_method("slake", vabs=1)
    assert isinstance(make_method("cake", gamma=100).gamma, float)


def test_method_lists_are_validated_before_any_model_work():
    from slake.methods import parse_method_list

    assert parse_method_list("snapkv,slake[vabs=false,window=16]") == ["snapkv", "slake[vabs=false,window=16]"]
    for bad, msg in ((" , ", "expected a comma-separated list"), ("snapkv,slake[nope=1]", "has no hyperparameter")):
        with pytest.raises(ValueError, match=msg):
            parse_method_list(bad)
