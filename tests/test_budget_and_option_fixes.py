"""Budgets keep what they say (a ratio rounded on its decimal value, no layer emptied by PyramidKV's schedule), and
options are refused before anything loads (fidelity's output-level length, an engine's option given as 0)."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest

import slake
from slake.budgets import pyramid_budgets
from slake.budgets.budget import Budget
from slake.cli import main
from slake.engines.base import Engine
from slake.engines.transformers import models
from slake.methods.base import make_method
from tiny_models import tiny_model, word_tokenizer


def test_a_ratio_budget_is_the_ratio_as_written_rounded_up():
    assert Budget(0.07).tokens(100) == 7  # before: 8 (0.07 * 100 = 7.000000000000001)
    assert Budget(0.56).tokens(100) == 56  # before: 57
    for hundredths in range(1, 100):
        ratio = hundredths / 100
        for n in (1, 7, 100, 300, 8192):
            assert Budget(ratio).tokens(n) == max(1, math.ceil(Fraction(hundredths, 100) * n)), (ratio, n)
    assert Budget(1 / 3).tokens(300) == 100  # 0.3333333333333333 * 300 is just below 100
    assert Budget(0.5).tokens(1) == 1


def test_a_ratio_budget_keeps_its_tokens_end_to_end():
    model = tiny_model("llama-gqa", layers=2)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(100))
    res = slake.generate(
        model, word_tokenizer(), prompt, method="snapkv", budget=0.07, window=4, max_new_tokens=1, chat_template=False
    )
    assert res.kept_tokens_per_layer == [7.0, 7.0]  # before: [8.0, 8.0]


@pytest.mark.parametrize("exact", [True, False])
def test_the_pyramid_floor_keeps_the_sum_and_raises_the_emptied_layers(exact):
    plain = pyramid_budgets(5, 16, 300, 0, exact=exact)
    floored = pyramid_budgets(5, 16, 300, 0, exact=exact, min_layer=1)
    assert int(plain.min()) == 0  # C' < beta: the deepest layer's share rounds to 0
    assert int(floored.min()) >= 1 and int(floored.sum()) == int(plain.sum())
    assert floored.tolist() == sorted(floored.tolist(), reverse=True)  # still a pyramid
    assert (
        pyramid_budgets(5, 100, 3000, 0, exact=exact, min_layer=1).tolist()
        == pyramid_budgets(5, 100, 3000, 0, exact=exact).tolist()
    )  # no layer short: unchanged


@pytest.mark.parametrize("name", ["pyramidkv", "ada-pyramidkv"])
def test_pyramidkv_without_protected_tokens_never_empties_a_layer(name):
    m = make_method(name, window=0)
    assert m.protected == 0
    budgets = m.pyramid_schedule(4, 16, 300)
    assert int(budgets.min()) >= 1 and int(budgets.sum()) >= 4 * 16  # before: [32, 21, 11, 0]
    # with a window the deepest layer keeps its window: the reference's schedule is untouched
    assert (
        make_method(name, window=8).pyramid_schedule(4, 16, 300).tolist()
        == pyramid_budgets(4, 16, 300, 8, exact=True, snapkv_fallback=name == "pyramidkv").tolist()
    )


def test_pyramidkv_window_0_keeps_a_token_in_every_layer_end_to_end():
    model = tiny_model("llama-gqa", layers=4)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(300))
    res = slake.generate(
        model, word_tokenizer(), prompt, method="pyramidkv[window=0]", budget=16, max_new_tokens=1, chat_template=False
    )
    assert min(res.kept_tokens_per_layer) >= 1  # before: the last layer 0


def _refuse_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)


def test_fidelity_refuses_an_output_level_length_it_cannot_use_before_the_model_loads(monkeypatch, capsys, tmp_path):
    _refuse_load(monkeypatch)
    prompt = tmp_path / "p.txt"
    prompt.write_text("a prompt of a few words.", encoding="utf-8")
    base = ["fidelity", "--methods", "snapkv", "--budgets", "40"]
    for extra in (["--length", "40"], ["--length", "0", "--prompt-file", str(prompt)]):
        assert main([*base, *extra]) == 2  # before: accepted, refused after the model and the attention level ran
        assert "--length must be >= 64" in capsys.readouterr().err
    for extra in (["--output-tokens", "1"], ["--output-samples", "0"]):
        assert main([*base, *extra]) == 2
        assert "--output-tokens must be 0" in capsys.readouterr().err


def test_an_unsupported_option_given_as_0_is_refused():
    engine = SimpleNamespace(
        name="nochunks",
        unsupported={"prefill_chunk": "it prefills each prompt whole", "threads": "its own threads"},
        check_environment=lambda: None,
    )
    Engine.check(engine, prefill_chunk=None, threads=False)
    Engine.check(engine, prefill_chunk="auto")
    for value in (16, 0):  # before: 0 == False, taken for "not given"
        with pytest.raises(ValueError, match="--prefill-chunk"):
            Engine.check(engine, prefill_chunk=value)
    with pytest.raises(ValueError, match="--threads"):
        Engine.check(engine, threads=0)


@pytest.mark.parametrize("name", ["pyramidkv", "ada-pyramidkv"])
def test_pyramidkv_with_sinks_caps_a_layer_at_its_candidates(name):
    """With sinks, the top layer's cap is the prompt less every protected token: capped at S - window, it was
    given the sinks' share, which the engine clipped and no other layer received (792 of 800 tokens kept)."""
    m = make_method(name, sinks=4)  # window 32: 36 protected
    budgets = m.pyramid_schedule(4, 64, 130)
    assert int(budgets.max()) <= 130 - 36 and int(budgets.sum()) == 4 * 64
    assert make_method(name).pyramid_schedule(4, 64, 130).tolist() == [98, 75, 53, 30]  # without sinks: unchanged
