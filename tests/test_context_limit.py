"""Prompts beyond the model's context (``slake.engines.context``): refused by every command that scores or measures
answers, unless the user allows them, on either engine, before anything runs."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from slake.cli.eval import cmd_eval
from slake.engines.context import check_context, context_limit
from slake.engines.transformers import TransformersEngine
from slake.engines.transformers import evaluate as engine_eval
from slake.engines.vllm.engine import VllmEngine
from slake.engines.vllm.runner import model_context_limit, model_len
from slake.eval.needle import needle_grid
from slake.eval.results import read_results
from slake.eval.runner import run_suite
from test_eval_runner import ESSAYS, TinyTokenizer, _eval_args, _loader


def test_the_context_is_read_from_a_config_a_dict_or_its_text_part(tmp_path):
    assert context_limit(LlamaConfig(max_position_embeddings=512)) == 512
    assert context_limit({"max_position_embeddings": 300}) == 300
    assert context_limit({"text_config": {"max_position_embeddings": 200}, "max_position_embeddings": 9}) == 200
    assert context_limit({"vocab_size": 10}) is None
    assert context_limit({"max_position_embeddings": True}) is None  # not a length
    assert context_limit({"max_position_embeddings": 0}) is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 128}}))
    assert model_context_limit(str(tmp_path)) == 128


def test_check_context_refuses_past_the_limit_and_says_how_to_allow():
    check_context(100, 90, 10)  # exactly the context: fine
    check_context(None, 10**6, 10)  # a model without a context field
    check_context(100, 95, 10, allow_long_context=True)
    with pytest.raises(ValueError, match=r"the prompt has 95 tokens and up to 10 more .* context of 100 tokens"):
        check_context(100, 95, 10)
    with pytest.raises(ValueError, match="--allow-long-context"):
        check_context(100, 95, 10)
    with pytest.raises(ValueError) as refused:
        check_context(100, 95, 10, can_allow=False)
    assert "allow" not in str(refused.value)


def test_vllms_max_model_len_stays_within_a_context_the_prompt_fits():
    """``model_len`` rounded prompt + new tokens + 1 up to 256: a prompt that fits the context exactly asked vLLM
    for 256 positions more than the model has, which vLLM refuses."""
    assert model_len(8160, 32, 8192) == 8192  # 8160 + 32 = 8192 fits; before: 8448
    assert model_len(8160, 32) == 8448  # without the limit, as before
    assert model_len(100, 10, 8192) == 256
    assert model_len(9000, 32, 8192) == 9216  # does not fit: vLLM's own refusal, not a silent cut


def test_the_vllm_engine_refuses_allow_long_context_before_loading():
    with pytest.raises(ValueError, match="--allow-long-context.*max_position_embeddings"):
        VllmEngine().check(allow_long_context=True)


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


@pytest.fixture
def short_context(llama_gqa, monkeypatch):
    """The tiny model with a context of 150 tokens, shorter than the needle samples below."""
    monkeypatch.setattr(llama_gqa.config, "max_position_embeddings", 150)
    return llama_gqa


def test_eval_refuses_samples_beyond_the_context_before_running_any(short_context, tok, tmp_path, monkeypatch):
    """``slake eval --lengths 9000`` on the 8K-token default model ran every sample and scored what the model says
    past its context (60% for the full cache on that run), with no word of it."""
    samples = needle_grid(tok, [120, 200, 280], [0], seed=1, essays=ESSAYS, max_new_tokens=4)
    prefills = []
    real_capture = engine_eval.capture_prefill
    monkeypatch.setattr(engine_eval, "capture_prefill", lambda *a, **k: prefills.append(1) or real_capture(*a, **k))
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match=r"sample '.*280.*' \(length 280\) \(2 of the 3 samples to run are\) has"):
        run_suite(short_context, tok, samples, ["snapkv"], [32], tmp_path, **kw)
    assert prefills == [] and read_results(tmp_path) == []
    # the samples that fit run alone; allowed explicitly, the long ones run too
    assert len(run_suite(short_context, tok, samples[:1], ["snapkv"], [32], tmp_path, **kw)) == 2
    rows = run_suite(short_context, tok, samples, ["snapkv"], [32], tmp_path, allow_long_context=True, **kw)
    assert len(rows) == 2 * 2 and all(r["prompt_tokens"] > 150 for r in rows)


def test_the_new_tokens_count_toward_the_context(short_context, tok, tmp_path):
    samples = needle_grid(tok, [120], [0], seed=1, essays=ESSAYS, max_new_tokens=64)  # the prompt fits, not its answer
    with pytest.raises(ValueError, match="up to 64 more are generated"):
        run_suite(short_context, tok, samples, ["snapkv"], [32], tmp_path, suite="needle", progress=False)


def test_cmd_eval_takes_allow_long_context(short_context, tok, tmp_path, monkeypatch):
    from slake.eval import suites

    real_build = suites.build_samples
    monkeypatch.setattr(suites, "build_samples", lambda plan, tokenizer: real_build(plan, tokenizer, essays=ESSAYS))
    engine = TransformersEngine(loader=_loader(short_context, tok))
    args = _eval_args(tmp_path / "run")
    # a length within the context whose prompt and new tokens are not: refused sample by sample, as before
    args.methods, args.budgets, args.lengths, args.depths = "snapkv", "32", "145", "0"
    with pytest.raises(ValueError, match=r"\(length 145\) has .* beyond the model's context of 150 tokens"):
        cmd_eval(args, engine=engine)
    assert read_results(tmp_path / "run") == []
    args.lengths = "200"  # a length past the context: refused before its samples are built
    with pytest.raises(ValueError, match=r"--lengths 200 asks .* beyond the model's context of 150 tokens"):
        cmd_eval(args, engine=engine)
    args = _eval_args(tmp_path / "run", "--allow-long-context")
    args.methods, args.budgets, args.lengths, args.depths = "snapkv", "32", "200", "0"
    assert cmd_eval(args, engine=engine) == 0
    assert {r["method"] for r in read_results(tmp_path / "run")} == {"full", "snapkv"}


def test_fidelity_refuses_prompts_beyond_the_context(short_context, tok, tmp_path, monkeypatch):
    """``slake fidelity --length`` past the model's context measured attention where the model itself degrades."""
    import argparse

    import slake.engines.transformers.models as models
    from slake.cli.fidelity import add_fidelity_parser, cmd_fidelity

    class Tokenizer(TinyTokenizer):  # transformers' call on one text, whose result has attributes
        def __call__(self, texts, **kw):
            return argparse.Namespace(**super().__call__([texts] if isinstance(texts, str) else texts, **kw))

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (short_context, Tokenizer()))
    parser = argparse.ArgumentParser()
    add_fidelity_parser(parser.add_subparsers(dest="command"))
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(200)))
    argv = ["fidelity", "--prompt-file", str(prompt), "--output-tokens", "0", "--methods", "snapkv", "--budgets", "32"]
    args = parser.parse_args(argv)
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens and up to 16 more .* context of 150 tokens"):
        cmd_fidelity(args)
    args = parser.parse_args(
        ["fidelity", "--length", "140", "--output-tokens", "32", "--steps", "2", "--methods", "snapkv"]
    )
    args.prompt_file = str(prompt)
    prompt.write_text(" ".join(f"w{i}" for i in range(60)))
    with pytest.raises(ValueError, match=r"each output-level prompt \(--length\) has 140 tokens and up to 32 more"):
        cmd_fidelity(args)


