"""Rows record the digest of their prompt's token ids (``ids_digest``), and a run refuses to add rows to a sample whose
rows were made from other ids: the sample digest names the text only, so a tokenizer that encodes the same text
otherwise (another transformers release, another tokenizer under the same model name) added rows of another prompt
beside the old ones, and one sample's methods were compared on two prompts without a word."""

from __future__ import annotations

import json

import pytest

from slake.eval.encoding import encode_sample, ids_digest
from slake.eval.needle import needle_grid
from slake.eval.results import read_results
from slake.eval.runner import run_suite
from test_eval_runner import ESSAYS, TinyTokenizer

KW = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)


class OtherTokenizer(TinyTokenizer):
    """The same text, one more id at the end of every encoded prompt (a tokenizer that segments it otherwise)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return super().encode(text, add_special_tokens) + [3]


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


@pytest.fixture(scope="module")
def samples(tok):
    return needle_grid(tok, [200], [0, 100], seed=1, essays=ESSAYS, max_new_tokens=2)


def test_rows_record_the_digest_of_their_ids(llama_gqa, tok, samples, tmp_path):
    rows = run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], tmp_path, **KW)
    prefill_ids, question_ids = encode_sample(samples[0], tok)
    assert {r["ids_digest"] for r in rows} == {ids_digest(prefill_ids, question_ids)}
    assert ids_digest([1, 2], [3]) != ids_digest([1], [2, 3])  # the split is part of the prompt


def test_a_sample_tokenized_otherwise_is_refused_not_added_beside_its_rows(llama_gqa, tok, samples, tmp_path):
    first = run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], tmp_path, **KW)
    with pytest.raises(ValueError, match="other token ids"):
        run_suite(llama_gqa, OtherTokenizer(), samples[:1], ["snapkv"], [40, 64], tmp_path, **KW)
    assert read_results(tmp_path) == first
    # the same tokenizer adds its rows; a sample with no earlier rows is not compared with anything
    more = run_suite(llama_gqa, tok, samples, ["snapkv"], [40, 64], tmp_path, **KW)
    assert len(more) == 1 + 3


def test_rows_without_the_digest_are_not_compared(llama_gqa, tok, samples, tmp_path):
    first = run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], tmp_path, **KW)
    old = [{k: v for k, v in r.items() if k != "ids_digest"} for r in first]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert len(run_suite(llama_gqa, OtherTokenizer(), samples[:1], ["snapkv"], [40, 64], tmp_path, **KW)) == 1
