"""An essays JSON file of another shape is refused naming the file (it was a bare KeyError, or a list of numbers
joined into a haystack of digits)."""

from __future__ import annotations

import json

import pytest

from slake.eval.data_sources import paul_graham_essays


def _write(tmp_path, payload) -> str:
    path = tmp_path / "PaulGrahamEssays.json"
    path.write_text(json.dumps(payload), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("payload", [{"essays": "text"}, {"text": 3}, [1, 2, 3], 7])
def test_an_essays_file_of_another_shape_is_refused_naming_it(tmp_path, payload):
    path = _write(tmp_path, payload)
    with pytest.raises(ValueError, match=r"PaulGrahamEssays\.json: the essays JSON must be"):
        paul_graham_essays(path)


def test_rulers_shape_and_a_list_of_texts_still_load(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert paul_graham_essays(_write(tmp_path / "a", {"text": "One. Two."})) == ["One. Two."]
    assert paul_graham_essays(_write(tmp_path / "b", ["One.", "Two."])) == ["One.\nTwo."]
