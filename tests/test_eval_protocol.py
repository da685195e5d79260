"""``slake eval --protocol kvpress``: argument resolution, the ratio mapping, kvpress's RULER scoring, the merge of the
kvpress side's outputs into the results, and the protocol's table and plot (tiny model, fast)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import pytest

from slake.budgets.budget import Budget
from slake.cli.eval import add_eval_parser, cmd_eval
from slake.eval.metrics import kvpress_clean, kvpress_ruler_metric, score_sample
from slake.eval.protocol import (
    PROTOCOLS,
    REQUESTS_FILE,
    budget_of_ratio,
    ratio_of_budget,
    resolve_protocol_args,
)
from slake.eval.protocol_outputs import OUTPUTS_FILE, kvpress_rows, merge_outputs
from slake.eval.protocol_report import write_protocol_report
from slake.eval.results import ResultsWriter, is_result_row, read_results, row_key
from slake.eval.runner import parse_budgets
from slake.eval.summary import write_summary

KVPRESS = PROTOCOLS["kvpress"]


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", "--methods", "snapkv", "--out", "unused", *extra])


# ---------------------------------------------------------------------------------------------- argument resolution


def test_protocol_sets_suite_length_budgets_and_question_agnostic():
    args = _args("--protocol", "kvpress")
    assert resolve_protocol_args(args) is KVPRESS
    assert (args.suite, args.lengths, args.question_agnostic) == ("ruler", "4096", True)
    assert parse_budgets(args.budgets) == [0.75, 0.5, 0.25, 0.125]
    # repeating the protocol's own values is accepted
    args = _args("--protocol", "kvpress", "--suite", "ruler", "--lengths", "4096", "--question-agnostic")
    assert resolve_protocol_args(args) is KVPRESS and args.budgets == "0.75,0.5,0.25,0.125"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budgets", "128"], "drop --budgets"),
        (["--suite", "needle"], "drop --suite"),
        (["--lengths", "2048"], "drop --lengths"),
        (["--lengths", "4096,8192"], "drop --lengths"),
        (["--batch-size", "2"], "drop --batch-size"),
        (["--fidelity"], "drop --fidelity"),
        (["--prefill-chunk", "512"], "drop --prefill-chunk"),
        (["--no-chat-template"], "drop --no-chat-template"),
    ],
)
def test_protocol_refuses_what_contradicts_it(extra, message):
    with pytest.raises(ValueError, match=message):
        resolve_protocol_args(_args("--protocol", "kvpress", *extra))


def test_without_protocol_suite_and_budgets_are_required():
    with pytest.raises(ValueError, match="--suite is required"):
        resolve_protocol_args(_args("--budgets", "64"))
    with pytest.raises(ValueError, match="--budgets is required"):
        resolve_protocol_args(_args("--suite", "needle"))
    args = _args("--suite", "needle", "--budgets", "64")
    assert resolve_protocol_args(args) is None and args.budgets == "64"


def test_cmd_eval_refuses_a_contradiction_before_loading():
    class NoEngine:
        def __getattr__(self, name):
            raise AssertionError("the engine must not be touched")

    with pytest.raises(ValueError, match="drop --budgets"):
        cmd_eval(_args("--protocol", "kvpress", "--budgets", "0.5"), engine=NoEngine())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- ratio mapping


def test_compression_ratio_is_the_fraction_removed_budget_the_fraction_kept():
    assert [budget_of_ratio(r) for r in KVPRESS.compression_ratios] == [0.75, 0.5, 0.25, 0.125]
    assert KVPRESS.budgets == [0.75, 0.5, 0.25, 0.125]
    for r in KVPRESS.compression_ratios:
        assert ratio_of_budget(budget_of_ratio(r)) == r
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            budget_of_ratio(bad)
        with pytest.raises(ValueError):
            ratio_of_budget(bad)


def test_kept_counts_match_kvpress_within_one_token():
    """kvpress keeps ``int(S * (1 - ratio))`` (floor), slake ``ceil(budget * S)``: equal when the product is an
    integer, one more token otherwise."""
    for S in range(97, 5000, 41):
        for r in KVPRESS.compression_ratios:
            ours = Budget(budget_of_ratio(r)).tokens(S)
            theirs = int(S * (1 - r))
            exact = S * (1 - r)
            assert ours - theirs == (0 if exact == math.floor(exact) else 1), (S, r)


# ---------------------------------------------------------------------------------------------- scoring


def _kvpress_string_match_part(preds, refs):  # kvpress evaluation/benchmarks/ruler/calculate_metrics.py, verbatim
    score = (
        sum([max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) for pred, ref in zip(preds, refs)])
        / len(preds)
        * 100
    )
    return round(score, 2)


def _kvpress_string_match_all(preds, refs):  # idem
    score = (
        sum(
            [sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref) for pred, ref in zip(preds, refs)]
        )
        / len(preds)
        * 100
    )
    return round(score, 2)


def _kvpress_calculate_metrics(records):
    """kvpress's ``calculate_metrics`` with the DataFrame replaced by a list of (task, prediction, answers)."""
    np_pattern = re.compile(r"[\x00-\x1f]")
    tasks: dict[str, tuple[list, list]] = {}
    for task, pred, answers in records:
        preds, refs = tasks.setdefault(task, ([], []))
        preds.append(np_pattern.sub("", pred.strip()).strip())
        refs.append(answers)
    scores = {}
    for task, (preds, refs) in tasks.items():
        fn = _kvpress_string_match_part if task.split("_")[0] == "qa" else _kvpress_string_match_all
        scores[task] = {"string_match": fn(preds, refs)}
    return scores


