"""slake.eval.compare: lines from several result folders merged and compared on their common samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slake.eval.compare import compare_lines, main, merge_lines, parse_line, write_comparison


def _row(method: str, budget, task: str, i: int, score: float, kl: float | None = None) -> dict:
    r = {
        "suite": "ruler",
        "task": task,
        "sample_id": f"{task}-8192-{i}",
        "model": "m",
        "method": method,
        "budget": budget,
        "length": 8192,
        "prediction": "x",
        "answers": ["x"],
        "score": score,
    }
    if kl is not None:
        r["kl"] = kl
    return r


def _folder(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture
def two_runs(tmp_path):
    """Folder a: full + cake (score 0, KL 0.5); folder b: full + cake (score 1, KL 0.3) on the same 6 samples, and one
    sample only b has."""
    tasks = ["t1", "t2"]
    a, b = [], []
    for t in tasks:
        for i in range(3):
            a += [_row("full", None, t, i, 1.0), _row("cake", 128, t, i, 0.0, 0.5 + 0.01 * i)]
            b += [_row("full", None, t, i, 1.0), _row("cake", 128, t, i, 1.0, 0.3 + 0.01 * i)]
    b.append(_row("cake", 128, "t1", 9, 0.0, 2.0))
    return _folder(tmp_path, "a", a), _folder(tmp_path, "b", b)


def test_parse_line_keeps_colons_in_the_label_and_refuses_missing_parts():
    line = parse_line("runs/x:slake[vabs=false]:CAKE + PTAA: calibrated")
    assert (str(line.folder), line.method, line.label) == ("runs/x", "slake[vabs=false]", "CAKE + PTAA: calibrated")
    for bad in ("runs/x:cake", "runs/x::label", ":cake:label"):
        with pytest.raises(ValueError, match="DIR:METHOD:LABEL"):
            parse_line(bad)


def test_merge_renames_lines_and_takes_the_full_cache_once(two_runs):
    a, b = two_runs
    rows = merge_lines([parse_line(f"{a}:cake:default"), parse_line(f"{b}:cake:calibrated")])
    methods = [r["method"] for r in rows]
    assert methods.count("full") == 6  # one per sample, not one per folder
    assert methods.count("default") == 6 and methods.count("calibrated") == 7


def test_merge_refuses_duplicate_labels_missing_methods_and_folders(two_runs, tmp_path):
    a, b = two_runs
    with pytest.raises(ValueError, match="labels must differ"):
        merge_lines([parse_line(f"{a}:cake:x"), parse_line(f"{b}:cake:x")])
    # the same line twice (first of two pairs) counts once
    assert len(merge_lines([parse_line(f"{a}:cake:x"), parse_line(f"{a}:cake:x")])) == 12
    with pytest.raises(ValueError, match="full"):
        merge_lines([parse_line(f"{a}:cake:full")])
    with pytest.raises(ValueError, match="no row of 'snapkv'.*cake"):
        merge_lines([parse_line(f"{a}:snapkv:x")])
    with pytest.raises(ValueError, match="no results.jsonl"):
        merge_lines([parse_line(f"{tmp_path / 'nowhere'}:cake:x")])


def test_compare_gives_second_minus_first_on_common_samples(two_runs):
    a, b = two_runs
    rows = merge_lines([parse_line(f"{a}:cake:default"), parse_line(f"{b}:cake:calibrated")])
    (c,) = compare_lines(rows, ["default", "calibrated"], resamples=200)
    assert (c.first, c.second, c.length, c.budget) == ("default", "calibrated", 8192, 128)
    assert c.score.n == 6  # the sample only b has is left out
    assert c.score.diff == pytest.approx(100.0) and c.score.significant
    assert c.kl is not None and c.kl.diff == pytest.approx(-0.2) and c.kl.significant
    with pytest.raises(ValueError, match="pairs"):
        compare_lines(rows, ["default"], resamples=200)


def test_write_comparison_and_command_line(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "cmp"
    assert main([str(out), f"{a}:cake:default", f"{b}:cake:calibrated", "--resamples", "200"]) == 0
    md = (out / "comparison.md").read_text()
    assert "| calibrated - default | 8192 | 128 | **+100.0** |" in md and "**-0.200**" in md
    assert (out / "summary.md").is_file() and (out / "comparison.csv").read_text().startswith("first,second")
    assert len((out / "results.jsonl").read_text().splitlines()) == 19
    assert main([str(tmp_path / "bad"), f"{a}:cake"]) == 2
    assert "DIR:METHOD:LABEL" in capsys.readouterr().err
    # an existing comparison is replaced, not appended to
    write_comparison(out, [parse_line(f"{a}:cake:default"), parse_line(f"{b}:cake:calibrated")], resamples=200)
    assert len((out / "results.jsonl").read_text().splitlines()) == 19


def test_a_line_names_its_method_as_any_spelling_of_its_spec(tmp_path):
    """``slake[window=8,VABS=false]`` names the rows written as ``slake[vabs=false,window=8]``, as the method specs
    promise; it found none (2026-11-30). A chunked-prefill suffix is kept, and a row of an unknown method matches only
    its own string."""
    rows = [_row("slake[vabs=false,window=8]", 128, "t", i, 1.0) for i in range(2)]
    rows += [_row("cake (prefill_chunk=64)", 128, "t", i, 1.0) for i in range(2)]
    rows += [_row("no-such-method[x=1]", 128, "t", i, 1.0) for i in range(2)]
    d = _folder(tmp_path, "a", rows)
    for spelling in ("slake[window=8,VABS=false]", "SLAKE[vabs=false, window=8]", "slake[vabs=false,window=8]"):
        assert len(merge_lines([parse_line(f"{d}:{spelling}:X")])) == 2
    assert len(merge_lines([parse_line(f"{d}:CAKE (prefill_chunk=64):X")])) == 2
    assert len(merge_lines([parse_line(f"{d}:no-such-method[x=1]:X")])) == 2
    with pytest.raises(ValueError, match="has no row of"):
        merge_lines([parse_line(f"{d}:slake[window=8]:X")])


def test_two_spellings_of_one_spec_for_one_sample_are_refused(tmp_path):
    """``slake eval`` keeps ``slake[alpha=1]`` and ``slake[alpha=1.0]`` apart (it resumes by the spec as written):
    a line matching both counted each sample twice."""
    rows = [_row("slake[alpha=1]", 128, "t", 0, 1.0), _row("slake[alpha=1.0]", 128, "t", 0, 0.0)]
    d = _folder(tmp_path, "a", rows)
    with pytest.raises(ValueError, match="under two spellings"):
        merge_lines([parse_line(f"{d}:slake[alpha=1]:X")])


def test_a_non_finite_kl_is_counted_beside_the_kl_difference(tmp_path):
    """A sample whose KL overflowed (``kl: null``, ``kl_tokens`` > 0) vanished from the KL difference, whose table
    gave the score's n: the line that overflowed looked as close to the full cache as its finite samples."""
    a, b = [], []
    for i in range(4):
        a.append({**_row("cake", 128, "t1", i, 1.0, 0.5), "kl_tokens": 9})
        b.append({**_row("cake", 128, "t1", i, 1.0, 0.1), "kl_tokens": 9})
    b[3] = {**b[3], "kl": None}  # overflowed
    b[2] = {**b[2], "kl": float("nan")}  # a NaN written by another tool: JSON's NaN, which the reader accepts
    lines = [parse_line(f"{_folder(tmp_path, 'a', a)}:cake:A"), parse_line(f"{_folder(tmp_path, 'b', b)}:cake:B")]
    (c,) = compare_lines(merge_lines(lines), ["A", "B"], resamples=200)
    assert c.score.n == 4 and c.kl is not None and c.kl.n == 2 and c.kl_nonfinite == 2
    assert c.kl.diff == pytest.approx(-0.4)
    write_comparison(tmp_path / "out", lines, resamples=200)
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "| 4 | 2 (2 non-finite left out) |" in md
    csv_text = (tmp_path / "out" / "comparison.csv").read_text().splitlines()
    assert csv_text[0].endswith(",n,kl_n,kl_nonfinite") and csv_text[1].endswith(",4,2,2")


