"""Bad command-line input is refused in one line (exit code 2) naming the flag, before any model loads: empty
values are not read as options left out, output folders that are files are refused up front, duplicates are not
measured twice, ``--threads`` is bounded by the machine's CPUs, options a suite does not use are not ignored,
validation creates no folder, and a ``--random-model`` override is given once."""

from __future__ import annotations

import argparse

import pytest

from slake.cli import build_parser, main

EVAL = ["eval", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "256", "--methods", "snapkv"]
EVAL += ["--budgets", "64", "--samples", "1"]
BENCH = ["bench", "--random-model", "tiny", "--lengths", "64", "--methods", "full", "--budget", "48"]
FID = ["fidelity", "--methods", "snapkv", "--budgets", "64", "--length", "256", "--output-tokens", "0"]
CAL = ["calibrate", "--methods", "cake", "--budgets", "64", "--length", "256", "--samples", "1", "--tokens", "2"]
GEN = ["generate", "--prompt", "hello there", "--method", "snapkv", "--budget", "64"]


@pytest.fixture
def no_model_load(monkeypatch, tmp_path):
    """Fail loudly if a command gets as far as loading a model or a tokenizer; profiles go to ``tmp_path``."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were validated")

    import slake.engines.transformers.models
    import slake.engines.transformers.shapes

    monkeypatch.setattr(slake.engines.transformers.models, "load_model", refuse)
    monkeypatch.setattr(slake.engines.transformers.shapes, "random_model", refuse)
    monkeypatch.setattr(slake.engines.transformers.models, "load_tokenizer", refuse)
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path / "profiles"))


def _refused(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``slake argv``; check exit code 2, one line on stderr that holds ``fragment``; return that line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith(f"slake {argv[0]}: error: "), lines[0]
    assert fragment in lines[0], lines[0]
    return lines[0]


def _out(tmp_path) -> list[str]:
    return ["--out", str(tmp_path / "out")]


# ----------------------------------------------------------------------------- 1. an empty value is not "not given"

EMPTY = [
    ("eval-tasks", ["eval", "--suite", "ruler", "--tasks", "", "--methods", "snapkv", "--budgets", "64"], "--tasks"),
    ("eval-lengths", [*EVAL, "--lengths", ""], "--lengths"),
    (
        "eval-depths",
        ["eval", "--suite", "needle", "--depths", "", "--methods", "snapkv", "--budgets", "64"],
        "--depths",
    ),
    ("eval-kv-dtype", [*EVAL, "--kv-dtype", ""], "--kv-dtype"),
    ("eval-prefill-cache", [*EVAL, "--prefill-cache", " "], "--prefill-cache"),
    ("bench-lengths", [*BENCH, "--lengths", ""], "--lengths"),
    ("bench-kv-dtype", [*BENCH, "--kv-dtype", ""], "--kv-dtype"),
    ("bench-random-model", ["bench", "--random-model", "", "--lengths", "64", "--methods", "full"], "--random-model"),
    ("generate-kv-dtype", [*GEN, "--kv-dtype", ""], "--kv-dtype"),
    ("generate-model", [*GEN, "--model", ""], "--model"),
    ("fidelity-prompt-file", [*FID, "--prompt-file", ""], "--prompt-file"),
    ("calibrate-out-dir", [*CAL, "--out-dir", ""], "--out-dir"),
]


@pytest.mark.parametrize("case", EMPTY, ids=[c[0] for c in EMPTY])
def test_an_empty_value_is_refused_naming_the_flag(case, tmp_path, capsys, no_model_load):
    """``--tasks ''`` ran every RULER task, ``--lengths ''`` the default lengths, ``--random-model ''`` loaded the
    packaged model, ``--kv-dtype ''`` stored at the model's dtype, ``--out-dir ''`` wrote to the default folder."""
    _, argv, flag = case
    extra = [] if argv[0] in ("generate", "fidelity", "calibrate") else _out(tmp_path)
    line = _refused([*argv, *extra], flag, capsys)
    assert "empty" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "profiles").exists()


@pytest.mark.parametrize("command", [EVAL, BENCH])
def test_an_empty_out_is_refused(command, tmp_path, capsys, no_model_load, monkeypatch):
    """``eval --out ''`` wrote results.jsonl and the summaries into the working directory."""
    monkeypatch.chdir(tmp_path)
    _refused([*command, "--out", ""], "--out is empty", capsys)
    assert not list(tmp_path.iterdir())


def test_cmd_eval_refuses_empty_values_without_the_command_line_checks(tmp_path):
    """Called directly (as tests and scripts do), ``cmd_eval`` refuses them too, before the engine is asked."""
    from slake.cli.eval import cmd_eval

    for name in ("tasks", "lengths", "kv_dtype", "out"):
        args = build_parser().parse_args([*EVAL, "--out", str(tmp_path / "out")])
        setattr(args, name, "")
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} is empty"):
            cmd_eval(args, engine=_NoEngine())


