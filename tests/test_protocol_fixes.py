"""Fixes to ``slake eval --protocol kvpress``: a refused run writes no requests, the merge skips outputs generated
for another version of a request, and the requests file is written atomically and read with errors that name it
(tiny model, fast)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from slake.cli.eval import add_eval_parser, cmd_eval
from slake.eval.protocol import PROTOCOLS, REQUESTS_FILE, read_requests, write_requests
from slake.eval.protocol_outputs import OUTPUTS_FILE, kvpress_rows, merge_outputs
from slake.eval.results import read_results
from slake.eval.sample import Sample
from test_eval_protocol import _requests as protocol_requests

KVPRESS = PROTOCOLS["kvpress"]


def _requests(max_new_tokens: int = 3) -> dict:
    """test_eval_protocol's requests, cut to their first sample (niah_single_1-4096-0), capped at ``max_new_tokens``."""
    base = protocol_requests()
    return {**base, "requests": [{**base["requests"][0], "max_new_tokens": max_new_tokens}]}


def _output(n_tokens: int, ratio: float | None = 0.5) -> dict:
    return {
        "sample_id": "niah_single_1-4096-0",
        "press": "snapkv" if ratio is not None else "no_press",
        "compression_ratio": ratio,
        "tokens": [7] * n_tokens,
        "text": "w w w 123",
    }


def _write(directory: Path, requests: dict, outputs: list[dict]) -> None:
    (directory / REQUESTS_FILE).write_text(json.dumps(requests))
    with open(directory / OUTPUTS_FILE, "w") as fh:
        for o in outputs:
            fh.write(json.dumps(o) + "\n")


# ---------------------------------------------------------------------------------------------- 1. refused runs


