"""What an evaluation reads back from disk is the same model's and settings': each test failed before its fix.

- ``--prefill-cache``'s model fingerprint summed three weight tensors only, so a checkpoint differing elsewhere (a
  LoRA merged into one layer) was served the other checkpoint's captures.
- A results directory resumed the rows of other weights under the same ``--model`` name (another ``--gguf-file``,
  a new fine-tune saved at the same path) as its own.
- It resumed rows made with another model profile (``$SLAKE_NO_PROFILE``, a new ``slake calibrate``) as its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from slake.cli.eval import cmd_eval
from slake.engines.base import ModelSpec
from slake.engines.transformers import TransformersEngine
from slake.engines.transformers.prefill_once import CaptureStore, capture_prefill, model_fingerprint, weights_digest
from slake.eval import suites
from slake.eval.results import ResultsWriter, read_results
from slake.eval.resume_checks import check_run_settings
from slake.methods.profiles import model_identity, write_entry
from test_eval_runner import ESSAYS, TinyTokenizer, _eval_args, _loader
from tiny_models import tiny_model


def _merge_lora(model, layer: int = 0) -> None:
    """A rank-4 update of one layer's query and value projections (a merged LoRA)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name in ("q_proj", "v_proj"):
            w = getattr(model.model.layers[layer].self_attn, name).weight
            w.add_(0.5 * torch.randn(w.shape[0], 4, generator=g) @ torch.randn(4, w.shape[1], generator=g))


def test_a_checkpoint_differing_in_one_layer_gets_its_own_prefill_captures(tmp_path):
    base, tuned = tiny_model("llama-gqa"), tiny_model("llama-gqa")
    assert model_fingerprint(base) == model_fingerprint(tuned)  # the same weights: the same key
    _merge_lora(tuned)
    assert model_fingerprint(base) != model_fingerprint(tuned)  # before: equal (first, middle and last tensor)
    ids = list(range(5, 120))
    CaptureStore(tmp_path, base).save(ids, capture_prefill(base, torch.tensor([ids])))
    assert CaptureStore(tmp_path, tuned).load(ids) is None
    assert CaptureStore(tmp_path, base).load(ids) is not None


def test_the_weights_digest_ignores_what_the_forward_rewrites():
    model = tiny_model("llama-gqa")
    before = weights_digest(model)
    rope = model.model.rotary_emb
    rope.inv_freq.mul_(0.5)  # non-persistent: dynamic and LongRoPE scaling rewrite it in the forward
    assert weights_digest(model) == before
    with torch.no_grad():
        model.model.norm.weight[3] += 1e-3  # one element of one tensor
    assert weights_digest(model) != before


@pytest.fixture
def needle_essays(monkeypatch):
    real_build = suites.build_samples
    monkeypatch.setattr(suites, "build_samples", lambda plan, tokenizer: real_build(plan, tokenizer, essays=ESSAYS))


def _run(model, out, *extra, tok=None):
    """``slake eval`` on ``model``; ``tok``: the tokenizer (a new TinyTokenizer by default, whose ids depend on what it
    has encoded: runs that resume each other's samples share one, or their ids differ, which a rerun refuses)."""
    args = _eval_args(out, "--methods", "snapkv", "--budgets", "40", "--lengths", "200", "--depths", "0", *extra)
    cmd_eval(args, engine=TransformersEngine(loader=_loader(model, tok or TinyTokenizer())))


def test_a_results_directory_refuses_other_weights_under_the_same_name(tmp_path, needle_essays):
    first, other = tiny_model("llama-gqa", seed=0), tiny_model("llama-gqa", seed=1)
    _run(first, tmp_path)
    rows = read_results(tmp_path)
    assert {r["weights"] for r in rows} == {TransformersEngine.from_model(first, None).weights_digest}
    _run(first, tmp_path, "--depths", "0,100")  # the same weights resume
    with pytest.raises(ValueError, match="weights"):  # before: 0 rows written, the first model's reported
        _run(other, tmp_path, "--depths", "0,100")


def test_a_results_directory_refuses_another_gguf_file(tmp_path):
    class Engine(TransformersEngine):
        weights_digest = None  # an engine that cannot read its weights: the file name still tells them apart

    from slake.engines.base import EvalOptions
    from slake.eval.runner import run_settings

    def settings(gguf):
        engine = Engine(ModelSpec(name="repo", gguf_file=gguf), loader=_loader(tiny_model("llama-gqa"), None))
        return run_settings(engine, EvalOptions(), chat_template=True, max_new_tokens=None)

    row = {
        "suite": "needle",
        "task": "needle",
        "sample_id": "s0",
        "model": "repo",
        "method": "full",
        "budget": None,
        "length": 200,
        "prediction": "x",
        "answers": ["x"],
        "score": 1.0,
        "prefill_s": 0.0,
        "decode_s": 0.0,
        "seed": 0,
        "query_aware": True,
        **settings("sub/m-Q4_K_M.gguf"),
    }
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    with ResultsWriter(tmp_path) as store:
        check_run_settings(store, settings("other/dir/m-Q4_K_M.gguf"))  # the same file name from elsewhere
        with pytest.raises(ValueError, match="gguf_file"):  # before: resumed
            check_run_settings(store, settings("m-Q8_0.gguf"))


