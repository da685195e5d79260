"""Public functions refuse bad input with a clear error naming the argument, and their docstrings say what they take.

Not marked ``transformers_free``: the model-path test imports :mod:`slake.engines.transformers.models`.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from slake.budgets import (
    cross_head_counts,
    largest_remainder,
    pyramid_budgets,
    safeguarded_head_counts,
    uniform_budgets,
    waterfill,
)
from slake.eval.metrics import longbench_score, ruler_score
from slake.eval.ruler import ruler_sample
from slake.eval.suites import plan_suite
from slake.methods import available_methods, make_method
from slake.methods.base import Method, register
from slake.methods.spec import format_method_spec, parse_method_spec

try:
    from test_eval_support import WordTokenizer, fake_essays
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.test_eval_support import WordTokenizer, fake_essays


# ----------------------------------------------------------------------------- 1. plan_suite


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"samples": 1.5}, r"samples \(--samples\) must be an integer, got 1\.5"),
        ({"samples": "2"}, r"samples \(--samples\) must be an integer, got '2'"),
        ({"samples": True}, r"samples \(--samples\) must be an integer, got True"),
        ({"samples": 0}, r"samples \(--samples\) must be an integer >= 1, got 0"),
        ({"seed": 0.5}, r"seed \(--seed\) must be an integer"),
        ({"lengths": [-5]}, r"lengths \(--lengths\) must be an integer >= 1, got -5"),
        ({"lengths": [0]}, r"lengths .* >= 1, got 0"),
        ({"lengths": ["abc"]}, r"lengths \(--lengths\) must be an integer, got 'abc'"),
        ({"lengths": [1024.0]}, r"lengths \(--lengths\) must be an integer, got 1024\.0"),
        ({"lengths": "1024"}, r"lengths \(--lengths\) must be a sequence of integers"),
        ({"depths": [150]}, r"depths \(--depths\) must be a number in \[0, 100\] \(percent\), got 150"),
        ({"depths": [-1.0]}, r"depths .* got -1\.0"),
        ({"depths": [float("nan")]}, r"depths .* got nan"),
        ({"depths": ["50"]}, r"depths .* got '50'"),
    ],
)
def test_plan_suite_refuses_a_bad_count_length_or_depth_before_any_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_suite("needle", **kwargs)


def test_plan_suite_keeps_good_values_as_plain_numbers():
    import numpy as np

    plan = plan_suite("needle", lengths=(np.int64(64), 128), samples=np.int64(2), depths=[np.float32(50), 0])
    assert plan.lengths == [64, 128] and type(plan.lengths[0]) is int
    assert plan.samples == 2 and type(plan.samples) is int
    assert plan.depths == [50.0, 0.0]
    assert plan_suite("needle", lengths=iter([32])).lengths == [32]  # an iterator is read once
    assert plan_suite("ruler", ["vt"], [2048], None).samples == 5  # the suite's default
    with pytest.raises(ValueError, match="depths applies to the needle suite only"):
        plan_suite("ruler", ["vt"], depths=[50])


# ----------------------------------------------------------------------------- 2. unknown task or metric


def test_ruler_score_and_longbench_score_name_an_unknown_metric_or_dataset():
    with pytest.raises(ValueError, match=r"unknown RULER metric 'nope'; expected one of all, part"):
        ruler_score(["a"], [["a"]], "nope")
    with pytest.raises(ValueError, match=r"unknown RULER metric 'nope'"):
        ruler_score([], [], "nope")  # refused even with nothing to score
    with pytest.raises(ValueError, match=r"unknown LongBench dataset 'nope'; expected one of narrativeqa, .*lcc"):
        longbench_score("nope", ["a"], [["a"]])
    with pytest.raises(ValueError, match=r"unknown LongBench dataset 'nope_e'"):
        longbench_score("nope_e", [], [])
    assert ruler_score(["a b"], [["a", "c"]], "all") == 50.0
    assert longbench_score("lcc_e", ["x = 1"], [["x = 1"]]) == 100.0


def test_the_key_errors_of_unknown_names_are_documented():
    from slake.eval.longbench import load_longbench

    with pytest.raises(KeyError, match="unknown RULER task 'niah_x'"):
        ruler_sample("niah_x", WordTokenizer(), 100)
    with pytest.raises(KeyError, match="unknown LongBench dataset 'nosuch'"):
        load_longbench("nosuch", ".")
    for fn in (ruler_sample, load_longbench):
        raises = inspect.getdoc(fn).split("Raises\n------\n", 1)[1]
        assert "KeyError\n    For an unknown" in raises, fn.__name__


# ----------------------------------------------------------------------------- 3. depth of a needle-less task


@pytest.mark.parametrize("task", ["vt", "cwe", "fwe", "qa_1", "qa_2"])
def test_ruler_sample_refuses_a_depth_for_a_task_without_a_needle(task):
    """It ignored the depth and still tagged the sample id ``-d30``, as if the prompt had a needle there."""
    with pytest.raises(ValueError, match=rf"RULER task {task} has none .*depth=30"):
        ruler_sample(task, WordTokenizer(), 200, depth=30, essays=fake_essays())


def test_ruler_sample_keeps_a_depth_for_a_needle_task():
    sample = ruler_sample("niah_single_2", WordTokenizer(), 300, depth=30, essays=fake_essays())
    assert sample.sample_id.endswith("-d30")


# ----------------------------------------------------------------------------- 4. format_method_spec round trip


@pytest.mark.parametrize(
    "value", ["a,b", "a]", "[a", " a", "a ", "16", "True", "true", "null", [1], {"a": 1, "b": 2}, object()]
)
def test_format_method_spec_refuses_a_value_that_would_not_read_back(value):
    with pytest.raises(ValueError, match=r"hyperparameter k=.* cannot be written in a method spec"):
        format_method_spec("x", {"k": value})


@pytest.mark.parametrize("key", ["K", " k", "a,b", "a=b", "", 3])
def test_format_method_spec_refuses_a_key_that_would_not_read_back(key):
    with pytest.raises(ValueError, match="hyperparameter name .* cannot be written"):
        format_method_spec("x", {key: 1})


@pytest.mark.parametrize(
    "value", [True, False, None, 0, 16, -3, 0.5, 1.0, 1e-7, float("inf"), "max", "", "a=b", "a b", "x.y"]
)
def test_format_method_spec_round_trips_what_it_writes(value):
    spec = format_method_spec("SLAKE", {"k": value, "b_key": 2})
    name, overrides = parse_method_spec(spec)
    assert name == "slake" and overrides == {"k": value, "b_key": 2}
    assert type(overrides["k"]) is type(value) and spec.startswith("slake[b_key=2,k=")


def test_format_method_spec_refuses_a_name_that_would_not_read_back():
    for name in ("", "a[b", "a,b", "a=b"):
        with pytest.raises(ValueError, match="method name"):
            format_method_spec(name, {"k": 1})


# ----------------------------------------------------------------------------- 5. GenerationResult documented


def test_generation_result_documents_sequences_and_text():
    from slake.engines.result import GenerationResult

    doc = inspect.getdoc(GenerationResult)
    assert "\nsequences : torch.Tensor | None\n" in doc
    assert "\ntext : str\n" in doc


# ----------------------------------------------------------------------------- 6. missing .gguf path


def test_a_missing_gguf_path_is_named_a_missing_file(tmp_path):
    from slake.engines.transformers import models

    with pytest.raises(FileNotFoundError, match=r"no such model file: .*x\.gguf$"):
        models.resolve_model(str(tmp_path / "x.gguf"))
    with pytest.raises(FileNotFoundError, match=r"no such model file: .*X\.GGUF$"):
        models.resolve_model(str(tmp_path / "X.GGUF"))
    with pytest.raises(FileNotFoundError, match="no such model directory: "):
        models.resolve_model(str(tmp_path / "nope"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert models.resolve_model(str(gguf)) == (str(tmp_path.resolve()), "m.gguf")


# ----------------------------------------------------------------------------- 7. launch_mode before load


def test_launch_mode_before_load_says_the_interpreter_without_cuda(monkeypatch):
    """Without CUDA, :func:`slake.kernels.load` switches the interpreter on: the mode before it is the same, not
    ``"cached"`` (a GPU's)."""
    from slake.kernels import launch_config, launch_mode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cached in (True, False):
        monkeypatch.setattr(launch_config, "CACHED_LAUNCH", cached)
        assert launch_mode() == "interpreter"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch_mode() == "triton"  # CACHED_LAUNCH off
    monkeypatch.setattr(launch_config, "CACHED_LAUNCH", True)
    assert launch_mode() == "cached"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch_mode() == "interpreter"


# ----------------------------------------------------------------------------- 8. methods built directly


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("slake", {"vabs": "false"}, r"'slake': vabs must be true or false, got 'false'"),
        ("cake", {"window": 16.5}, r"'cake': window must be an integer, got 16\.5"),
        ("cake", {"gamma": "200"}, r"'cake': gamma must be a number, got '200'"),
        ("lava", {"window": "3"}, r"'lava': window must be an integer"),  # LAVa compares before its super()
        ("sagekv", {"k": 1.5}, r"'sagekv': k must be an integer or null, got 1\.5"),
        ("snapkv", {"linear_cache": 1}, r"'snapkv': linear_cache must be true or false, got 1"),
        ("snapkv", {"no_such": 1}, r"method 'snapkv' has no hyperparameter no_such"),
    ],
)
def test_a_method_built_directly_checks_its_hyperparameter_types(name, kwargs, message):
    cls = available_methods()[name]
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_a_method_built_directly_checks_positional_values_too():
    cls = available_methods()["snapkv"]
    with pytest.raises(ValueError, match="window must be an integer"):
        cls("32")