def test_refused_protocol_run_writes_no_requests(llama_gqa, tmp_path, monkeypatch):
    """A run refused for another --max-new-tokens leaves the requests file as the first run wrote it (it was
    rewritten with the refused run's cap, which the kvpress side would then answer)."""
    from slake.engines.transformers import TransformersEngine
    from test_eval_runner import TinyTokenizer, _loader

    monkeypatch.setitem(PROTOCOLS, "kvpress", dataclasses.replace(KVPRESS, length=400))
    out = tmp_path / "run"
    engine = TransformersEngine(loader=_loader(llama_gqa, TinyTokenizer()))

    def args(cap: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_eval_parser(parser.add_subparsers(dest="command"))
        return parser.parse_args(
            ["eval", "--methods", "snapkv", "--protocol", "kvpress", "--tasks", "niah_single_1", "--samples", "1"]
            + ["--max-new-tokens", cap, "--model", "tiny", "--no-progress", "--no-plots", "--out", str(out)]
        )

    assert cmd_eval(args("3"), engine=engine) == 0
    before = (out / REQUESTS_FILE).read_bytes()
    rows_before = read_results(out)
    with pytest.raises(ValueError, match="new_tokens_cap 3 where this run has 8"):
        cmd_eval(args("8"), engine=engine)
    assert (out / REQUESTS_FILE).read_bytes() == before
    assert read_results(out) == rows_before
    # the same settings again: not refused, nothing left to run
    assert cmd_eval(args("3"), engine=engine) == 0
    assert (out / REQUESTS_FILE).read_bytes() == before


# ---------------------------------------------------------------------------------------------- 1. the merge


def test_merge_skips_outputs_longer_than_the_request_allows(tmp_path):
    """An output of 8 tokens for a request capped at 3 was generated for another version of the request: not merged,
    and reported with the file and the sample (it was merged as a row with max_new_tokens 3 and new_tokens 8)."""
    _write(tmp_path, _requests(3), [_output(8), _output(3, ratio=0.25), _output(2, ratio=None)])
    skipped: list[str] = []
    assert merge_outputs(tmp_path, skipped=skipped) == 2
    rows = read_results(tmp_path)
    assert {(r["method"], r["budget"]) for r in rows} == {("kvpress:snapkv", 0.75), ("kvpress:no_press", None)}
    assert all(r["new_tokens"] <= r["max_new_tokens"] for r in rows)
    (line,) = skipped
    assert str(tmp_path / OUTPUTS_FILE) in line and "niah_single_1-4096-0" in line
    assert "8 tokens" in line and "max_new_tokens 3" in line and "ratio 0.5" in line
    # without a list to report into, kvpress_rows still skips it
    assert [r["new_tokens"] for r in kvpress_rows(_requests(3), [_output(8), _output(3)])] == [3]


def test_merge_skips_outputs_at_a_ratio_the_requests_do_not_list(tmp_path):
    _write(tmp_path, _requests(3), [_output(3, ratio=0.6), _output(3, ratio=0.5)])
    skipped: list[str] = []
    assert merge_outputs(tmp_path, skipped=skipped) == 1
    assert len(skipped) == 1 and "compression ratio 0.6" in skipped[0]


def test_merge_reports_an_output_missing_a_field(tmp_path):
    broken = {k: v for k, v in _output(3).items() if k != "tokens"}
    _write(tmp_path, _requests(3), [broken, [1, 2]])  # type: ignore[list-item]
    skipped: list[str] = []
    assert merge_outputs(tmp_path, skipped=skipped) == 0
    assert len(skipped) == 1 and "missing tokens" in skipped[0]


def test_cmd_eval_reports_outputs_it_does_not_merge(llama_gqa, tmp_path, monkeypatch, capsys):
    """The audit's sequence end to end: outputs generated at 8 tokens for a run capped at 3 are not merged."""
    from slake.engines.transformers import TransformersEngine
    from test_eval_runner import TinyTokenizer, _loader

    monkeypatch.setitem(PROTOCOLS, "kvpress", dataclasses.replace(KVPRESS, length=400))
    out = tmp_path / "run"
    engine = TransformersEngine(loader=_loader(llama_gqa, TinyTokenizer()))
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    argv = ["eval", "--methods", "snapkv", "--protocol", "kvpress", "--tasks", "niah_single_1", "--samples", "1"]
    argv += ["--max-new-tokens", "3", "--model", "tiny", "--no-progress", "--no-plots", "--out", str(out)]
    assert cmd_eval(parser.parse_args(argv), engine=engine) == 0
    (req,) = json.loads((out / REQUESTS_FILE).read_text())["requests"]
    output = {**_output(8), "sample_id": req["sample_id"], "text": " ".join(req["answers"])}
    (out / OUTPUTS_FILE).write_text(json.dumps(output) + "\n")
    capsys.readouterr()
    assert cmd_eval(parser.parse_args(argv), engine=engine) == 0
    assert not [r for r in read_results(out) if r["method"].startswith("kvpress:")]
    err = capsys.readouterr().err
    assert f"{out / OUTPUTS_FILE}: sample {req['sample_id']}" in err and "not merged" in err


# ---------------------------------------------------------------------------------------------- 2. the requests file


def _samples() -> list[Sample]:
    return [
        Sample(
            task="niah_single_1",
            context="a b c " * 5,
            question="what is the number",
            answers=["123"],
            metric="all",
            max_new_tokens=3,
            length=20,
            sample_id="niah_single_1-400-0",
        )
    ]


def _write_requests(directory: Path) -> Path:
    from test_eval_runner import TinyTokenizer

    return write_requests(
        directory,
        _samples(),
        TinyTokenizer(),
        protocol=KVPRESS,
        model_name="tiny",
        model_location=("tiny", None),
        eos_token_ids=[2],
        seed=0,
    )


def test_requests_are_written_atomically(tmp_path, monkeypatch):
    """A write interrupted half-way leaves the previous file whole (it cut the file: the next read failed)."""
    path = _write_requests(tmp_path)
    before = path.read_bytes()
    real = Path.write_text

    def cut(self: Path, text: str, *a, **k) -> int:
        real(self, text[: len(text) // 2], *a, **k)
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", cut)
    with pytest.raises(OSError, match="disk full"):
        _write_requests(tmp_path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [REQUESTS_FILE]  # no temporary file left behind
    assert read_requests(path)["requests"][0]["sample_id"] == "niah_single_1-400-0"


@pytest.mark.parametrize(
    "content, problem",
    [
        ('{"protocol": "kvpress", "model": "ti', "not JSON: Unterminated string"),
        ("[1, 2]", "not a JSON object"),
        ('{"protocol": "kvpress", "model": "tiny"}', "missing requests"),
        ('{"protocol": "kvpress", "model": "tiny", "requests": {}}', "'requests' is not a list"),
        ('{"protocol": "kvpress", "model": "tiny", "requests": [3]}', "request 0 is not an object"),
        ('{"protocol": "kvpress", "model": "tiny", "requests": [{"sample_id": "s-1"}]}', "request s-1 lacks task"),
    ],
)
def test_a_bad_requests_file_is_refused_by_name(tmp_path, content, problem):
    """Each reader (the next protocol run, the merge) names the file and what is wrong (it raised a bare
    JSONDecodeError or KeyError: 'requests')."""
    path = tmp_path / REQUESTS_FILE
    path.write_text(content)
    (tmp_path / OUTPUTS_FILE).write_text(json.dumps(_output(3)) + "\n")
    for read in (lambda: _write_requests(tmp_path), lambda: merge_outputs(tmp_path)):
        with pytest.raises(ValueError, match="not a valid requests file") as e:
            read()
        assert str(path) in str(e.value) and problem in str(e.value) and "remove it" in str(e.value)
    assert path.read_text() == content  # refused, not overwritten
