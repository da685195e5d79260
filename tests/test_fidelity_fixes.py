"""Fixes to ``slake fidelity``: the output level per (method, budget, linear cache, kv dtype) as the attention level,
the layer facts a method needs at the attention level, and refusals before the model loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import slake.engines.transformers.models as models
from slake.cli import main
from slake.cli.fidelity import add_fidelity_parser, cmd_fidelity
from slake.quality import fidelity, output_fidelity
from test_eval_runner import TinyTokenizer
from tiny_models import random_ids


class _Tokenizer(TinyTokenizer):
    """transformers' call on one text, whose result has attributes."""

    def __call__(self, texts, **kw):
        return argparse.Namespace(**super().__call__([texts] if isinstance(texts, str) else texts, **kw))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_fidelity_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["fidelity", *argv])


def _refuse_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)


def test_output_level_has_a_line_per_linear_cache_and_kv_dtype(llama_gqa, tmp_path, monkeypatch, capsys):
    """``--linear-cache both --kv-dtype auto,int8`` gave 4 attention-level lines but one output-level line, the mean
    of the linear cache off and on rows, with no int8 row."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(100)))
    out = tmp_path / "out"
    args = _args(
        "--prompt-file", str(prompt), "--methods", "snapkv", "--budgets", "40", "--length", "120", "--steps", "2",
        "--output-tokens", "3", "--output-samples", "1", "--linear-cache", "both", "--kv-dtype", "auto,int8",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert cmd_fidelity(args) == 0
    data = json.loads(capsys.readouterr().out)
    settings = {(r["method"], r["linear_cache"]) for r in data["rows"]}
    assert settings == {("snapkv", False), ("snapkv", True), ("snapkv@int8", False), ("snapkv@int8", True)}
    assert {(r["method"], r["linear_cache"]) for r in data["output_rows"]} == settings
    assert len(data["output_rows"]) == 4 * 2  # one row per setting and continuation (1 essay + 1 answer)
    # each setting is measured, not copied: int8 storage and the linear cache each move the distributions
    kl = {(r["method"], r["linear_cache"], r["kind"]): r["kl"] for r in data["output_rows"]}
    assert len({round(v, 9) for v in kl.values()}) > 2
    md = (out / "fidelity.md").read_text()
    section = md.split("## Output level")[1].split("## Per layer")[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| snapkv")]
    assert sorted(ln.split(" | ")[:2] for ln in lines) == [
        ["| snapkv", "no"],
        ["| snapkv", "yes"],
        ["| snapkv@int8", "no"],
        ["| snapkv@int8", "yes"],
    ]
    assert (out / "output_kl_vs_budget.png").stat().st_size > 1000


def test_output_summary_keeps_linear_cache_settings_apart():
    rows = [
        {"method": "snapkv", "budget": 64, "kind": "text", "kl": kl, "delta_nll": 0.0, "top1": 1.0, "tokens": 3}
        | ({} if lin is None else {"linear_cache": lin})
        for kl, lin in ((0.5, False), (0.1, True), (0.3, None))
    ]
    table = output_fidelity.summary_table(rows)
    assert "| snapkv | no | 64 | 0.5000 |" in table
    assert "| snapkv | yes | 64 | 0.1000 |" in table
    assert "| snapkv | - | 64 | 0.3000 |" in table


def test_measure_outputs_stores_kept_entries_in_the_kv_dtype(llama_gqa):
    from slake.quality.output_fidelity import Continuation, measure_outputs, prepare_reference

    ids = random_ids(100, seed=3)[0].tolist()
    ref = prepare_reference(llama_gqa, [Continuation("text", "t0", ids[:90], ids[90:])])
    plain = measure_outputs(llama_gqa, ref, "snapkv", 40)
    int8 = measure_outputs(llama_gqa, ref, "snapkv", 40, kv_dtype="int8")
    assert plain[0]["method"] == "snapkv" and int8[0]["method"] == "snapkv@int8"
    assert int8[0]["kl"] != plain[0]["kl"]
    assert measure_outputs(llama_gqa, ref, "snapkv", 40, kv_dtype="auto")[0]["method"] == "snapkv"


def test_attention_level_gives_methods_the_layer_facts_they_need(llama_gqa):
    """``--methods ada-expected-attention`` stopped after the recording: no rotary embedding of layer 0."""
    rec = fidelity.record(llama_gqa, random_ids(120, seed=41), steps=2)
    assert len(rec.layer_context) == rec.num_layers and rec.layer_context[0].rotary is not None
    for method in ("ada-expected-attention", "expected-attention", "criticalkv"):
        rows = fidelity.measure(rec, method, 48)
        assert len(rows) == rec.num_layers and all(r["rel_err"] > 0 for r in rows), method


def test_kvzip_is_refused_before_the_model_loads(monkeypatch, capsys):
    _refuse_load(monkeypatch)
    assert main(["fidelity", "--methods", "snapkv,kvzip", "--budgets", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot measure kvzip" in err[0] and "slake eval --fidelity" in err[0], err
    assert "slake.generate" not in err[0]


@pytest.mark.parametrize("under_file", [True, False])
def test_a_bad_out_folder_is_refused_before_the_model_loads(monkeypatch, capsys, tmp_path: Path, under_file):
    _refuse_load(monkeypatch)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker / "x" if under_file else blocker
    assert main(["fidelity", "--methods", "snapkv", "--budgets", "64", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and str(blocker) in err[0], err
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("hide", [False, True])
def test_a_progress_bar_counts_each_setting_at_each_level(llama_gqa, tmp_path, monkeypatch, capsys, hide):
    """``slake fidelity`` over many settings ran for minutes with no sign of progress: a bar on standard error now
    counts each (method, budget) setting at the attention level and again at the output level; ``--no-progress``
    hides it."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(100)))
    argv = ["--prompt-file", str(prompt), "--methods", "snapkv,h2o", "--budgets", "40,48", "--length", "120",
            "--steps", "2", "--output-tokens", "3", "--output-samples", "1", "--json"]  # fmt: skip
    assert cmd_fidelity(_args(*argv, *(["--no-progress"] if hide else []))) == 0
    err = capsys.readouterr().err
    assert ("8/8" in err) is not hide  # 2 methods x 2 budgets, at two levels
    assert "output level: 2 prompts" in err