HAND_MADE = [
    ("niah_single_1", "The special magic number is 7754517.", ["7754517"]),
    ("niah_single_1", " 77545\n17 ", ["7754517"]),  # the newline is removed before matching: a hit for kvpress
    ("niah_single_1", "7754518", ["7754517"]),
    ("niah_multivalue", "Values: 111, 222\tand 3\n33", ["111", "222", "333", "444"]),  # 3 of 4
    ("niah_multivalue", "AbC and dEf", ["abc", "DEF"]),  # case-insensitive
    ("vt", "X1, X2\x00, x3", ["X1", "X2", "X3", "X4", "X5"]),
    ("vt", "", ["X1"]),
    ("qa_1", "The answer is Paris\n", ["paris", "Lyon"]),  # part: any answer
    ("qa_1", "London", ["paris", "Lyon"]),
    ("qa_2", "Lyon and Paris", ["paris", "Lyon"]),
]


def test_scoring_matches_kvpress_calculate_metrics():
    reference = _kvpress_calculate_metrics(HAND_MADE)
    ours: dict[str, list[float]] = {}
    for task, pred, answers in HAND_MADE:
        ours.setdefault(task, []).append(score_sample(KVPRESS.metric(task), pred, answers))
    assert set(ours) == set(reference)
    for task, values in ours.items():
        assert round(100 * sum(values) / len(values), 2) == reference[task]["string_match"], task
    assert reference["niah_single_1"]["string_match"] == round(200 / 3, 2)  # the hand-made cases say what they mean


def test_kvpress_cleaning_and_metric_names():
    assert kvpress_clean("  a\nb\tc\x1f  ") == "abc"
    assert kvpress_ruler_metric("qa_1") == "kvpress:part" == kvpress_ruler_metric("qa_2")
    assert {kvpress_ruler_metric(t) for t in ("niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe")} == {
        "kvpress:all"
    }
    # RULER's own metric (no cleaning) differs on a split answer; the protocol's does not
    assert score_sample("all", "77545\n17", ["7754517"]) == 0.0
    assert score_sample("kvpress:all", "77545\n17", ["7754517"]) == 1.0


# ---------------------------------------------------------------------------------------------- merge