def test_defaults_copies_and_make_method_still_build_every_method():
    import copy
    import pickle

    for name, cls in available_methods().items():
        method = cls()
        assert replace(method) == method, name  # replace passes every field, defaults included
        assert make_method(name, **method.hyperparameters()) == method, name
        assert copy.deepcopy(method) == method and pickle.loads(pickle.dumps(method)) == method, name
    cake = available_methods()["cake"](gamma=200, window=16)  # an integer is a number
    assert cake.gamma == 200 and cake.window == 16
    assert make_method("cake[gamma=200]").gamma == 200.0


# ----------------------------------------------------------------------------- 9. budgets and the registry


def test_head_counts_refuse_a_wrong_typed_budget_or_shape():
    scores = torch.rand(1, 2, 4)
    with pytest.raises(TypeError, match=r"total must be a \(B,\) int64 torch.Tensor, got int"):
        cross_head_counts(scores, 3)
    with pytest.raises(TypeError, match=r"per_head must be a \(B,\) int64 torch.Tensor, got int"):
        safeguarded_head_counts(scores, 2, 0.5)
    with pytest.raises(ValueError, match=r"scores must have shape \(B, H, n\), got \(2, 4\)"):
        cross_head_counts(torch.rand(2, 4), torch.tensor([3]))
    with pytest.raises(TypeError, match="scores must be a"):
        cross_head_counts([[[1.0]]], torch.tensor([1]))
    with pytest.raises(ValueError, match=r"total must have one entry per sequence \(2\)"):
        cross_head_counts(torch.rand(2, 2, 4), torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="alpha must be a real number, got '0.5'"):
        safeguarded_head_counts(scores, torch.tensor([2]), "0.5")
    assert cross_head_counts(scores, torch.tensor([3])).sum() == 3
    assert safeguarded_head_counts(scores, torch.tensor([2]), 0.5).sum() == 4


