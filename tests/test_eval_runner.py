"""The evaluation runner, summaries, plots and the ``slake eval`` / ``slake make-prompt`` commands, end to end on a
tiny random model (predictions are garbage; the wiring is what is tested)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import slake
from slake.cli.eval import add_eval_parser, cmd_eval
from slake.cli.make_prompt import add_make_prompt_parser, cmd_make_prompt
from slake.engines.transformers import TransformersEngine
from slake.engines.transformers import evaluate as engine_eval
from slake.eval.needle import needle_grid
from slake.eval.results import ResultsWriter, read_results, row_key
from slake.eval.runner import encode_sample, parse_budgets, resolve_methods, run_suite
from slake.eval.summary import summary_rows, write_summary
from test_eval_support import WordTokenizer, fake_essays

ESSAYS = fake_essays(n_essays=4, sentences=60)
JSON_KEYS = {"suite", "task", "length", "method", "budget", "n", "score"}


class TinyTokenizer(WordTokenizer):
    """WordTokenizer folded into a 256-id vocabulary (0 pad, 1 BOS, 2 EOS), with the ``__call__`` and padding
    attributes that :func:`slake.generate` uses."""

    pad_token, pad_token_id, eos_token, eos_token_id = "<pad>", 0, "</s>", 2
    padding_side = "left"

    def __init__(self) -> None:
        super().__init__(chat=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + [3 + i % 250 for i in super().encode(text)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        return "".join(
            self._pieces[i - 3] if 3 <= i < 3 + len(self._pieces) else ("" if i < 3 else f"<{i}>")
            for i in ids
            if not (skip_special_tokens and i < 3)
        )

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=True):
        rows = [self.encode(t, add_special_tokens) for t in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


@pytest.fixture(scope="module")
def needle_samples(tok):
    return needle_grid(tok, [200, 280], [0, 100], seed=1, essays=ESSAYS, max_new_tokens=4)


def _eval_args(out, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(
        [
            "eval",
            "--suite",
            "needle",
            "--methods",
            "snapkv,h2o",
            "--budgets",
            "40,4096",
            "--lengths",
            "200,280",
            "--depths",
            "0,100",
            "--samples",
            "1",
            "--seed",
            "1",
            "--max-new-tokens",
            "3",
            "--model",
            "tiny",
            "--no-progress",
            "--out",
            str(out),
            *extra,
        ]
    )


def _loader(model, tok):
    def load(args):
        return model, tok

    return load


def test_cmd_eval_end_to_end_writes_rows_summary_plots_and_json(llama_gqa, tok, tmp_path, capsys, monkeypatch):
    from slake.eval import suites

    real_build = suites.build_samples
    monkeypatch.setattr(suites, "build_samples", lambda plan, tokenizer: real_build(plan, tokenizer, essays=ESSAYS))
    out = tmp_path / "run"
    assert cmd_eval(_eval_args(out, "--json"), engine=TransformersEngine(loader=_loader(llama_gqa, tok))) == 0
    printed = json.loads(capsys.readouterr().out)
    rows = read_results(out)
    assert len(rows) == 4 * (1 + 2 * 2)  # 2 lengths x 2 depths, full reference + 2 methods x 2 budgets
    for r in rows:
        assert {
            "task",
            "sample_id",
            "model",
            "method",
            "budget",
            "length",
            "prompt_tokens",
            "prediction",
            "answers",
            "score",
            "prefill_s",
            "decode_s",
            "seed",
            "query_aware",
            "compressed",
        } <= set(r)
        assert 0.0 <= r["score"] <= 1.0 and r["new_tokens"] <= 3 and r["model"] == "tiny"
        # a budget above the prompt length is run but marked: no eviction
        assert r["compressed"] == (r["method"] != "full" and r["budget"] == 40)
    # prefill is shared by a sample's rows
    by_sample = {}
    for r in rows:
        by_sample.setdefault(r["sample_id"], set()).add(r["prefill_s"])
    assert all(len(v) == 1 for v in by_sample.values())
    assert printed["rows"] and all(JSON_KEYS <= set(r) for r in printed["rows"])
    assert {(r["method"], r["budget"]) for r in printed["rows"]} == {
        ("full", None),
        ("snapkv", 40),
        ("snapkv", 4096),
        ("h2o", 40),
        ("h2o", 4096),
    }
    md = (out / "summary.md").read_text()
    assert md.index("| full | full |") < md.index("| snapkv | 40 |")
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("model,suite,length,method,budget,needle")
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "needle_full_full.png" in pngs and "needle_snapkv_40.png" in pngs and "score_vs_budget_needle.png" in pngs
    # a rerun resumes: nothing new, nothing duplicated
    assert cmd_eval(_eval_args(out, "--json"), engine=TransformersEngine(loader=_loader(llama_gqa, tok))) == 0
    assert len(read_results(out)) == len(rows)


def test_runner_resumes_without_duplicates_or_extra_prefills(llama_gqa, tok, needle_samples, tmp_path, monkeypatch):
    prefills = []
    real_capture = engine_eval.capture_prefill
    monkeypatch.setattr(engine_eval, "capture_prefill", lambda *a, **k: prefills.append(1) or real_capture(*a, **k))
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    # "interrupted" run: a subset of the samples and of the budgets
    first = run_suite(llama_gqa, tok, needle_samples[:2], ["snapkv"], [32], tmp_path, **kw)
    assert len(first) == 2 * 2 and len(prefills) == 2
    second = run_suite(llama_gqa, tok, needle_samples, ["snapkv"], [32, 64], tmp_path, **kw)
    assert len(second) == 2 * 1 + 2 * 3  # the two done samples only need budget 64
    rows = read_results(tmp_path)
    keys = [row_key(r) for r in rows]
    assert len(keys) == len(set(keys)) == 4 * 3
    prefills.clear()
    assert run_suite(llama_gqa, tok, needle_samples, ["snapkv"], [32, 64], tmp_path, **kw) == []
    assert prefills == []  # samples whose pairs are all done are not prefilled


def test_truncated_last_line_is_repaired(tmp_path):
    good = {"task": "t", "sample_id": "a", "method": "full", "budget": None, "length": 8, "model": "m", "score": 1}
    (tmp_path / "results.jsonl").write_text(json.dumps(good) + "\n" + '{"task": "t", "sample_')
    with ResultsWriter(tmp_path) as store:
        assert not store.write(good)
        assert store.write({**good, "sample_id": "b"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b"]


@pytest.mark.parametrize(
    "methods", [["snapkv", "tova"], ["kvzip", "kvzip[keep_prefix=true]"], ["lava", "criticalkv", "expected-attention"]]
)
def test_runner_prediction_equals_live_generate(llama_gqa, tok, needle_samples, tmp_path, methods):
    """KVzip's answers differed: slake.generate read the prompt's last token over the compressed cache, where the
    evaluation (and slake bench) prefill every prompt token exactly and take the first token from its logits."""
    sample = needle_samples[3]
    rows = run_suite(
        llama_gqa,
        tok,
        [sample],
        methods,
        [40],
        tmp_path,
        model_name="tiny",
        max_new_tokens=6,
        progress=False,
    )
    # the full-cache reference row, then one row per method at the one budget
    assert sorted((row["method"], row["budget"]) for row in rows) == sorted(
        [("full", None)] + [(m, 40) for m in methods]
    )
    for row in rows:
        live = slake.generate(
            llama_gqa,
            tok,
            sample.context + sample.question,
            method=row["method"],
            budget=row["budget"] or 100_000,
            max_new_tokens=row["max_new_tokens"],
        )
        assert row["prediction"] == live.text
        assert row["prompt_tokens"] == live.prompt_tokens[0]
        assert row["compressed"] == live.compressed


@pytest.mark.parametrize("method", ["snapkv", "slake", "h2o"])
def test_chunked_runner_prediction_equals_live_generate(llama_gqa, tok, needle_samples, tmp_path, method):
    """With ``prefill_chunk``, slake.generate prefilled the prompt but its last token in chunks and fed that token
    as a decode step, where the evaluation (and slake bench) prefill the whole prompt in chunks and take the first
    token from the last chunk's logits: their answers differed."""
    sample = needle_samples[3]
    rows = run_suite(
        llama_gqa, tok, [sample], [method], [40], tmp_path, model_name="tiny", max_new_tokens=6, progress=False,
        prefill_chunk=64,
    )  # fmt: skip
    (row,) = [r for r in rows if r["budget"] == 40]
    assert row["prefill_chunk"] == 64
    live = slake.generate(
        llama_gqa, tok, sample.context + sample.question, method=method, budget=40,
        max_new_tokens=row["max_new_tokens"], prefill_chunk=64,
    )  # fmt: skip
    assert row["prediction"] == live.text


