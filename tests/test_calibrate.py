"""``slake calibrate``: the search over VABS/CAKE exponents and its profile entry."""

from __future__ import annotations

import pytest

from slake.cli import build_parser
from slake.cli.calibrate import _check_args
from slake.methods import make_method
from slake.quality.calibrate import calibrate_method
from slake.quality.output_fidelity import Continuation, mean_distance, measure_outputs, prepare_reference
from tiny_models import random_ids


@pytest.fixture(scope="module")
def reference(llama_gqa):
    conts = []
    for i, n in enumerate((80, 64)):
        ids = random_ids(n + 6, seed=60 + i)[0].tolist()
        conts.append(Continuation("text", f"c{i}", ids[:n], ids[n:]))
    return prepare_reference(llama_gqa, conts)


@pytest.mark.parametrize(
    "spec,grid,refine",
    [
        ("slake[window=8]", {"alpha": (0.0, 3.0), "beta": (0.0, 2.0)}, True),
        ("cake[window=8]", {"tau1": (0.25, 4.0), "tau2": (0.25, 4.0)}, False),
    ],
)
def test_search_returns_the_best_candidate_and_its_measured_distances(llama_gqa, reference, spec, grid, refine):
    method = make_method(spec)
    calls = []
    entry = calibrate_method(
        llama_gqa, reference, method, 24, grid=grid, refine=refine, on_candidate=lambda: calls.append(1)
    )
    keys = list(grid)
    assert entry["method"] == method.name and entry["budget"] == 24 and set(entry["values"]) == set(keys)
    assert entry["before"]["values"] == {k: float(getattr(method, k)) for k in keys}
    assert entry["after"]["kl"] <= entry["before"]["kl"]
    assert entry["search"]["candidates"] == len(calls) >= len(grid[keys[0]]) * len(grid[keys[1]])
    assert entry["context"]["window"] == 8 and not set(keys) & set(entry["context"])
    # the reported distance is what the chosen values really give
    best = make_method(spec, **entry["values"])
    rows = measure_outputs(llama_gqa, reference, best, 24)
    assert abs(mean_distance(rows) - entry["after"]["kl"]) < 1e-6


def test_calibrate_rejects_bad_input_before_loading_a_model():
    parser = build_parser()
    for argv, message in (
        (["calibrate", "--methods", "snapkv"], "tunes"),
        (["calibrate", "--budgets", "16"], "below"),
        (["calibrate", "--length", "100"], "--length"),
        (["calibrate", "--tokens", "1"], "--tokens"),
        (["calibrate", "--budgets", "0"], "budget"),
    ):
        with pytest.raises(ValueError, match=message):
            _check_args(parser.parse_args(argv))
