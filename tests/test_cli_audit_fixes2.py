"""Fixes from a second audit of the command line (``slake fidelity``, ``slake calibrate``, ``slake make-prompt``).

* ``slake fidelity --prompt-file F`` with a ratio budget too small for the output level's ``--length``-token prompts
  was not refused before the model loaded: it failed once the attention level had been measured. A ratio too small
  for the prompt file's own length failed after the full cache's run was recorded, and, in a list of methods, after
  the methods before it were measured.
* ``slake calibrate --methods 'slake[vabs=false]'`` built its calibration prompts and measured every candidate before
  finding that alpha and beta, which that variant does not read, changed nothing: now refused before the model loads.
* ``slake make-prompt --out FILE/p.txt`` (a folder below a file) loaded the tokenizer and built the prompt before
  failing with ``[Errno 17] File exists``; now refused first, naming ``--out``.
* ``slake methods | head`` reported ``error: [Errno 32] Broken pipe`` and exited with 2; a reader that stops reading
  now ends the command quietly, with the shell's status of SIGPIPE (141).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import slake.engines.transformers.models as models
import slake.quality.fidelity as fidelity_module
from slake.cli import main
from test_cli_input_refusals import _refused, no_model_load  # noqa: F401  (fixture)
from test_fidelity_fixes import _Tokenizer


def _prompt_file(tmp_path: Path) -> str:
    """A prompt file of 100 words (217 tokens of the test tokenizer with its chat template)."""
    path = tmp_path / "doc.txt"
    path.write_text(" ".join(f"w{i}" for i in range(100)))
    return str(path)


def test_fidelity_refuses_a_ratio_too_small_for_the_output_level_before_the_model_loads(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_model_load: None,  # noqa: F811
) -> None:
    """With ``--prompt-file`` the output level still reads ``--length``-token prompts: a ratio of them below the
    window is refused up front, not after the attention level ran."""
    argv = ["fidelity", "--prompt-file", _prompt_file(tmp_path), "--methods", "snapkv", "--budgets", "0.3"]
    argv += ["--length", "64", "--output-tokens", "3", "--output-samples", "1"]
    _refused(argv, "snapkv: budget 0.3 of a 64-token prompt is 20 tokens", capsys)


def test_fidelity_with_a_prompt_file_and_no_output_level_does_not_check_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_gqa: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output-tokens 0`` with ``--prompt-file`` reads no ``--length`` prompt: a ratio fine for the file runs."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    argv = ["fidelity", "--prompt-file", _prompt_file(tmp_path), "--methods", "snapkv", "--budgets", "0.3"]
    assert main([*argv, "--length", "64", "--output-tokens", "0", "--steps", "2", "--no-progress", "--json"]) == 0
    capsys.readouterr()


def test_fidelity_refuses_a_ratio_too_small_for_the_prompt_file_before_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_gqa: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ratio of the prompt file's tokens below a method's window is refused once the prompt is encoded, before the
    full cache's run is recorded and before any method (h2o) is measured."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))

    def no_record(*a: Any, **k: Any) -> None:
        raise AssertionError("the full-cache run was recorded before the budgets were checked")

    monkeypatch.setattr(fidelity_module, "record", no_record)
    argv = ["fidelity", "--prompt-file", _prompt_file(tmp_path), "--methods", "h2o,snapkv", "--budgets", "0.1"]
    assert main([*argv, "--output-tokens", "0", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "h2o: budget 0.1 of a 217-token prompt is 22 tokens" in err and "AssertionError" not in err, err


@pytest.mark.parametrize("spec", ["slake[vabs=false]", "slake[window=8,vabs=false]"])
def test_calibrate_refuses_a_variant_that_does_not_read_the_searched_values(
    spec: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_model_load: None,  # noqa: F811
) -> None:
    argv = ["calibrate", "--methods", f"cake,{spec}", "--budgets", "64", "--length", "256", "--samples", "1"]
    line = _refused([*argv, "--out-dir", str(tmp_path / "p")], f"--methods {spec}", capsys)
    assert "alpha" in line and "vabs" in line
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("below", ["a_file/p.txt", "a_file/sub/p.txt"])
def test_make_prompt_refuses_an_out_below_a_file_before_the_tokenizer(
    below: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_model_load: None,  # noqa: F811
) -> None:
    """``--out FILE/p.txt`` loaded the tokenizer, built the prompt and then failed with ``[Errno 17] File exists``."""
    (tmp_path / "a_file").write_text("x")
    argv = ["make-prompt", "--task", "needle", "--length", "200", "--out", str(tmp_path / below)]
    line = _refused(argv, "--out", capsys)
    assert ("is a file" in line or "is not a folder" in line) and "Errno" not in line
    assert (tmp_path / "a_file").read_text() == "x"


def test_a_reader_that_stops_reading_is_not_an_error(monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    """``slake methods | head`` printed ``slake methods: error: [Errno 32] Broken pipe`` and exited with 2: the
    reader of standard output leaving is no error of slake's."""
    import os
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone: every write to the pipe fails with EPIPE
    stream = open(write, "w", buffering=1)  # noqa: SIM115  (closed below)
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        assert main(["methods"]) == 141  # a shell's status of a process ended by SIGPIPE
    finally:
        monkeypatch.undo()
        stream.close()
    assert "error" not in capfd.readouterr().err