def test_question_agnostic_rows(llama_gqa, tok, needle_samples, tmp_path):
    sample = needle_samples[0]
    ctx, q = encode_sample(sample, tok, query_aware=False)
    full = encode_sample(sample, tok)[0]
    assert q and len(ctx) + len(q) == len(full)
    rows = run_suite(
        llama_gqa, tok, [sample], ["snapkv"], [40], tmp_path, query_aware=False, max_new_tokens=2, progress=False
    )
    assert [r["query_aware"] for r in rows] == [False, False]
    assert all(r["prompt_tokens"] == len(full) for r in rows)


def test_summary_and_json_rows(tmp_path):
    rows = [
        {
            "suite": "ruler",
            "task": t,
            "sample_id": f"{t}{i}",
            "model": "m",
            "method": m,
            "budget": b,
            "length": 1024,
            "score": s,
        }
        for t in ("a", "b")
        for i in range(2)
        for m, b, s in [("snapkv", 64, 0.5), ("full", None, 1.0), ("snapkv", 0.5, 0.0)]
    ]
    js = summary_rows(rows)
    assert all(JSON_KEYS <= set(r) for r in js)
    assert [(r["method"], r["budget"]) for r in js[:2]] == [("full", None), ("full", None)]
    assert {r["score"] for r in js if r["method"] == "snapkv" and r["budget"] == 64} == {50.0}
    assert all(r["n"] == 2 for r in js)
    md, _ = write_summary(tmp_path, rows)
    lines = [ln for ln in md.read_text().splitlines() if ln.startswith("| ")]
    assert lines[0] == "| method | budget | a | b | average | 95% CI | n |"
    assert lines[1:] == [  # every sample of a line scores alike: a zero-width interval
        "| full | full | 100.0 | 100.0 | 100.0 | [100.0, 100.0] | 4 |",
        "| snapkv | 64 | 50.0 | 50.0 | 50.0 | [50.0, 50.0] | 4 |",
        "| snapkv | 0.5 | 0.0 | 0.0 | 0.0 | [0.0, 0.0] | 4 |",
    ]


