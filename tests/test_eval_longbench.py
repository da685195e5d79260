"""LongBench loader, prompts, truncation and scoring on a small official-format fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from slake.eval.longbench import (
    format_longbench_prompt,
    load_longbench,
    longbench_sample,
    longbench_samples,
    split_longbench_prompt,
    truncate_middle,
)
from slake.eval.longbench_config import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    LONGBENCH_DATASETS,
    LONGBENCH_E_DATASETS,
    NO_CHAT_TEMPLATE_DATASETS,
)
from slake.eval.metrics import DATASET2METRIC, longbench_score, score_sample
from slake.eval.prompts import build_prompt

try:
    from test_eval_support import WordTokenizer
except ImportError:  # pragma: no cover
    from tests.test_eval_support import WordTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"


def test_config_covers_all_v1_datasets():
    assert len(LONGBENCH_DATASETS) == 21
    assert set(DATASET2PROMPT) == set(DATASET2MAXLEN) == set(DATASET2METRIC)
    assert NO_CHAT_TEMPLATE_DATASETS == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert all(e[:-2] in DATASET2PROMPT for e in LONGBENCH_E_DATASETS)
    assert DATASET2MAXLEN["gov_report"] == 512 and DATASET2MAXLEN["hotpotqa"] == 32
    for name, template in DATASET2PROMPT.items():
        assert "{context}" in template, name
        assert template.index("{context}") < template.find("{input}") or "{input}" not in template


def test_load_and_format():
    records = load_longbench("hotpotqa", FIXTURES)
    assert [r.id for r in records] == ["hp-0001", "hp-0002"]
    r = records[1]
    assert r.answers == ["William Shakespeare", "Shakespeare"] and r.all_classes is None
    prompt = format_longbench_prompt(r)
    assert prompt == DATASET2PROMPT["hotpotqa"].format(context=r.context, input=r.input)
    head, tail = split_longbench_prompt(r)
    assert head + tail == prompt and head.endswith(r.context) and tail.endswith("Question: Who wrote Hamlet?\nAnswer:")
    assert load_longbench("trec", FIXTURES)[0].all_classes[1] == "City"
    assert load_longbench("hotpotqa", FIXTURES, limit=1)[0].id == "hp-0001"


def test_env_dir_and_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("SLAKE_LONGBENCH_DIR", str(FIXTURES))
    assert len(load_longbench("lcc")) == 1
    with pytest.raises(FileNotFoundError, match="LongBench JSONL"):
        load_longbench("qasper", tmp_path)
    with pytest.raises(KeyError):
        load_longbench("not_a_dataset", FIXTURES)


def test_truncate_middle_keeps_first_and_last_halves():
    tok = WordTokenizer()
    text = " ".join(f"w{i}" for i in range(100))  # 199 tokens (words and spaces)
    ids = tok.encode(text)
    out = truncate_middle(text, tok, 20)
    assert out == tok.decode(ids[:10]) + tok.decode(ids[-10:])
    assert out.startswith("w0 w1 w2 w3 w4") and out.endswith("w95 w96 w97 w98 w99")
    assert len(tok.encode(out)) <= 20
    assert truncate_middle(text, tok, 500) == text


def test_samples_and_truncation():
    tok = WordTokenizer()
    r = load_longbench("hotpotqa", FIXTURES)[0]
    s = longbench_sample(r, tok)
    assert s.metric == "hotpotqa" and s.max_new_tokens == 32 and s.use_chat_template
    assert s.context + s.question == format_longbench_prompt(r)
    assert s.length > 140
    short = longbench_sample(r, tok, max_length=140)
    assert short.metadata["truncated"] and short.length <= 140
    assert short.question == s.question  # the question survives in the kept last half
    assert short.context.startswith("Answer the question based on the given passages.")
    trec = longbench_sample(load_longbench("trec", FIXTURES)[0], tok)
    assert not trec.use_chat_template and trec.metadata["all_classes"][0] == "Individual"
    chat = WordTokenizer(chat=True)
    assert build_prompt(trec, chat) == trec.context + trec.question  # few-shot: no chat template
    tiny = longbench_sample(r, tok, max_length=40)  # the cut reaches into the question part
    assert tiny.question == "" and tiny.context.endswith("Answer:")
    lcc = longbench_sample(load_longbench("lcc", FIXTURES)[0], tok)
    assert lcc.question == "Next line of code:\n"


def test_scoring_the_fixture():
    preds = {
        "hotpotqa": ["Paris.", "It was Shakespeare"],
        "trec": ["City\nCountry"],
        "lcc": ["    return a * b\n"],
        "multifieldqa_zh": ["北京"],
    }
    # "It was Shakespeare" vs "Shakespeare": p = 1/3, r = 1 -> F1 0.5 (beats 0.4 vs "William Shakespeare")
    expected = {"hotpotqa": 100 * (1 + 0.5) / 2, "trec": 100.0, "lcc": 100.0, "multifieldqa_zh": 100.0}
    for name, p in preds.items():
        records = load_longbench(name, FIXTURES)
        samples = longbench_samples(records, WordTokenizer())
        score = longbench_score(name, p, [r.answers for r in records], records[0].all_classes)
        assert score == pytest.approx(expected[name], abs=0.01), name
        per_sample = [
            score_sample(s.metric, pr, s.answers, all_classes=s.metadata["all_classes"]) for s, pr in zip(samples, p)
        ]
        assert 100 * sum(per_sample) / len(per_sample) == pytest.approx(expected[name], abs=0.01)


def _official_zip(tmp_path):
    """A data.zip laid out like the hub's: data/<dataset>.jsonl."""
    import zipfile

    path = tmp_path / "data.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for f in FIXTURES.glob("*.jsonl"):
            archive.write(f, f"data/{f.name}")
    return path