def test_cmd_eval_refuses_a_length_past_the_context_before_building_samples(short_context, tok, tmp_path, monkeypatch):
    """``slake eval --lengths 100000000`` (a mistyped length) on the 8K-token default model built samples for minutes
    before the check on their tokens refused them: a requested length alone past the context is refused before any
    sample is built (with ``--allow-long-context`` the samples are built as asked)."""
    from slake.eval import suites

    built = []
    monkeypatch.setattr(suites, "build_samples", lambda plan, tokenizer: built.append(plan) or [])
    engine = TransformersEngine(loader=_loader(short_context, tok))
    args = _eval_args(tmp_path / "run")
    args.methods, args.budgets, args.lengths, args.depths = "snapkv", "32", "120,100000000", "0"
    with pytest.raises(ValueError, match=r"--lengths 100000000 .* beyond the model's context of 150 tokens"):
        cmd_eval(args, engine=engine)
    assert built == []
    args = _eval_args(tmp_path / "run", "--allow-long-context")
    args.methods, args.budgets, args.lengths, args.depths = "snapkv", "32", "120,100000000", "0"
    cmd_eval(args, engine=engine)
    assert [p.lengths for p in built] == [[120, 100000000]]


def test_demo_refuses_a_length_past_the_context_before_building_its_sample(short_context, tok, monkeypatch, capsys):
    import slake.cli.demo as demo
    import slake.eval.needle as needle
    from slake.cli import main

    def built(*args, **kwargs):
        raise AssertionError("a sample was built")

    engine = TransformersEngine(loader=_loader(short_context, tok))
    monkeypatch.setattr(demo, "engine_from_args", lambda args: engine)
    monkeypatch.setattr(needle, "needle_sample", built)
    assert main(["demo", "--length", "100000000", "--budget", "64"]) == 2
    assert "--length 100000000" in capsys.readouterr().err


def test_fidelity_refuses_a_length_past_the_context_before_building_its_prompt(short_context, monkeypatch):
    import argparse

    import slake.engines.transformers.models as models
    import slake.eval.needle as needle
    from slake.cli.fidelity import add_fidelity_parser, cmd_fidelity

    def built(*args, **kwargs):
        raise AssertionError("a prompt was built")

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (short_context, TinyTokenizer()))
    monkeypatch.setattr(needle, "needle_sample", built)
    parser = argparse.ArgumentParser()
    add_fidelity_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["fidelity", "--length", "100000000", "--methods", "snapkv", "--budgets", "32"])
    with pytest.raises(ValueError, match=r"--length 100000000 .* context of 150 tokens .*shorter one$"):
        cmd_fidelity(args)
