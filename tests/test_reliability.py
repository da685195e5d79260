"""Reliability (issue 14): no silent wrong answers, no lost rows, every bad input a clear error before the slow part.

The table :data:`BAD_INPUTS` is the list of documented bad inputs of every command: each exits with code 2 and one
line on stderr naming the problem, prints nothing on stdout, loads no model and writes nothing. The API misuse cases
below give a clear exception.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from transformers import DynamicCache

import slake
from slake import SlakeCache
from slake.cli import main
from slake.eval.results import ResultsWriter, read_results, scan_results
from slake.eval.summary import write_summary

from tiny_models import random_ids, tiny_model

CUDA = torch.cuda.is_available()


# ====================================================================== the results reader (item 3)
ROW = {"suite": "needle", "task": "needle", "sample_id": "a", "model": "m", "method": "full", "budget": None,
       "length": 64, "score": 1.0}


def _row(**kw):
    return json.dumps({**ROW, **kw})


def test_rows_with_missing_fields_are_skipped_and_reported_not_crashing_the_summary(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [_row(), json.dumps({k: v for k, v in ROW.items() if k != "length"}), "[1, 2]", "not json",
             _row(sample_id="b", score="high"), _row(sample_id="c")]
    path.write_text("\n".join(lines) + "\n")
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a", "c"]
    assert [n for n, _ in scan.skipped] == [2, 3, 4, 5]
    assert "missing length" in scan.skipped[0][1]
    note = scan.describe_skipped()
    assert note.startswith("skipped 4 lines of results.jsonl") and "line 2 (missing length)" in note
    md, _ = write_summary(tmp_path)  # used to raise KeyError: 'length'
    assert "needle" in md.read_text()
    with ResultsWriter(tmp_path) as store:
        assert not store.write(ROW)
    assert path.read_text().splitlines() == lines  # nothing deleted


def test_complete_last_row_without_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + _row(sample_id="b"))
    with ResultsWriter(tmp_path) as store:
        assert not store.write({**ROW, "sample_id": "b"})  # already done: not recomputed
        assert store.write({**ROW, "sample_id": "c"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b", "c"]


def test_partial_last_line_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + _row(sample_id="b")[:-9])
    with ResultsWriter(tmp_path) as store:
        assert store.write({**ROW, "sample_id": "b"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b"]
    assert scan_results(tmp_path).skipped == []


def test_non_utf8_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(_row().encode() + b"\n" + b'{"task": "caf\xe9"}\n' + _row(sample_id="b").encode() + b"\n")
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a", "b"]
    assert scan.skipped == [(2, "not UTF-8")]
    with ResultsWriter(tmp_path) as store:
        assert store.done and store.write({**ROW, "sample_id": "c"})
    assert len(read_results(tmp_path)) == 3
