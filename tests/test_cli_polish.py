"""What the command line told users wrongly or not at all (2026-11-30, thirty-fifth session).

No ``slake --version``; ``--help`` left out the defaults of ``--method``, ``--budget``, ``--max-new-tokens`` and a
dozen more; ``slake eval --methods full`` asked for ``--budgets`` the full cache never reads; ``--dtype BF16`` was
refused; an existing file given as ``--model`` was "no such model directory"; ``--protocol kvpress`` on the vLLM
engine blamed a ``--question-agnostic`` the user never gave; "--temperature only apply"; and ``slake demo`` blamed the
model, or the budget alone, for an answer that ``--max-new-tokens`` had cut.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import slake
from slake.cli import build_parser, main
from slake.cli.options import DefaultsShownFormatter
from test_bench_honesty import fake_demo
from test_cli_input_refusals import _refused, no_model_load  # noqa: F401  (fixture)


def test_slake_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"slake {slake.__version__}"


def _sub_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_with_a_default_says_it_in_its_help():
    formatter = DefaultsShownFormatter("slake")
    missing, noise = [], []
    for command, parser in _sub_parsers().items():
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, command
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            shown = formatter._get_help_string(action) or ""
            if not action.help:
                missing.append(f"{command} {action.option_strings[0]} has no help")
            no_value = action.default is None or isinstance(action.default, bool)  # 0 == False: not by value
            has_default = not no_value and action.default not in ("", [], argparse.SUPPRESS)
            if has_default and "default" not in shown.lower():
                missing.append(f"{command} {action.option_strings[0]} hides its default {action.default!r}")
            if "(default: %(default)s)" in shown and no_value:
                noise.append(f"{command} {action.option_strings[0]}")
    assert not missing and not noise, missing + noise
    generate = _sub_parsers()["generate"].format_help()
    for shown in ("(default: snapkv)", "(default: 128)", "(default: 64)"):
        assert shown in " ".join(generate.split()), shown


def test_eval_of_the_full_cache_alone_needs_no_budgets(llama_gqa, tmp_path, monkeypatch):
    from slake.cli.eval import cmd_eval
    from slake.engines.transformers import TransformersEngine
    from slake.eval import suites
    from slake.eval.results import read_results
    from test_eval_runner import ESSAYS, TinyTokenizer, _eval_args, _loader

    real_build = suites.build_samples
    monkeypatch.setattr(suites, "build_samples", lambda plan, tokenizer: real_build(plan, tokenizer, essays=ESSAYS))
    engine = TransformersEngine(loader=_loader(llama_gqa, TinyTokenizer()))
    args = _eval_args(tmp_path / "run")
    args.methods, args.budgets, args.lengths, args.depths = "full", None, "200", "0"
    assert cmd_eval(args, engine=engine) == 0
    rows = read_results(tmp_path / "run")
    assert rows and {(r["method"], r["budget"]) for r in rows} == {("full", None)}
    args = _eval_args(tmp_path / "other")
    args.methods, args.budgets = "snapkv", None  # a method that compresses still needs them
    with pytest.raises(ValueError, match="--budgets is required"):
        cmd_eval(args, engine=engine)


def test_dtype_is_read_in_any_case():
    from slake.cli.validation import validate_args
    from slake.engines.transformers.models import parse_dtype
    from slake.engines.vllm.plugin.config import vllm_dtype

    assert parse_dtype("BF16", "cpu") is torch.bfloat16 and parse_dtype(" Float32 ", "cpu") is torch.float32
    assert vllm_dtype("BF16") == "bfloat16" and vllm_dtype("HALF") == "float16" and vllm_dtype(None) == "float32"
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--dtype", "FP16"])
    validate_args(args)
    assert args.dtype == "fp16"
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        parse_dtype("FP64", "cpu")


def test_an_existing_file_as_model_is_named_a_file(tmp_path, capsys, no_model_load):  # noqa: F811
    from slake.engines.transformers.models import resolve_model

    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="is a file, not a model directory"):
        resolve_model(str(path), None)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        resolve_model(str(tmp_path / "absent"), None)


def test_a_protocol_the_engine_cannot_run_is_named_as_given(tmp_path, capsys):
    argv = ["eval", "--protocol", "kvpress", "--methods", "snapkv", "--engine", "vllm", "--out", str(tmp_path / "o")]
    err = _refused(argv, "--engine vllm cannot run --protocol kvpress", capsys)
    assert "does not support --question-agnostic" not in err


def test_one_sampling_option_without_sample_is_one_option(capsys, no_model_load):  # noqa: F811
    _refused(["generate", "--prompt", "hi", "--temperature", "0.5"], "--temperature only applies with", capsys)
    _refused(["generate", "--prompt", "hi", "--top-p", "0.5", "--temperature", "2"], "only apply with", capsys)


@pytest.mark.parametrize("limit", [4, 40])
def test_demo_names_max_new_tokens_when_it_cut_the_answer(limit, monkeypatch, capsys):
    """The fake engine answers in 4 tokens: cut at --max-new-tokens 4, not at 40."""
    from test_demo_output import _answers

    engine = fake_demo(monkeypatch, {"full": 10, "kept": 10}, {"full": 10, "kept": 5})
    argv = ["demo", "--length", "1024", "--budget", "64", "--max-new-tokens", str(limit)]
    _answers(monkeypatch, engine, {"full": "4680899", "slake": "7654"})
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "try a larger --budget" in err and ("larger --max-new-tokens" in err) == (limit == 4)
    _answers(monkeypatch, engine, {"full": "1234", "slake": "7654"})
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "full cache did not answer correctly either" in err and "larger --budget" not in err
    assert ("cut at --max-new-tokens 4" in err) == (limit == 4)
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["full"]["new_tokens"] == 4