def test_rows_and_the_report_name_the_model_measured(llama_gqa, tmp_path, monkeypatch, capsys):
    """fidelity.json and fidelity.md did not say which model they measured (evaluation rows carry ``model``)."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(100)))
    out = tmp_path / "out"
    args = _args(
        "--model", "my-org/some-model", "--prompt-file", str(prompt), "--methods", "snapkv", "--budgets", "40",
        "--length", "120", "--steps", "2", "--output-tokens", "3", "--output-samples", "1", "--no-progress",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert cmd_fidelity(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["model"] for r in data["rows"] + data["output_rows"]} == {"my-org/some-model"}
    assert json.loads((out / "fidelity.json").read_text())["rows"][0]["model"] == "my-org/some-model"
    assert (out / "fidelity.md").read_text().startswith("# Attention fidelity (my-org/some-model, ")


def test_a_hybrid_models_layers_are_numbered_as_the_model_numbers_them():
    """Gemma 3's compressed layers are its full-attention ones: rows said layers 0 and 1 for the model's 1 and 3."""
    from hybrid_models import hybrid_model

    model = hybrid_model("gemma3")
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert full != list(range(len(full)))
    rec = fidelity.record(model, random_ids(120), 2)
    assert rec.model_layers == full
    rows = fidelity.measure(rec, "snapkv", 64, profile_model=model)
    assert [r["layer"] for r in rows] == full
    assert [line.split(" | ")[0].lstrip("| ") for line in fidelity.per_layer_table(rows).splitlines()[2:]] == [
        str(i) for i in full
    ]
