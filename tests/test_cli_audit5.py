"""Fixes from a fifth audit of the command line (``src/slake/cli``, ``src/slake/quality``).

* ``slake demo --engine vllm --allow-long-context`` was not refused before anything loaded, as ``generate`` and
  ``eval`` refuse it: the demo checked the engine's options without the flag, then converted the model (to read its
  context), loaded its tokenizer and built the document before the engine's ``generate`` refused it.
* ``slake bench --engine vllm --serve --concurrency 1,x`` said ``invalid literal for int() with base 10: 'x'``,
  naming no option, and ``--kv-memory inf`` was accepted (``nan`` was refused) as the memory of vLLM's server.
* ``slake fidelity --json`` (and ``fidelity.json``) wrote a distance that is not a finite number (an overflowed
  fp16 cache's KL) as ``NaN`` / ``Infinity``, which is not JSON: ``jq`` and every strict parser refuse the whole
  output. It is now ``null``, as ``slake eval --fidelity`` rows and ``slake calibrate`` profiles write it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import slake.engines.transformers.models as models
from slake.cli import main
from slake.engines.base import ModelSpec
from slake.engines.vllm.engine import VllmEngine
from test_cli_input_refusals import _refused, no_model_load  # noqa: F401  (fixture)
from test_fidelity_fixes import _Tokenizer


class _VllmLoadsNothing(VllmEngine):
    """The vLLM engine as if vLLM were installed, failing loudly where it would convert or load the model."""

    def check_environment(self) -> None:
        pass

    @property
    def tokenizer(self) -> Any:
        raise AssertionError("the tokenizer was loaded before the options were checked")

    @property
    def context_limit(self) -> int | None:
        raise AssertionError("the model was converted before the options were checked")


def test_demo_on_vllm_refuses_allow_long_context_before_anything_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``generate`` and ``eval`` do: one line naming the flag, before the model is converted or its tokenizer
    loaded."""
    monkeypatch.setattr("slake.cli.demo.engine_from_args", lambda args: _VllmLoadsNothing(ModelSpec()))
    argv = ["demo", "--engine", "vllm", "--allow-long-context"]
    _refused(argv, "--engine vllm does not support --allow-long-context", capsys)


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--concurrency", "1,x", "--concurrency"),
        ("--concurrency", "2.5", "--concurrency"),
        ("--kv-memory", "inf", "--kv-memory"),
    ],
)
def test_bench_serve_names_a_bad_load_option(
    option: str,
    value: str,
    fragment: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_model_load: None,  # noqa: F811
) -> None:
    """A concurrency level that is not an integer names ``--concurrency``; an infinite ``--kv-memory`` is refused as
    NaN is, before the engine is asked anything."""
    argv = ["bench", "--engine", "vllm", "--serve", "--methods", "full", option, value]
    _refused([*argv, "--out", str(tmp_path / "out")], fragment, capsys)


def _no_constants(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_fidelity_writes_a_distance_that_is_not_finite_as_null(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_gqa: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """An overflowed KL (here forced: NaN and +inf for the two prompts) is ``null`` in ``--json`` and in
    ``fidelity.json``, which strict JSON parsers read; the finite fields keep their numbers."""
    import slake.quality.output_fidelity as output_fidelity

    real = output_fidelity.distances

    def overflowing(*args: Any, **kwargs: Any) -> dict:
        d = real(*args, **kwargs)
        d["kl"] = [math.nan, math.inf][: len(d["kl"])] + d["kl"][2:]
        return d

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    monkeypatch.setattr(output_fidelity, "distances", overflowing)
    out = tmp_path / "fid"
    argv = ["fidelity", "--methods", "snapkv", "--budgets", "64", "--length", "128", "--steps", "2"]
    argv += ["--output-tokens", "3", "--output-samples", "1", "--no-progress", "--no-plots", "--json"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = _no_constants(capsys.readouterr().out)
    written = _no_constants((out / "fidelity.json").read_text())
    for doc in (printed, written):
        assert [r["kl"] for r in doc["output_rows"]] == [None, None]
        assert all(isinstance(r["top1"], float) for r in doc["output_rows"])
        assert all(isinstance(r["rel_err"], float) for r in doc["rows"])


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["--method", "snapkv"], True),
        (["--method", "slake", "--no-linear-cache"], True),
        (["--method", "snapkv", "--linear-cache"], False),
    ],
)
def test_generate_refuses_to_charge_a_linear_state_the_method_does_not_keep(
    argv: list[str],
    refused: bool,
    capsys: pytest.CaptureFixture[str],
    no_model_load: None,  # noqa: F811
) -> None:
    # --charge-linear-state with snapkv charged nothing: the run was plain snapkv's, its flag silently a no-op
    args = ["generate", "--prompt", "hello", "--budget", "64", "--charge-linear-state", *argv]
    if refused:
        _refused(args, "keeps none", capsys)
    else:  # the method keeps a linear state: the check passes and the command goes on to load the model
        with pytest.raises(AssertionError, match="a model was loaded"):
            main(args)