def test_rows_of_another_prompt_under_the_same_sample_id_are_refused(tmp_path):
    """A sample id names the task, length and seed, not the text: two folders made from different prompts (another
    essay source, a generator whose wording changed) were paired sample by sample as if they were one."""
    a = [
        {**_row(m, bud, "t1", i, 1.0), "sample_digest": f"d{i}"}
        for i in range(3)
        for m, bud in (("full", None), ("cake", 128))
    ]
    b = [dict(r) for r in a]
    dir_a, same = _folder(tmp_path, "a", a), _folder(tmp_path, "same", b)
    assert len(merge_lines([parse_line(f"{dir_a}:cake:A"), parse_line(f"{same}:cake:B")])) == 9
    b[3] = {**b[3], "sample_digest": "other"}  # cake's row of sample 1 answers another prompt
    other = _folder(tmp_path, "other", b)
    with pytest.raises(ValueError, match="'t1-8192-1'.*another prompt"):
        merge_lines([parse_line(f"{dir_a}:cake:A"), parse_line(f"{other}:cake:B")])
    # rows written before the digest existed are not checked
    old = _folder(tmp_path, "old", [{k: v for k, v in r.items() if k != "sample_digest"} for r in b])
    assert len(merge_lines([parse_line(f"{dir_a}:cake:A"), parse_line(f"{old}:cake:B")])) == 9
