"""slake fidelity: per-layer relative error of attention outputs against the full cache."""

from __future__ import annotations

from slake.quality import fidelity
from tiny_models import random_ids


def test_fidelity_rows_and_limiting_cases(llama_gqa, tmp_path):
    rec = fidelity.record(llama_gqa, random_ids(120, seed=40), steps=4)
    L = llama_gqa.config.num_hidden_layers
    assert len(rec.steps) == 4 and all(len(s) == L for s in rec.steps)
    exact = fidelity.measure(rec, "snapkv", 200)  # budget above the prompt: nothing evicted
    assert len(exact) == L
    assert all(r["rel_err"] < 1e-5 and r["rel_err_window"] < 1e-5 for r in exact)
    cake = fidelity.measure(rec, "cake", 40)
    slake_rows = fidelity.measure(rec, "slake", 40)
    assert all(r["rel_err"] > 1e-3 for r in cake)  # eviction does change attention
    assert {tuple(sorted(r)) for r in cake + slake_rows} == {
        ("budget", "layer", "linear_cache", "method", "profile", "rel_err", "rel_err_window")
    }
    # the linear cache switch works for any evicting method and changes the result
    snap_lin = fidelity.measure(rec, "snapkv", 40, linear_cache=True)
    snap = fidelity.measure(rec, "snapkv", 40)
    assert snap_lin[0]["linear_cache"] and not snap[0]["linear_cache"]
    assert any(abs(a["rel_err"] - b["rel_err"]) > 1e-6 for a, b in zip(snap_lin, snap))
    rows = cake + slake_rows
    assert "| cake | no | 40 |" in fidelity.summary_table(rows)
    fidelity.plot_per_layer(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
