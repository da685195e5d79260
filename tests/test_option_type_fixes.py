"""Options given out of range or of the wrong type (2026-11-30 audit of every method's and engine's options):

* ``ada-criticalkv[epsilon=1e36]`` kept about twice its budget: ``(base + epsilon) * norm`` passed the score marks
  of the first stage and of a kept pair; plain ``criticalkv`` lost its first stage;
* ``sagekv[k=2**63-1]`` passed its room check (``G*k`` wrapped around in int64) and a k past int64 overflowed;
* ``slake.generate`` and ``SlakeCache`` read ``"false"`` as true for their flags, truncated ``prefill_chunk=2.5``
  and failed in a bare ``TypeError`` for a string count;
* ``--set linear_cache=false --linear-cache``: the flag silently won;
* ``cake[max_layer_budget=16]`` at budget 24 was refused only after the model loaded; a charged linear state that
  left no slot ran with nothing kept, and its refusal spoke of "a budget of -1 tokens"."""

from __future__ import annotations

import argparse

import pytest

import slake
from slake.cli.options import method_overrides
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from slake.methods import make_method
from slake.methods.budget_check import check_method_budget
from tiny_models import random_ids, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


def _prompt(n: int = 48) -> str:
    return " ".join(f"w{i}" for i in random_ids(n, seed=1)[0].tolist())


@pytest.mark.parametrize("method", ["criticalkv", "ada-criticalkv"])
@pytest.mark.parametrize("epsilon", [1e6 * (1 + 1e-9), 1e36, 3e38])
def test_an_epsilon_that_would_outrank_the_first_stage_is_refused(method, epsilon):
    with pytest.raises(ValueError, match=r"epsilon <= 1e\+06"):
        make_method(f"{method}[epsilon={epsilon!r}]")


def test_the_largest_epsilon_keeps_the_budget(model):
    res = slake.generate(model, word_tokenizer(), _prompt(), method="ada-criticalkv[window=8,epsilon=1e6]",
                         budget=24, max_new_tokens=2, chat_template=False)  # fmt: skip
    assert res.compressed and max(res.kept_tokens_per_layer) <= 24


@pytest.mark.parametrize("k", [13, 2**62, 2**63 - 1, 10**20])
def test_a_sagekv_k_beyond_the_budget_is_refused_with_the_k_given(model, k):
    with pytest.raises(ValueError, match=rf"G\*k \[{2 * k}\] leave no room"):
        slake.generate(model, word_tokenizer(), _prompt(), method=f"sagekv[k={k}]", budget=24, max_new_tokens=1,
                       chat_template=False)  # fmt: skip


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("charge_linear_state", "false", "charge_linear_state must be True or False"),
        ("compile", "false", "compile must be True or False"),
        ("do_sample", 1, "do_sample must be True or False"),
        ("chat_template", None, "chat_template must be True or False"),
        ("allow_long_context", "no", "allow_long_context must be True or False"),
        ("prefill_chunk", 2.5, "prefill_chunk must be an integer"),
        ("prefill_chunk", "4", "prefill_chunk must be an integer"),
        ("prefill_chunk", float("nan"), "prefill_chunk must be an integer"),
        ("prefill_chunk", 0, "prefill_chunk must be >= 1"),
        ("max_new_tokens", "3", "max_new_tokens must be an integer"),
        ("max_new_tokens", None, "max_new_tokens must be an integer"),
        ("max_new_tokens", 1.5, "max_new_tokens must be an integer"),
        ("max_new_tokens", True, "max_new_tokens must be an integer"),
    ],
)
def test_slake_generate_refuses_an_option_it_would_misread(model, option, value, message):
    with pytest.raises(ValueError, match=message):
        slake.generate(model, word_tokenizer(), _prompt(), method="snapkv[window=8]", budget=24,
                       **{"max_new_tokens": 2, "chat_template": False, option: value})  # fmt: skip


SAMPLING = [
    ("top_k", -1, "top_k must be >= 0"),
    ("seed", "x", "seed must be an integer"),
    ("temperature", float("inf"), r"temperature must be a finite number in \(0.0, inf\)"),
    ("temperature", 0, "temperature must be a finite number"),
    ("top_p", 1.5, r"top_p must be a finite number in \(0.0, 1.0\]"),
    ("top_p", 0.0, "top_p must be a finite number"),
]


@pytest.mark.parametrize("option, value, message", SAMPLING)
def test_sampling_options_are_checked_when_sampling_and_left_alone_when_greedy(model, option, value, message):
    """Greedy decoding reads none of them: ``temperature=0`` is a common way to ask for it, and ran before."""
    kw = {"max_new_tokens": 2, "chat_template": False, option: value}
    with pytest.raises(ValueError, match=message):
        slake.generate(model, word_tokenizer(), _prompt(), method="snapkv[window=8]", budget=24, do_sample=True, **kw)
    res = slake.generate(model, word_tokenizer(), _prompt(), method="snapkv[window=8]", budget=24, **kw)
    assert len(res.texts) == 1


def test_numpy_and_plain_values_still_pass(model):
    np = pytest.importorskip("numpy")
    res = slake.generate(model, word_tokenizer(), _prompt(), method="snapkv[window=8]", budget=24,
                         max_new_tokens=np.int64(2), chat_template=np.bool_(False), top_k=0, seed=0)  # fmt: skip
    assert len(res.texts) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prefill_chunk": 2.5}, "prefill_chunk must be an integer"),
        ({"prefill_chunk": True}, "prefill_chunk must be an integer"),
        ({"max_cache_len": 2.5}, "max_cache_len must be an integer"),
        ({"max_cache_len": 1}, "max_cache_len must be >= 2"),
        ({"charge_linear_state": "false"}, "charge_linear_state must be True or False"),
    ],
)
def test_slake_cache_refuses_an_option_it_would_misread(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlakeCache("snapkv", 24, config=model.config, window=8, **kwargs)


def test_prefill_refuses_a_fractional_chunk(model):
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with pytest.raises(ValueError, match="prefill_chunk must be an integer"):
        prefill(model, cache, random_ids(48, seed=1), prefill_chunk=2.5)


def test_linear_cache_given_twice_on_the_command_line_is_refused():
    both = argparse.Namespace(set=["linear_cache=false"], linear_cache=True)
    with pytest.raises(ValueError, match="linear_cache is set both"):
        method_overrides(both)
    assert method_overrides(argparse.Namespace(set=["window=8"], linear_cache=False)) == {
        "window": 8,
        "linear_cache": False,
    }


def test_a_layer_cap_below_the_budget_is_refused_before_any_model_work():
    with pytest.raises(ValueError, match="max_layer_budget=16 is below the average budget 24"):
        check_method_budget("cake[window=8,max_layer_budget=16]", 24)
    check_method_budget("cake[window=8,max_layer_budget=24]", 24)
    check_method_budget("slake[window=8,max_layer_budget=16]", 24)  # charged or not: left to the prefill


@pytest.mark.parametrize("spec", ["keydiff", "snapkv[window=0,linear_cache=true]", "slake[window=8]"])
def test_a_charged_linear_state_that_leaves_too_few_slots_is_refused_and_says_why(model, spec):
    with pytest.raises(ValueError, match="slots of the linear state, charged by charge_linear_state"):
        slake.generate(
            model,
            word_tokenizer(),
            _prompt(),
            method=spec,
            budget=9,
            max_new_tokens=1,
            charge_linear_state=True,
            chat_template=False,
            **({} if "[" in spec else {"linear_cache": True}),
        )
