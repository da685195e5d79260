"""Third audit of the evaluation's data and prompts (2026-12): LongBench records of another shape than the official
format read without a word, samples that share a row key, needle ids that two depths shared.

* A LongBench record's ``answers`` given as a SQuAD-style object was read as the object's keys (``["text",
  "answer_start"]``), ``all_classes`` given as one text as its characters, ``answers`` holding null as ``"None"``,
  a ``context`` given as a list of passages as the list's ``repr``, and a null ``_id`` as the id ``"None"``. Lines of
  the hub's ``data.zip`` were read without the line checks of a local file (a raw ``AttributeError``, an empty
  member read as no record).
* Two samples of one task, id and length are one row key: ``longbench_samples`` gave every record without an
  ``_id`` the empty id, and the runner computed every such sample and kept the first's rows only.
* A needle id wrote its depth with ``:g``, so two depths within six significant digits shared an id.
"""

from __future__ import annotations

import json
import zipfile

import pytest

from slake.eval import longbench as lb
from slake.eval.needle import needle_sample
from slake.eval.ruler import ruler_sample
from test_eval_support import WordTokenizer, fake_essays

ESSAYS = fake_essays(n_essays=3, sentences=40)


def _record(**fields) -> dict:
    base = {"input": "Who?", "context": "Some passage.", "answers": ["Paris"], "_id": "r0", "dataset": "hotpotqa"}
    base.update(fields)
    return base


# ----------------------------------------------------------------------------- LongBench records


def test_a_squad_style_answers_object_is_refused_not_read_as_its_keys():
    with pytest.raises(ValueError, match="'answers' must be a list of texts"):
        lb.LongBenchRecord.from_json(_record(answers={"text": ["Paris"], "answer_start": [3]}))


def test_all_classes_as_one_text_is_refused_not_split_into_characters():
    with pytest.raises(ValueError, match="'all_classes' must be a list of texts"):
        lb.LongBenchRecord.from_json(_record(dataset="trec", all_classes="Location, Number"))


@pytest.mark.parametrize("answers", [[None], [""], ["", ""], [["Paris"]], [True]])
def test_answers_holding_null_lists_or_only_empty_texts_are_refused(answers):
    with pytest.raises(ValueError, match="answers"):
        lb.LongBenchRecord.from_json(_record(answers=answers))


def test_a_context_given_as_a_list_of_passages_is_refused():
    with pytest.raises(ValueError, match="'context' must be a text"):
        lb.LongBenchRecord.from_json(_record(context=["Passage 1", "Passage 2"]))


def test_official_shapes_still_load():
    record = lb.LongBenchRecord.from_json(_record(answers=["3", 4, ""], all_classes=None, _id=7, length=12))
    assert record.answers == ["3", "4", ""] and record.all_classes is None and record.id == "7"
    assert lb.LongBenchRecord.from_json(_record(answers="Paris")).answers == ["Paris"]


def test_a_null_id_is_no_id_and_is_numbered_by_position(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text("\n".join(json.dumps(_record(_id=None, input=f"q{i}?")) for i in range(2)) + "\n")
    records = lb.read_longbench_jsonl(path, "hotpotqa")  # no warning about repeated ids: none has one
    assert [r.id for r in records] == ["", ""]
    samples = lb.longbench_samples(records, dataset="hotpotqa")
    assert [s.sample_id for s in samples] == ["hotpotqa-0", "hotpotqa-1"]


def test_longbench_samples_give_records_without_an_id_distinct_ids():
    records = [lb.LongBenchRecord.from_json(_record(_id="", input=f"q{i}?")) for i in range(3)]
    records.append(lb.LongBenchRecord.from_json(_record(_id="kept")))
    assert [s.sample_id for s in lb.longbench_samples(records)] == ["hotpotqa-0", "hotpotqa-1", "hotpotqa-2", "kept"]


def test_a_bad_line_of_the_archive_is_refused_naming_it(tmp_path):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("data/hotpotqa.jsonl", json.dumps(_record()) + "\n[1, 2]\n")
        zf.writestr("data/qasper.jsonl", "\n")
    with pytest.raises(ValueError, match=r"data\.zip:data/hotpotqa\.jsonl, line 2: not a LongBench record"):
        lb.read_longbench_archive(archive, "hotpotqa")
    with pytest.raises(ValueError, match="holds no LongBench record"):
        lb.read_longbench_archive(archive, "qasper")


# ----------------------------------------------------------------------------- samples sharing a row key


@pytest.fixture(scope="module")
def tiny_tok():
    from test_eval_runner import TinyTokenizer

    return TinyTokenizer()


def _two_needles(tok):
    a = needle_sample(tok, 200, 0.0, seed=1, essays=ESSAYS, max_new_tokens=2)
    b = needle_sample(tok, 200, 100.0, seed=2, essays=ESSAYS, max_new_tokens=2)
    return a, b


def test_two_samples_sharing_an_id_but_asking_different_things_are_refused(llama_gqa, tiny_tok, tmp_path):
    from slake.eval.runner import run_suite

    a, b = _two_needles(tiny_tok)
    b.sample_id = a.sample_id
    with pytest.raises(ValueError, match=f"share the sample id {a.sample_id!r} but ask different things"):
        run_suite(llama_gqa, tiny_tok, [a, b], "full", [], tmp_path, model_name="tiny", progress=False)
    assert not (tmp_path / "results.jsonl").exists() or not (tmp_path / "results.jsonl").read_text()


def test_a_sample_given_twice_is_run_once(llama_gqa, tiny_tok, tmp_path, monkeypatch):
    from slake.engines.transformers import evaluate as engine_eval
    from slake.eval.runner import run_suite

    prefills = []
    real = engine_eval.capture_prefill
    monkeypatch.setattr(engine_eval, "capture_prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    a, _ = _two_needles(tiny_tok)
    rows = run_suite(llama_gqa, tiny_tok, [a, a], "full", [], tmp_path, model_name="tiny", progress=False)
    assert len(rows) == 1 and len(prefills) == 1


# ----------------------------------------------------------------------------- needle ids


def test_depths_that_round_alike_get_their_own_needle_ids():
    tok = WordTokenizer()
    near = [needle_sample(tok, 200, d, seed=0, essays=ESSAYS) for d in (33.3333333, 33.33333333)]
    assert near[0].sample_id != near[1].sample_id
    assert needle_sample(tok, 200, 50.0, seed=0, essays=ESSAYS).sample_id == "needle-number-200-50-0"  # unchanged
    ruler = [ruler_sample("niah_single_1", tok, 200, seed=0, depth=d) for d in (12.3456781, 12.3456789)]
    assert ruler[0].sample_id != ruler[1].sample_id
    assert ruler_sample("niah_single_1", tok, 200, seed=0, depth=12.5).sample_id == "niah_single_1-200-0-d12.5"