def test_hub_path_reads_the_official_archive(monkeypatch, tmp_path):
    from slake.eval import longbench as lb

    archive = _official_zip(tmp_path)
    calls = []

    def fake_download(repo_id, filename, repo_type=None):
        calls.append((repo_id, filename, repo_type))
        return str(archive)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.delenv("SLAKE_LONGBENCH_DIR", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError):
        load_longbench("hotpotqa", empty)  # no hub unless asked
    got = load_longbench("hotpotqa", empty, use_hub=True)
    assert calls == [("THUDM/LongBench", "data.zip", "dataset")]
    want = load_longbench("hotpotqa", FIXTURES)
    assert [(r.id, r.context, r.input, r.answers) for r in got] == [(r.id, r.context, r.input, r.answers) for r in want]
    assert load_longbench("hotpotqa", FIXTURES, use_hub=True)[0].id == "hp-0001" and len(calls) == 1  # local first
    with pytest.raises(FileNotFoundError, match="has no qasper.jsonl"):
        lb.read_longbench_archive(archive, "qasper")


def test_hub_download_failure_says_what_to_do(monkeypatch, tmp_path):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    monkeypatch.delenv("SLAKE_LONGBENCH_DIR", raising=False)
    with pytest.raises(ConnectionError, match="(?s)no network.*--longbench-dir"):
        load_longbench("hotpotqa", tmp_path, use_hub=True)
    from slake.cli import main

    code = main(
        [
            "eval",
            "--suite",
            "longbench",
            "--tasks",
            "hotpotqa",
            "--longbench-hub",
            "--methods",
            "snapkv",
            "--budgets",
            "128",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2  # one line on stderr, no traceback


def test_plan_suite_longbench_hub(monkeypatch, tmp_path):
    import huggingface_hub

    from slake.eval.longbench_config import LONGBENCH_DATASETS
    from slake.eval.suites import plan_suite

    archive = _official_zip(tmp_path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(archive))
    monkeypatch.delenv("SLAKE_LONGBENCH_DIR", raising=False)
    with pytest.raises(ValueError, match="--longbench-hub"):
        plan_suite("longbench", ["hotpotqa"])
    plan = plan_suite("longbench", ["hotpotqa", "trec"], longbench_hub=True, samples=1)
    assert plan.tasks == ["hotpotqa", "trec"] and plan.longbench_records["trec"][0].all_classes[1] == "City"
    with pytest.raises(FileNotFoundError):  # no tasks with the hub: all 21 v1 datasets, and the fake zip lacks most
        plan_suite("longbench", None, longbench_hub=True)
    assert len(LONGBENCH_DATASETS) == 21


def test_a_code_lines_indentation_reaches_the_metric():
    """The runner stripped every prediction, so an lcc answer generated exactly as the gold line
    (``"    return a * b"``) lost its indentation and scored 0.86 instead of 1 (LongBench's ``pred.py`` keeps the text
    as generated)."""
    from slake.eval.longbench import read_longbench_jsonl
    from slake.eval.metrics import score_prediction
    from slake.eval.runner import decode_text

    tok = WordTokenizer()
    sample = longbench_sample(
        read_longbench_jsonl(FIXTURES / "lcc.jsonl", "lcc")[0], tok, max_length=4096, dataset="lcc"
    )
    gold = sample.answers[0]
    assert gold.startswith("    ")
    eos = len(tok.encode(gold + "\n")) + 1000
    prediction = decode_text(tok, [*tok.encode(gold + "\n"), eos], [eos])
    assert prediction == gold + "\n" and score_prediction(sample, prediction) == 1.0


@pytest.mark.parametrize(
    "line", ["{}", '{"context": "text", "input": "q"}', '{"answers": ["a"]}', '{"context": "", "answers": ["a"]}']
)
def test_a_record_without_answers_or_text_is_refused(tmp_path, line):
    """Such a record was read, scored 0 and counted in every average (2026-11-30)."""
    from slake.eval.longbench import read_longbench_jsonl

    path = tmp_path / "qasper.jsonl"
    path.write_text('{"context": "c", "input": "q", "answers": ["a"]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"line 2: not a LongBench record .*non-empty 'answers'"):
        read_longbench_jsonl(path, "qasper")


def test_a_file_without_records_is_refused(tmp_path):
    from slake.eval.longbench import read_longbench_jsonl

    path = tmp_path / "qasper.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no LongBench record"):
        read_longbench_jsonl(path, "qasper")
