"""LongBench records that would be scored wrongly without a word: repeated ids, classification without classes.

Two records sharing an ``_id`` were one sample to the results store (the second's row dropped as already written,
a rerun refused as "made from another prompt"); a trec or lsht record without ``all_classes`` scored every
prediction 0, the exact answer included. Also: a results row whose task is not a string is not a valid row (it
broke the summaries).
"""

from __future__ import annotations

import json
import zipfile

import pytest

from slake.eval import longbench as lb
from slake.eval.metrics import longbench_sample_score, score_sample
from slake.eval.results import is_result_row
from slake.eval.summary import summary_rows


def _record(i: int, _id: str, **extra) -> dict:
    return {
        "input": f"question {i}?",
        "context": f"context {i}.",
        "answers": [f"a{i}"],
        "length": 3,
        "_id": _id,
        **extra,
    }


def test_repeated_ids_become_distinct_with_a_warning(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    rows = [_record(0, "x"), _record(1, "x"), _record(2, "y"), _record(3, "x"), _record(4, "")]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.warns(UserWarning, match=r"2 record\(s\) repeat an earlier record's _id; evaluated as x#2, x#3"):
        records = lb.read_longbench_jsonl(path, "hotpotqa")
    assert [r.id for r in records] == ["x", "x#2", "y", "x#3", ""]
    assert [r.answers for r in records] == [[f"a{i}"] for i in range(5)]  # same records, in order


def test_repeated_ids_in_the_archive(tmp_path):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("data/qasper.jsonl", "\n".join(json.dumps(_record(i, "same")) for i in range(2)) + "\n")
    with pytest.warns(UserWarning, match="same#2"):
        records = lb.read_longbench_archive(archive, "qasper")
    assert [r.id for r in records] == ["same", "same#2"]


def test_distinct_ids_do_not_warn(tmp_path, recwarn):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text("\n".join(json.dumps(_record(i, f"id{i}")) for i in range(3)) + "\n")
    assert [r.id for r in lb.read_longbench_jsonl(path, "hotpotqa")] == ["id0", "id1", "id2"]
    assert not [w for w in recwarn if "repeat" in str(w.message)]


@pytest.mark.parametrize("dataset", ["trec", "lsht", "trec_e"])
def test_classification_record_without_classes_is_refused(tmp_path, dataset):
    path = tmp_path / f"{dataset}.jsonl"
    path.write_text(json.dumps(_record(0, "t")) + "\n")
    with pytest.raises(ValueError, match=rf"line 1: .*a record of {dataset} needs a non-empty 'all_classes'"):
        lb.read_longbench_jsonl(path, dataset)
    # with its classes it loads and the exact answer scores 1
    path.write_text(json.dumps(_record(0, "t", all_classes=["a0", "b"])) + "\n")
    (record,) = lb.read_longbench_jsonl(path, dataset)
    assert longbench_sample_score(dataset, "a0", record.answers, record.all_classes) == 1.0


def test_classification_metric_refuses_missing_classes():
    with pytest.raises(ValueError, match="trec is scored by class names"):
        longbench_sample_score("trec", "Location", ["Location"], None)
    with pytest.raises(ValueError, match="lsht is scored by class names"):
        score_sample("lsht", "体育", ["体育"], all_classes=[])
    assert longbench_sample_score("hotpotqa", "Paris", ["Paris"], None) == 1.0  # other metrics need none


def test_a_row_whose_task_is_not_a_string_is_not_a_result_row():
    row = dict(suite="s", task="t", sample_id="a", model="m", method="full", budget=None, length=10, score=1.0)
    assert is_result_row(row) and is_result_row({**row, "sample_id": 3})
    for key in ("task", "method", "model"):
        assert not is_result_row({**row, key: 5})
    assert not is_result_row({**row, "sample_id": True})
    assert summary_rows([row])[0]["n"] == 1