def _requests():
    return {
        "protocol": "kvpress",
        "model": "tiny",
        "model_path": "tiny",
        "gguf_file": None,
        "eos_token_ids": [2],
        "compression_ratios": list(KVPRESS.compression_ratios),
        "seed": 0,
        "requests": [
            {
                "task": task,
                "sample_id": f"{task}-4096-{i}",
                "length": 4096,
                "prefill_ids": [5] * 10,
                "question_ids": [6] * 3,
                "max_new_tokens": 8,
                "answers": answers,
                "metric": KVPRESS.metric(task),
                "depth": None,
            }
            for task, answers in (("niah_single_1", ["123"]), ("qa_1", ["paris", "lyon"]))
            for i in range(2)
        ],
    }


def _outputs():
    out = []
    for task, good in (("niah_single_1", "is 123"), ("qa_1", "Paris")):
        for i in range(2):
            sid = f"{task}-4096-{i}"
            out.append({"sample_id": sid, "press": "no_press", "compression_ratio": None, "tokens": [1], "text": good})
            for r in KVPRESS.compression_ratios:
                text = good if r < 0.75 else "no idea"
                out.append(
                    {"sample_id": sid, "press": "snapkv", "compression_ratio": r, "tokens": [1, 2], "text": text}
                )
    return out


def test_kvpress_outputs_become_rows_scored_like_ours():
    rows = kvpress_rows(_requests(), _outputs())
    assert len(rows) == 4 * 5 and all(is_result_row(r) for r in rows)
    assert len({row_key(r) for r in rows}) == len(rows)
    assert {r["method"] for r in rows} == {"kvpress:no_press", "kvpress:snapkv"}
    assert {r["budget"] for r in rows if r["method"] == "kvpress:snapkv"} == {0.75, 0.5, 0.25, 0.125}
    assert all(r["budget"] is None and not r["compressed"] for r in rows if r["method"] == "kvpress:no_press")
    for r in rows:
        assert r["score"] == (1.0 if r["compression_ratio"] is None or r["compression_ratio"] < 0.75 else 0.0)
        assert r["query_aware"] is False and r["metric"] == KVPRESS.metric(r["task"]) and r["prompt_tokens"] == 13
    # an output of a sample the requests do not hold (another run's) is skipped
    assert kvpress_rows(_requests(), [{**_outputs()[0], "sample_id": "other"}]) == []


def test_merge_resumes_and_one_summary_and_table_hold_both(tmp_path):
    (tmp_path / REQUESTS_FILE).write_text(json.dumps(_requests()))
    assert merge_outputs(tmp_path) == 0  # no outputs yet
    with open(tmp_path / OUTPUTS_FILE, "w") as fh:
        for o in _outputs():
            fh.write(json.dumps(o) + "\n")
        fh.write('{"sample_id": "cut')  # an interrupted write
    ours = []
    for q in _requests()["requests"]:
        for method, budget in [("full", None)] + [("snapkv", b) for b in KVPRESS.budgets]:
            ours.append(
                {
                    "suite": "ruler",
                    "task": q["task"],
                    "sample_id": q["sample_id"],
                    "model": "tiny",
                    "method": method,
                    "budget": budget,
                    "length": 4096,
                    "score": 1.0 if budget is None or budget >= 0.5 else 0.5,
                    "query_aware": False,
                }
            )
    with ResultsWriter(tmp_path) as w:
        for r in ours:
            w.write(r)
    assert merge_outputs(tmp_path) == 20
    assert merge_outputs(tmp_path) == 0  # resumed: nothing twice
    rows = read_results(tmp_path)
    assert len(rows) == 20 + len(ours)
    md, _ = write_summary(tmp_path, rows)
    text = md.read_text()
    assert "| kvpress:snapkv | 0.25 |" in text and "| snapkv | 0.25 |" in text
    paths = write_protocol_report(tmp_path, rows, KVPRESS, plots=True)
    table = paths[0].read_text()
    assert table.index("| full |") < table.index("| kvpress:no_press |") < table.index("| snapkv |")
    assert table.index("| snapkv |") < table.index("| kvpress:snapkv |")
    assert "| 0.25 | 0.5 | 0.75 | 0.875 | n |" in table
    snap = next(line for line in table.splitlines() if line.startswith("| kvpress:snapkv |"))
    assert snap.split("|")[2].strip().startswith("100.0") and snap.split("|")[4].strip().startswith("0.0")
    csv_lines = paths[1].read_text().splitlines()
    assert csv_lines[0] == "samples,model,method,compression_ratio,budget,average,low,high,n"
    assert any(line.startswith("all,tiny,kvpress:snapkv,0.875,0.125,0.00") for line in csv_lines)
    assert paths[2].name == "score_vs_ratio_kvpress.png" and paths[2].stat().st_size > 0
    # our methods on a sample kvpress's side did not run: the table first compares every line on the common samples
    extra = {**ours[1], "sample_id": "niah_single_1-4096-9", "score": 0.0}
    table = write_protocol_report(tmp_path, [*rows, extra], KVPRESS, plots=False)[0].read_text()
    assert table.index("the samples both sides ran") < table.index("every sample")
    assert table.count("| snapkv |") == 2
    common, every = (t.split("| snapkv |")[1].split("|")[0] for t in table.split("## model")[1:3])
    assert common.strip().startswith("100.0") and not every.strip().startswith("100.0")