def test_layer_budgets_refuse_wrong_typed_arguments():
    with pytest.raises(TypeError, match="num_layers must be an integer, got '3'"):
        uniform_budgets("3", 1)
    with pytest.raises(TypeError, match="per_layer must be an integer, got 1.5"):
        uniform_budgets(3, 1.5)
    with pytest.raises(TypeError, match="selectable must be an integer, got True"):
        pyramid_budgets(4, True, 100, 8)
    with pytest.raises(TypeError, match="beta must be a real number"):
        pyramid_budgets(4, 16, 100, 8, beta="20")
    with pytest.raises(TypeError, match="total must be a real number"):
        waterfill([1.0, 2.0], "3", 2.0)
    with pytest.raises(TypeError, match="total must be an integer, got 2.5"):
        largest_remainder(torch.tensor([1.5, 1.0]), 2.5)
    assert uniform_budgets(torch.tensor(2), 5).tolist() == [5, 5]  # anything with __index__
    assert largest_remainder(torch.tensor([1.5, 1.0]), 3).tolist() == [2, 1]


def test_register_refuses_what_is_not_a_method_class():
    for thing in (int, Method(), "snapkv"):
        with pytest.raises(TypeError, match="register expects a subclass of slake.methods.Method"):
            register(thing)


# ----------------------------------------------------------------------------- 10. numpy-style docstrings


def _public_functions():
    import slake.budgets as budgets
    import slake.engines as engines
    from slake.cli import main
    from slake.eval import (
        data_sources,
        longbench,
        metrics,
        needle,
        plots,
        results,
        ruler,
        runner,
        sample,
        suites,
        summary,
    )
    from slake.methods import base, spec

    return [
        budgets.largest_remainder,
        budgets.pyramid_budgets,
        budgets.safeguarded_head_counts,
        budgets.uniform_budgets,
        budgets.waterfill,
        base.register,
        base.canonical_method_spec,
        spec.format_method_spec,
        base.parse_method_list,
        engines.ModelSpec,
        engines.make_engine,
        main,
        suites.build_samples,
        sample.count_tokens,
        data_sources.hotpotqa_samples,
        data_sources.squad_samples,
        data_sources.paul_graham_essays,
        longbench.longbench_samples,
        metrics.longbench_score,
        needle.needle_grid,
        suites.plan_suite,
        results.read_results,
        ruler.ruler_samples,
        metrics.ruler_score,
        runner.run_suite,
        metrics.score_prediction,
        metrics.score_sample,
        summary.summary_rows,
        longbench.truncate_middle,
        plots.write_plots,
    ]


@pytest.mark.parametrize("fn", _public_functions(), ids=lambda f: f.__name__)
def test_public_functions_document_their_parameters(fn):
    doc = inspect.getdoc(fn)
    assert "\nParameters\n----------\n" in doc
    documented = doc.split("\nParameters\n----------\n", 1)[1]
    for name in inspect.signature(fn).parameters:
        assert name in documented, f"{fn.__name__}: parameter {name} undocumented"
    if not isinstance(fn, type):
        assert "\nReturns\n-------\n" in doc, f"{fn.__name__}: no Returns section"


@pytest.mark.parametrize("model", [None, "smollm2", torch.nn.Linear(2, 2)])
def test_prepare_model_refuses_what_is_not_a_transformers_model(model):
    """``prepare_model(None)`` failed in AttributeError: 'NoneType' object has no attribute 'config'."""
    from slake.engines.transformers.attention import prepare_model

    with pytest.raises(TypeError, match="prepare_model expects a transformers model, got"):
        prepare_model(model)