def test_methods_and_budgets_are_validated():
    registered = [m for m in slake.available_methods() if m != "full"]
    assert resolve_methods("all") == registered  # any registered method, no list to maintain
    assert resolve_methods("full,snapkv,snapkv") == ["snapkv"]
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        resolve_methods("snapkv,nope")
    assert parse_budgets("128, 0.25,128") == [128, 0.25]
    for bad in ("0", "1.5", "abc", ""):
        with pytest.raises(ValueError):
            parse_budgets(bad)


def test_cmd_eval_rejects_bad_arguments_before_loading(tmp_path):
    def loader(args):
        raise AssertionError("the model must not load")

    for extra, msg in [
        (("--methods", "nope"), "unknown method"),
        (("--budgets", "-3"), "budget"),
        (("--budgets", "8"), "exceed the budget"),
        (("--lengths", "x"), "--lengths"),
    ]:
        args = _eval_args(tmp_path)
        setattr(args, extra[0][2:], extra[1])
        with pytest.raises(ValueError, match=msg):
            cmd_eval(args)  # the engine --engine names, for --model
    args = _eval_args(tmp_path)
    args.suite, args.tasks = "ruler", "niah_single_1,bogus"
    with pytest.raises(ValueError, match="bogus"):
        cmd_eval(args, engine=TransformersEngine(loader=loader))
    args.suite, args.tasks = "longbench", None
    with pytest.raises(ValueError, match="longbench-dir"):
        cmd_eval(args, engine=TransformersEngine(loader=loader))


