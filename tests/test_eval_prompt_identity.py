"""A results directory takes a row for this run's only when it was made from the same prompt.

A sample id names the task, length and seed, not the text: the other essay package, a generator whose wording
changed, or an edited data file give another prompt under the same id, whose rows a resume took for its own.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from slake.cli.eval import cmd_eval
from slake.engines.transformers import TransformersEngine
from slake.eval import suites
from slake.eval.protocol_outputs import kvpress_rows
from slake.eval.results import read_results
from slake.eval.sample import Sample, sample_digest
from test_eval_protocol import _outputs, _requests
from test_eval_runner import ESSAYS, TinyTokenizer, _eval_args, _loader
from test_eval_support import fake_essays
from tiny_models import tiny_model


def _run(model, out, essays, *extra):
    real_build = suites.build_samples
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(suites, "build_samples", lambda plan, tokenizer: real_build(plan, tokenizer, essays=essays))
        args = _eval_args(out, "--methods", "snapkv", "--budgets", "40", "--lengths", "200", "--depths", "0", *extra)
        cmd_eval(args, engine=TransformersEngine(loader=_loader(model, TinyTokenizer())))


def test_the_digest_names_what_the_sample_asks():
    s = Sample(task="t", context="a long text. ", question="Q?", answers=["x"], metric="all", max_new_tokens=8)
    assert sample_digest(s) == sample_digest(dataclasses.replace(s, sample_id="other", length=99, depth=3.0))
    for change in (
        {"context": "another text. "},
        {"question": "Q2?"},
        {"answer_prefix": " A:"},
        {"answers": ["y"]},
        {"max_new_tokens": 9},
        {"use_chat_template": False},
    ):
        assert sample_digest(dataclasses.replace(s, **change)) != sample_digest(s), change


def test_a_results_directory_refuses_rows_made_from_another_prompt_under_the_same_id(tmp_path):
    model = tiny_model("llama-gqa")
    other = fake_essays(n_essays=4, sentences=60, seed=1)
    _run(model, tmp_path, ESSAYS)
    rows = read_results(tmp_path)
    assert rows and all(len(r["sample_digest"]) == 16 for r in rows)
    _run(model, tmp_path, ESSAYS, "--depths", "0,100")  # the same prompts resume
    assert len(read_results(tmp_path)) == 2 * len(rows)
    with pytest.raises(ValueError, match="another prompt"):  # before: resumed, the other essays' rows reported
        _run(model, tmp_path, other, "--depths", "0,100")


def test_rows_without_a_digest_are_not_compared(tmp_path):
    model = tiny_model("llama-gqa")
    _run(model, tmp_path, ESSAYS)
    rows = [{k: v for k, v in r.items() if k != "sample_digest"} for r in read_results(tmp_path)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _run(model, tmp_path, fake_essays(n_essays=4, sentences=60, seed=1))  # written before the digest: resumed
    assert len(read_results(tmp_path)) == len(rows)


def test_a_kvpress_output_made_from_another_prompt_is_skipped():
    requests = _requests()
    for i, r in enumerate(requests["requests"]):
        r["sample_digest"] = f"{i:016x}"
    digest = {r["sample_id"]: r["sample_digest"] for r in requests["requests"]}
    outputs = [{**o, "sample_digest": digest[o["sample_id"]]} for o in _outputs()]
    rows = kvpress_rows(requests, outputs)
    assert len(rows) == len(outputs) and all(r["sample_digest"] == digest[r["sample_id"]] for r in rows)
    # an output written before outputs named their prompt, then the same request answered again (merged in file
    # order): the answer that names the request's prompt is the row, the older one is reported
    old, new = {**_outputs()[0], "text": "is 999"}, outputs[0]
    skipped_old: list[str] = []
    (row,) = kvpress_rows(requests, [old, new], skipped=skipped_old)
    assert row["prediction"] == new["text"] and row["sample_digest"] == new["sample_digest"]  # before: "is 999"
    assert len(skipped_old) == 1 and "superseded" in skipped_old[0]
    stale = [{**o, "sample_digest": "f" * 16} for o in outputs[:3]]
    skipped: list[str] = []
    assert kvpress_rows(requests, stale, skipped=skipped) == []  # before: merged as the new prompt's rows
    assert len(skipped) == 3 and "earlier version" in skipped[0]
    # an output of a kvpress side that does not echo the digest is still taken, and says it names no prompt
    legacy = kvpress_rows(requests, _outputs())
    assert len(legacy) == len(outputs) and all(r["sample_digest"] is None for r in legacy)