def test_a_cell_of_one_sample_per_task_shows_no_interval(tmp_path):
    """With one sample per task the bootstrap measures no uncertainty (:mod:`slake.eval.stats`): the cell shows the
    average alone, not a zero-width interval (nor ``[nan, nan]``)."""
    rows = [
        _report_row(task, 0, method, budget, score, metric=None)
        for task in ("niah_single_1", "vt")
        for method, budget, score in (("full", None, 1.0), ("snapkv", 0.25, 0.5))
    ]
    md = write_protocol_report(tmp_path, rows, KVPRESS, plots=False)[0].read_text()
    snap = next(line for line in md.splitlines() if line.startswith("| snapkv |"))
    assert snap.split("|")[4].strip() == "50.0" and "nan" not in md  # ratio 0.75: budget 0.25


def _report_row(task, i, method, budget, score, metric="kvpress:all"):
    """A question-agnostic RULER row at 4096 tokens of the tiny model (``metric`` None: a row that names none)."""
    row = {
        "suite": "ruler",
        "task": task,
        "sample_id": f"{task}-4096-{i}",
        "model": "tiny",
        "method": method,
        "budget": budget,
        "length": 4096,
        "score": score,
        "query_aware": False,
        "metric": metric,
    }
    return row if metric is not None else {k: v for k, v in row.items() if k != "metric"}


def test_the_table_leaves_out_rows_scored_with_another_metric(tmp_path):
    """A plain ``--suite ruler --lengths 4096 --question-agnostic`` run may have left rows of other samples in the
    folder, scored with RULER's own metric (no kvpress cleaning): the table, which says it is scored as kvpress
    scores it, does not average them in."""
    rows = [
        _report_row(task, i, method, budget, 1.0)
        for task in ("niah_single_1", "niah_single_2")
        for i in range(2)
        for method, budget in (("full", None), ("snapkv", 0.5))
    ]
    rows += [
        _report_row("vt", 0, method, budget, 0.0, metric="all") for method, budget in (("full", None), ("snapkv", 0.5))
    ]
    md = write_protocol_report(tmp_path, rows, KVPRESS, plots=False)[0].read_text()
    assert "Tasks: niah_single_1, niah_single_2;" in md and "vt" not in md.split("## model")[1]
    snap = next(line for line in md.splitlines() if line.startswith("| snapkv |"))
    assert snap.split("|")[3].strip() == "100.0 [100.0, 100.0]"  # ratio 0.5, over the two niah tasks only