def test_model_spec_and_bench_lengths_refuse_empty_values():
    from slake.cli.bench import bench_lengths
    from slake.cli.options import model_spec

    with pytest.raises(ValueError, match="--random-model is empty"):
        model_spec(argparse.Namespace(random_model="", model=None))
    with pytest.raises(ValueError, match="--lengths"):
        bench_lengths(argparse.Namespace(lengths="", serve=False))
    with pytest.raises(ValueError, match="--lengths with --serve"):
        bench_lengths(argparse.Namespace(lengths="", serve=True))
    assert model_spec(argparse.Namespace(random_model="tiny", model=None)).random == "tiny"


class _NoEngine:
    """An engine that must not be reached: every argument is checked before it is asked anything."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the engine was asked for {name} before the arguments were validated")


# ----------------------------------------------------------------------------- 2. an --out that is a file


@pytest.mark.parametrize("flag", ["--out", "--prefill-cache"])
def test_eval_refuses_a_file_as_out_or_prefill_cache_before_the_model_loads(flag, tmp_path, capsys, no_model_load):
    """Both were refused only after the model loaded, with a bare "[Errno 17] File exists"."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = [*EVAL, *_out(tmp_path), flag, str(afile)]
    _refused(argv, f"{flag} {afile}: {afile} exists and is not a folder", capsys)
    _refused([*EVAL, *_out(tmp_path), flag, str(afile / "sub")], f"{flag} {afile / 'sub'}: {afile} is a file", capsys)


def test_bench_refuses_a_file_as_out_before_it_measures(tmp_path, capsys, no_model_load):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused([*BENCH, "--out", str(afile)], f"--out {afile}: {afile} exists and is not a folder", capsys)


# ----------------------------------------------------------------------------- 3. duplicates, blank aliases

DUPLICATES = [
    ("fidelity-methods", [*FID[:1], "--methods", "snapkv,snapkv", *FID[3:]], "--methods: 'snapkv' given twice"),
    ("fidelity-variants", [*FID[:1], "--methods", "slake[alpha=1],slake[alpha=1.0]", *FID[3:]], "--methods: "),
    ("fidelity-budgets", [*FID, "--budgets", "64,64"], "--budgets: '64' given twice"),
    ("fidelity-kv-dtype", [*FID, "--kv-dtype", "auto,none"], "--kv-dtype: 'auto' and 'none' given twice"),
    ("calibrate-methods", [*CAL, "--methods", "cake,cake"], "--methods: 'cake' given twice"),
    ("calibrate-budgets", [*CAL, "--budgets", "64,64"], "--budgets: '64' given twice"),
]


@pytest.mark.parametrize("case", DUPLICATES, ids=[c[0] for c in DUPLICATES])
def test_fidelity_and_calibrate_refuse_what_is_given_twice(case, tmp_path, capsys, no_model_load):
    """Each was measured (or searched) twice and reported twice under one name; ``bench`` refused them."""
    _, argv, fragment = case
    _refused([*argv, *(["--out-dir", str(tmp_path / "p")] if argv[0] == "calibrate" else [])], fragment, capsys)


def test_fidelity_refuses_a_method_given_twice_once_linear_cache_is_forced():
    from slake.cli.validation import fidelity_grid

    args = build_parser().parse_args([*FID[:1], "--methods", "snapkv,snapkv[linear_cache=true]", "--budgets", "64"])
    assert fidelity_grid(args)[0] == ["snapkv", "snapkv[linear_cache=true]"]
    args.linear_cache = "on"
    with pytest.raises(ValueError, match="--methods: 'snapkv' and 'snapkv\\[linear_cache=true\\]' given twice"):
        fidelity_grid(args)


@pytest.mark.parametrize("alias", ["", "  "])
def test_calibrate_refuses_a_blank_alias(alias, tmp_path, capsys, no_model_load):
    """``--alias ''`` wrote ``"aliases": [""]`` into the profile."""
    _refused([*CAL, "--alias", "m", "--alias", alias, "--out-dir", str(tmp_path / "p")], "--alias", capsys)


# ----------------------------------------------------------------------------- 4. --threads