def test_a_results_directory_refuses_other_profile_values(tmp_path, needle_essays, monkeypatch):
    model = tiny_model("llama-gqa")
    model.config.slake_model_name = "tiny"
    profiles = tmp_path / "profiles"
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(profiles))
    monkeypatch.delenv("SLAKE_NO_PROFILE", raising=False)
    entry = {"method": "slake", "budget": 40, "values": {"alpha": 3.0, "beta": 0.0}, "context": {}}
    write_entry(model_identity(model), entry, folder=Path(profiles))
    out = tmp_path / "run"
    tok = TinyTokenizer()
    _run(model, out, "--methods", "slake", tok=tok)
    assert {r["profile"]["values"]["alpha"] for r in read_results(out) if r["method"] == "slake"} == {3.0}
    _run(model, out, "--methods", "slake", "--depths", "0,100", tok=tok)  # the same profile resumes
    monkeypatch.setenv("SLAKE_NO_PROFILE", "1")
    with pytest.raises(ValueError, match="profile"):  # before: resumed, one line of two sets of hyperparameters
        _run(model, out, "--methods", "slake", "--depths", "0,50,100", tok=tok)
    # snapkv has no profile entry either way: its rows resume
    _run(model, out, "--methods", "snapkv", "--depths", "0,100", tok=tok)
    assert os.environ["SLAKE_NO_PROFILE"] == "1"


def test_a_results_directory_refuses_rows_scored_with_another_metric(tmp_path, needle_essays):
    model = tiny_model("llama-gqa")
    _run(model, tmp_path)
    rows = read_results(tmp_path)
    # as a run scoring the same samples otherwise left them (a plain RULER run, then --protocol kvpress)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(dict(r, metric="kvpress")) + "\n" for r in rows))
    with pytest.raises(ValueError, match="metric"):  # before: resumed, the other metric's scores reported
        _run(model, tmp_path, "--depths", "0,100")


def test_a_results_directory_still_takes_a_second_model(tmp_path, needle_essays):
    _run(tiny_model("llama-gqa", seed=0), tmp_path, "--model", "a")
    _run(tiny_model("llama-gqa", seed=1), tmp_path, "--model", "b")  # its own name, its own weights: its own rows
    assert sorted({r["model"] for r in read_results(tmp_path)}) == ["a", "b"]


def test_two_runs_on_one_directory_at_once_do_not_mix_their_rows(tmp_path, needle_essays):
    """A --kv-dtype int8 run started while a plain one on the same --out was between its checks and its rows: both
    passed the checks of the (empty) directory and both wrote every row, so results.jsonl held two rows per key with
    two kv_dtype values and each summary took whichever came later. The second is now refused while the first runs."""
    model = tiny_model("llama-gqa")
    refused: list[str] = []

    class Interleaved(TransformersEngine):  # the second run starts while the first holds the directory
        def evaluate(self, requests, options):
            try:
                _run(model, tmp_path, "--kv-dtype", "int8")
            except ValueError as e:
                refused.append(str(e))
            yield from super().evaluate(requests, options)

    args = _eval_args(tmp_path, "--methods", "snapkv", "--budgets", "40", "--lengths", "200", "--depths", "0")
    cmd_eval(args, engine=Interleaved(loader=_loader(model, TinyTokenizer())))
    assert len(refused) == 1 and "being written by another run" in refused[0]  # before: ran, 4 rows
    rows = read_results(tmp_path)
    assert len(rows) == 2 and {r["kv_dtype"] for r in rows} == {None}
    _run(model, tmp_path, "--depths", "0,100")  # the directory is free again once the first run has ended


def test_a_refused_protocol_run_writes_no_requests(tmp_path, monkeypatch):
    import argparse
    import dataclasses

    from slake.cli.eval import add_eval_parser
    from slake.eval import protocol as protocol_module

    monkeypatch.setitem(
        protocol_module.PROTOCOLS, "kvpress", dataclasses.replace(protocol_module.PROTOCOLS["kvpress"], length=400)
    )
    engine = TransformersEngine(loader=_loader(tiny_model("llama-gqa"), TinyTokenizer()))
    common = ["--tasks", "niah_single_1", "--samples", "1", "--max-new-tokens", "3", "--out", str(tmp_path)]

    def args(*extra):
        parser = argparse.ArgumentParser()
        add_eval_parser(parser.add_subparsers(dest="command"))
        return parser.parse_args(
            ["eval", "--methods", "snapkv", "--model", "tiny", "--no-progress", "--no-plots", *extra]
        )

    plain = ["--suite", "ruler", "--lengths", "400", "--budgets", "0.5", "--question-agnostic"]
    cmd_eval(args(*plain, *common), engine=engine)  # the same samples, scored without kvpress's cleaning
    with pytest.raises(ValueError, match="metric"):
        cmd_eval(args("--protocol", "kvpress", *common), engine=engine)
    assert not (tmp_path / protocol_module.REQUESTS_FILE).exists()  # before: written, then the run refused


def test_offloaded_weights_are_not_compared_and_not_cached():
    model = tiny_model("llama-gqa")
    layer = model.model.layers[1].mlp.up_proj
    layer.weight = torch.nn.Parameter(torch.empty_like(layer.weight, device="meta"))  # as accelerate offloads it
    assert weights_digest(model) is None
    assert TransformersEngine.from_model(model, None).weights_digest is None  # how many layers offload varies
    with pytest.raises(ValueError, match="offloaded"):
        model_fingerprint(model)  # before: RuntimeError from a meta tensor's values