def test_a_line_over_fewer_tasks_is_marked(tmp_path):
    """A line without samples in every task of its table averages its own tasks (:class:`SummaryLine.complete`), as
    ``summary.md`` marks with †: the protocol's table marks it too, so that an average over one task is not read
    beside averages over all of them (``ada-criticalkv`` ran one sample of one task in the SmolLM2 results)."""
    rows = [
        _report_row(task, i, method, budget, 1.0)
        for task in ("niah_single_1", "niah_single_2")
        for i in range(2)
        for method, budget in (("full", None), ("snapkv", 0.5))
    ]
    rows.append(_report_row("niah_single_1", 0, "ada-criticalkv", 0.5, 1.0))
    rows += [_report_row("niah_single_2", i, "tova", 0.5, 0.0) for i in range(2)]
    paths = write_protocol_report(tmp_path, rows, KVPRESS, plots=True)
    text = paths[0].read_text()
    assert text.count("## model") == 1  # one section: no kvpress rows, every line on the same samples
    cells = {  # method -> its cell at ratio 0.5
        line.split("|")[1].strip(): line.split("|")[3].strip()
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| method")
    }
    assert cells["snapkv"] == "100.0 [100.0, 100.0]"  # both tasks: unmarked
    assert cells["ada-criticalkv"] == "100.0 †" and cells["tova"] == "0.0 † [0.0, 0.0]"
    assert "marked † is over the line's own tasks" in text
    assert paths[2].stat().st_size > 0


# ---------------------------------------------------------------------------------------------- end to end


def test_cmd_eval_protocol_end_to_end(llama_gqa, tmp_path, monkeypatch, capsys):
    """The protocol on a tiny model (at 400 tokens instead of 4096): question-agnostic rows scored as kvpress scores
    them, the token ids written for the kvpress side, its outputs merged into one table on the next run."""
    from slake.engines.transformers import TransformersEngine
    from slake.eval import suites
    from slake.eval.runner import encode_sample
    from test_eval_runner import TinyTokenizer, _loader

    monkeypatch.setitem(PROTOCOLS, "kvpress", dataclasses.replace(KVPRESS, length=400))
    tok = TinyTokenizer()
    real_build = suites.build_samples
    built = []

    def build(plan, tokenizer):
        built[:] = real_build(plan, tokenizer)
        return built

    monkeypatch.setattr(suites, "build_samples", build)
    out = tmp_path / "run"
    argv = ["--protocol", "kvpress", "--tasks", "niah_single_1", "--samples", "1", "--max-new-tokens", "3"]
    args = _args(*argv, "--model", "tiny", "--no-progress")
    args.out = str(out)
    engine = TransformersEngine(loader=_loader(llama_gqa, tok))
    assert cmd_eval(args, engine=engine) == 0
    rows = read_results(out)
    assert {(r["method"], r["budget"]) for r in rows} == {("full", None)} | {
        ("snapkv", b) for b in (0.75, 0.5, 0.25, 0.125)
    }
    assert all(r["metric"] == "kvpress:all" and r["query_aware"] is False and r["length"] == 400 for r in rows)
    requests = json.loads((out / REQUESTS_FILE).read_text())
    assert requests["compression_ratios"] == [0.25, 0.5, 0.75, 0.875] and requests["model"] == "tiny"
    (req,) = requests["requests"]
    assert (req["prefill_ids"], req["question_ids"]) == tuple(encode_sample(built[0], tok, query_aware=False))
    assert req["max_new_tokens"] == 3 and req["question_ids"]
    full = next(r for r in rows if r["method"] == "full")
    with open(out / OUTPUTS_FILE, "w") as fh:
        fh.write(
            json.dumps(
                {
                    "sample_id": req["sample_id"],
                    "press": "no_press",
                    "compression_ratio": None,
                    "tokens": [0] * full["new_tokens"],
                    "text": full["prediction"],
                }
            )
            + "\n"
        )
    args = _args(*argv, "--model", "tiny", "--no-progress")
    args.out = str(out)
    assert cmd_eval(args, engine=engine) == 0
    merged = [r for r in read_results(out) if r["method"] == "kvpress:no_press"]
    assert len(merged) == 1 and merged[0]["score"] == full["score"]
    assert "| kvpress:no_press |" in (out / "protocol_kvpress.md").read_text()
    assert (out / "score_vs_ratio_kvpress.png").is_file()
    assert "merged 1 rows" in capsys.readouterr().err