def test_make_prompt_writes_plain_prompt_and_answers(tok, tmp_path, capsys, monkeypatch):
    from slake.eval import needle

    monkeypatch.setattr(needle, "default_essays", lambda essays=None: essays or ESSAYS)
    parser = argparse.ArgumentParser()
    add_make_prompt_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "doc.txt"
    args = parser.parse_args(["make-prompt", "--task", "needle", "--length", "200", "--seed", "1", "--out", str(out)])
    assert cmd_make_prompt(args, tokenizer=tok) == 0
    text = out.read_text()
    err = capsys.readouterr().err
    answer = err.split("expected answer: ")[1].strip()
    assert answer in text and "<|user|>" not in text and text.rstrip().endswith("?")
    args.task = "nope"
    with pytest.raises(ValueError, match="unknown task"):
        cmd_make_prompt(args, tokenizer=tok)


def test_chunked_prefill_rows(llama_gqa, tok, needle_samples, tmp_path):
    """--prefill-chunk measures chunked prefill live; a chunk covering the prompt equals exact prefill."""
    sample = needle_samples[3]
    n = len(encode_sample(sample, tok)[0])
    exact = run_suite(
        llama_gqa, tok, [sample], ["snapkv", "slake"], [40], tmp_path / "exact", max_new_tokens=6, progress=False
    )
    whole = run_suite(
        llama_gqa,
        tok,
        [sample],
        ["snapkv", "slake"],
        [40],
        tmp_path / "whole",
        max_new_tokens=6,
        progress=False,
        prefill_chunk=n + 10,
    )
    assert [r["prediction"] for r in whole] == [r["prediction"] for r in exact]
    chunked = run_suite(
        llama_gqa,
        tok,
        [sample],
        ["snapkv", "slake"],
        [40],
        tmp_path / "exact",
        max_new_tokens=6,
        progress=False,
        prefill_chunk=max(8, n // 3),
    )
    # same directory: chunked rows are new keys (the full row is shared with the exact run and not repeated)
    assert [(r["method"], r["prefill_chunk"]) for r in chunked] == [
        ("snapkv", max(8, n // 3)),
        ("slake", max(8, n // 3)),
    ]
    assert all(r["compressed"] for r in chunked)
    with pytest.raises(ValueError, match="prefill_chunk"):
        run_suite(llama_gqa, tok, [sample], ["snapkv"], [40], tmp_path / "x", query_aware=False, prefill_chunk=16)


def test_batched_rows_equal_single_rows_for_every_method(llama_gqa, tok, needle_samples, tmp_path):
    """--batch-size: samples of different lengths are prefilled alone, left-padded into one batch and decoded
    together; every row (prediction, score, per-sample KV bytes, compressed flag) equals the batch-1 row."""
    methods = [m for m in slake.available_methods() if m != "full"]
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=4, progress=False)
    single = run_suite(llama_gqa, tok, needle_samples, methods, [40, 4096], tmp_path / "one", **kw)
    batched = run_suite(llama_gqa, tok, needle_samples, methods, [40, 4096], tmp_path / "four", batch_size=4, **kw)
    assert len({r["prompt_tokens"] for r in batched}) > 1  # the batch really is padded
    assert {r["batch_size"] for r in batched} == {4}
    fields = ("prediction", "score", "kv_bytes", "compressed", "new_tokens", "prompt_tokens", "max_new_tokens")
    by_key = {row_key(r): r for r in single}
    assert len(by_key) == len(batched) == len(needle_samples) * (1 + 2 * len(methods))
    for row in batched:
        ref = by_key[row_key(row)]
        assert {f: row[f] for f in fields} == {f: ref[f] for f in fields}, (row["method"], row["budget"])


def test_batch_size_is_validated(llama_gqa, tok, needle_samples, tmp_path):
    for bad, kw in [(0, {}), (2, {"query_aware": False}), (2, {"prefill_chunk": 64})]:
        with pytest.raises(ValueError, match="batch_size"):
            run_suite(llama_gqa, tok, needle_samples, ["snapkv"], [40], tmp_path, batch_size=bad, progress=False, **kw)
    args = _eval_args(tmp_path, "--batch-size", "2", "--question-agnostic")
    with pytest.raises(ValueError, match="--batch-size"):
        cmd_eval(args, engine=TransformersEngine(loader=_loader(llama_gqa, tok)))


def test_summary_orders_ruler_tasks_like_the_paper(tmp_path):
    from slake.eval.summary import task_order

    rows = [{"task": t} for t in ("qa_1", "custom", "niah_single_2", "vt", "niah_single_1", "custom")]
    assert task_order(rows) == ["niah_single_1", "niah_single_2", "vt", "qa_1", "custom"]


def test_method_variants_get_their_own_rows(llama_gqa, tok, needle_samples, tmp_path):
    sample = needle_samples[3]
    methods = resolve_methods("h2o,h2o[window=8],slake,slake[VABS=False],snapkv[linear_cache=true]")
    assert methods == ["h2o", "h2o[window=8]", "slake", "slake[vabs=false]", "snapkv[linear_cache=true]"]
    rows = run_suite(
        llama_gqa, tok, [sample], methods, [40], tmp_path, model_name="tiny", max_new_tokens=6, progress=False
    )
    assert sorted(r["method"] for r in rows) == sorted(methods + ["full"])
    for row in rows:  # each variant decodes with its own hyperparameters (H2O's score memo is not shared)
        live = slake.generate(
            llama_gqa,
            tok,
            sample.context + sample.question,
            method=row["method"],
            budget=row["budget"] or 100_000,
            max_new_tokens=row["max_new_tokens"],
        )
        assert row["prediction"] == live.text
    lin = {r["method"]: r["kv_bytes"]["linear_state"] for r in rows}
    assert lin["snapkv[linear_cache=true]"] > 0 and lin["slake[vabs=false]"] > 0 and lin["h2o"] == 0


def test_method_specs_are_validated():
    with pytest.raises(ValueError, match="has no hyperparameter"):
        resolve_methods("snapkv[nope=1]")
    with pytest.raises(ValueError, match="no hyperparameters"):
        resolve_methods("full[window=4]")


def test_engine_vllm_refuses_what_it_cannot_honour_before_loading(tmp_path, monkeypatch):
    import slake.engines.transformers.models

    def refuse(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(slake.engines.transformers.models, "load_tokenizer", refuse)
    monkeypatch.setattr(slake.engines.transformers.models, "load_model", refuse)
    for extra, msg in [
        (("--kv-dtype", "int8"), "--kv-dtype"),
        (("--prefill-chunk", "64"), "--prefill-chunk"),
        (("--question-agnostic",), "--question-agnostic"),
        (("--device", "cuda"), "CPU backend"),
    ]:
        args = _eval_args(tmp_path, "--engine", "vllm", *extra)
        with pytest.raises(ValueError, match=msg):
            cmd_eval(args)  # the engine --engine names, for --model


def test_a_results_directory_serves_one_engine(llama_gqa, tok, needle_samples, tmp_path):
    """The resume key does not name the engine: rows of vLLM in a directory make the transformers runner refuse it
    (instead of silently skipping the samples those rows cover)."""
    (tmp_path / "results.jsonl").write_text(
        json.dumps(
            {
                "suite": "needle",
                "task": "needle",
                "sample_id": "x",
                "model": "tiny",
                "method": "full",
                "budget": None,
                "length": 200,
                "prompt_tokens": 200,
                "prediction": "",
                "answers": ["1"],
                "score": 0.0,
                "prefill_s": 0.1,
                "decode_s": 0.1,
                "seed": 1,
                "query_aware": True,
                "engine": "vllm",
            }
        )
        + "\n"
    )
    with pytest.raises(ValueError, match='engine "vllm" where this run has "transformers" \\(--engine\\)'):
        run_suite(llama_gqa, tok, needle_samples[:1], ["snapkv"], [40], tmp_path, model_name="tiny", progress=False)


@pytest.mark.parametrize(
    "changed, flag",
    [
        ({"query_aware": False}, "--question-agnostic"),
        ({"kv_dtype": "int8"}, "--kv-dtype"),
        ({"chat_template": False}, "--no-chat-template"),
        ({"max_new_tokens": 1}, "--max-new-tokens"),
    ],
)
def test_a_rerun_with_other_settings_is_refused_not_served_the_old_rows(
    llama_gqa, tok, needle_samples, tmp_path, changed, flag
):
    """The resume key names the sample, method, budget, length, model and chunk, not these settings: a rerun into the
    same directory with ``--question-agnostic``, ``--kv-dtype int8``, ``--no-chat-template`` or another
    ``--max-new-tokens`` wrote no row and summarised the first run's rows as its own."""
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    first = run_suite(llama_gqa, tok, needle_samples[:1], ["snapkv"], [40], tmp_path, **kw)
    assert {r["chat_template"] for r in first} == {True} and {r["new_tokens_cap"] for r in first} == {2}
    assert {r["model_dtype"] for r in first} == {"float32"}
    assert run_suite(llama_gqa, tok, needle_samples[:1], ["snapkv"], [40], tmp_path, **kw) == []  # same: resumes
    with pytest.raises(ValueError, match=f"where this run has .* \\({flag}\\).* its own --out directory"):
        run_suite(llama_gqa, tok, needle_samples[:1], ["snapkv"], [40], tmp_path, **{**kw, **changed})
    assert len(read_results(tmp_path)) == len(first)


def test_rows_written_before_a_setting_was_recorded_are_not_compared_on_it(llama_gqa, tok, needle_samples, tmp_path):
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    first = run_suite(llama_gqa, tok, needle_samples[:1], ["snapkv"], [40], tmp_path, **kw)
    unrecorded = ("chat_template", "new_tokens_cap", "model_dtype", "kv_dtype")
    old = [{k: v for k, v in r.items() if k not in unrecorded} for r in first]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    rows = run_suite(llama_gqa, tok, needle_samples[:2], ["snapkv"], [40], tmp_path, **{**kw, "max_new_tokens": 3})
    assert len(first) == 2 and len(rows) == 2  # the first sample resumed, the second ran
    with pytest.raises(ValueError, match="kv_dtype"):  # an absent kv_dtype was always the model's dtype
        run_suite(llama_gqa, tok, needle_samples[:1], ["snapkv"], [40], tmp_path, **{**kw, "kv_dtype": "int8"})


def test_cmd_eval_methods_full_runs_the_reference_alone(llama_gqa, tok, tmp_path, monkeypatch):
    """``--methods full`` (the full-cache reference only, e.g. to survey where a model can do a task) wrote nothing:
    the CLI resolved it to an empty list, which the runner then refused as 'no method given'."""
    from slake.eval import suites

    real_build = suites.build_samples
    monkeypatch.setattr(suites, "build_samples", lambda plan, tokenizer: real_build(plan, tokenizer, essays=ESSAYS))
    out = tmp_path / "run"
    args = _eval_args(out)
    args.methods = "full"
    assert cmd_eval(args, engine=TransformersEngine(loader=_loader(llama_gqa, tok))) == 0
    rows = read_results(out)
    assert len(rows) == 4 and {(r["method"], r["budget"]) for r in rows} == {("full", None)}