def test_bench_refuses_more_threads_than_cpus(tmp_path, capsys, no_model_load, monkeypatch):
    """``--threads 100000`` was accepted and crashed the process (segmentation fault)."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    _refused([*BENCH, *_out(tmp_path), "--threads", "5"], "--threads 5 is more than this machine's 4 CPUs", capsys)
    from slake.cli.bench import check_threads

    check_threads(4)
    check_threads(None)
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        check_threads(0)


# ----------------------------------------------------------------------------- 5. options a run would ignore


def test_eval_parses_budgets_with_the_full_cache_alone(tmp_path, capsys, no_model_load):
    """``--methods full --budgets garbage`` ran: the budgets were never read without a compressed method."""
    argv = ["eval", "--suite", "ruler", "--methods", "full", "--budgets", "garbage", *_out(tmp_path)]
    _refused(argv, "garbage", capsys)


@pytest.mark.parametrize("option", [["--longbench-dir", "lb"], ["--longbench-hub"]])
def test_eval_refuses_longbench_options_with_another_suite(option, tmp_path, capsys, no_model_load):
    _refused(
        [*EVAL, *_out(tmp_path), *option], f"{option[0]} applies to the longbench suite only, not to ruler", capsys
    )


# ----------------------------------------------------------------------------- 6. calibrate creates no folder


def test_calibrate_validation_creates_no_folder(tmp_path, monkeypatch):
    """Validation made ``--out-dir`` (and the default profile folder) even when the run was then refused."""
    from slake.cli.calibrate import _check_args

    out_dir = tmp_path / "new" / "profiles"
    _check_args(build_parser().parse_args([*CAL, "--out-dir", str(out_dir)]))
    assert not (tmp_path / "new").exists()
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path / "default" / "p"))
    _check_args(build_parser().parse_args(CAL))
    assert not (tmp_path / "default").exists()
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--out-dir .*is a file"):
        _check_args(build_parser().parse_args([*CAL, "--out-dir", str(blocker / "x")]))


# ----------------------------------------------------------------------------- 7. a --random-model key given twice


def test_a_random_model_override_given_twice_is_refused(tmp_path, capsys, no_model_load):
    """``tiny:num_hidden_layers=1,num_hidden_layers=2`` was settled by the last value."""
    from slake.engines.transformers.shapes import parse_shape

    spec = "tiny:num_hidden_layers=1,num_hidden_layers=2"
    with pytest.raises(ValueError, match="num_hidden_layers is given twice"):
        parse_shape(spec)
    argv = ["bench", "--random-model", spec, "--lengths", "64", "--methods", "full", *_out(tmp_path)]
    _refused(argv, "num_hidden_layers is given twice", capsys)
    assert parse_shape("tiny:num_hidden_layers=1")[1]["num_hidden_layers"] == 1


# ----------------------------------------------------------------------------- make-prompt


def test_make_prompt_refuses_an_empty_or_folder_out_before_the_tokenizer(tmp_path, capsys, no_model_load):
    """``--out ''`` and ``--out DIR`` failed only once the prompt was built, with a bare "[Errno 21]"."""
    argv = ["make-prompt", "--task", "needle", "--length", "64", "--out"]
    _refused([*argv, ""], "--out is empty", capsys)
    _refused([*argv, str(tmp_path)], f"--out {tmp_path} is a folder", capsys)


# ----------------------------------------------------------------------------- 8. a ratio below the window

RATIO = [
    ("bench", [*BENCH[:-4], "--methods", "full,snapkv", "--budget", "0.1", "--lengths", "1024,128"], "128-token"),
    ("fidelity", ["fidelity", "--methods", "snapkv", "--budgets", "0.01", "--length", "256", "--output-tokens", "0"],
     "256-token"),
    ("calibrate", [*CAL[:4], "0.01", *CAL[5:]], "256-token"),
    ("demo", ["demo", "--method", "snapkv", "--budget", "0.01", "--length", "256"], "256-token"),
]  # fmt: skip


@pytest.mark.parametrize("case", RATIO, ids=[c[0] for c in RATIO])
def test_a_ratio_below_the_protected_tokens_is_refused_before_the_model_loads(case, tmp_path, capsys, no_model_load):
    """A ratio budget that leaves fewer tokens than the window was refused by the prefill: after the model loaded,
    and in a sweep after the configurations before it had run and written their rows."""
    name, argv, length = case
    extra = _out(tmp_path) if name == "bench" else []
    _refused([*argv, *extra], f"of a {length} prompt is", capsys)


def test_eval_refuses_a_ratio_below_the_protected_tokens_before_any_row(tmp_path):
    from slake.eval.needle import needle_grid
    from slake.eval.runner import run_suite
    from test_eval_runner import ESSAYS, TinyTokenizer
    from tiny_models import tiny_model

    tok = TinyTokenizer()
    samples = needle_grid(tok, [200], [50], seed=1, essays=ESSAYS, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"snapkv: budget 0\.01 of a \d+-token prompt is 3 tokens"):
        run_suite(tiny_model("llama-gqa", layers=2), tok, samples, ["snapkv"], [0.01], tmp_path / "o",
                  suite="needle", model_name="tiny", progress=False)  # fmt: skip
    assert not (tmp_path / "o" / "results.jsonl").exists() or not (tmp_path / "o" / "results.jsonl").read_text()
