"""Reliability (issue 14): no silent wrong answers, no lost rows, every bad input a clear error before the slow part.

The table :data:`BAD_INPUTS` is the list of documented bad inputs of every command: each exits with code 2 and one
line on stderr naming the problem, prints nothing on stdout, loads no model and writes nothing. The API misuse cases
below give a clear exception.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import weakref

import pytest
import torch
from transformers import DynamicCache

import slake
from slake import SlakeCache
from slake.cli import main
from slake.engines.transformers.cache_kwarg import with_cache
from slake.eval.results import ResultsWriter, read_results, scan_results
from slake.eval.summary import write_summary
from tiny_models import random_ids, tiny_model

CUDA = torch.cuda.is_available()


# ====================================================================== the command line: bad inputs
def _files(tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    for name, data in (("lb_latin1", b'{"input": "caf\xe9"}\n'), ("lb_json", b'{"input": "q", "context": "c"\n')):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "qasper.jsonl").write_bytes(data)
    return tmp_path


GEN = ["generate", "--prompt", "hello there"]
BENCH = ["bench", "--random-model", "tiny", "--lengths", "48", "--out", "{out}"]
EVAL = ["eval", "--suite", "needle", "--methods", "snapkv", "--budgets", "64", "--out", "{out}"]
FID = ["fidelity", "--methods", "snapkv", "--budgets", "64"]

#: (id, argv, a fragment of the one-line message)
BAD_INPUTS = [
    ("gen-unknown-method", GEN + ["--method", "nope"], "unknown method 'nope'"),
    ("gen-unknown-hyper", GEN + ["--set", "nosuch=1"], "no hyperparameter nosuch"),
    ("gen-mistyped-hyper", GEN + ["--method", "slake", "--set", "vabs=3"], "vabs must be true or false"),
    ("gen-nan-hyper", GEN + ["--method", "slake[alpha=NaN]"], "alpha must be a finite number"),
    ("gen-inf-hyper", GEN + ["--method", "cake", "--set", "gamma=Infinity"], "gamma must be a finite number"),
    ("gen-kernel-0", GEN + ["--method", "snapkv[kernel=0]"], "kernel (a pooling kernel) must be an odd integer"),
    ("gen-kernel-even", GEN + ["--method", "pyramidkv[kernel=4]"], "must be an odd integer"),
    ("gen-budget-0", GEN + ["--budget", "0"], "budget must be >= 1"),
    ("gen-budget-text", GEN + ["--budget", "lots"], "budget must be a positive integer"),
    ("gen-budget-ratio", GEN + ["--budget", "1.5"], "neither a token count"),
    ("gen-window-over-budget", GEN + ["--method", "snapkv", "--budget", "16"], "exceed the budget 16"),
    ("gen-empty-prompt", ["generate", "--prompt", "   "], "the prompt is empty"),
    ("gen-missing-file", ["generate", "--prompt-file", "{dir}/nope.txt"], "prompt file not found"),
    ("gen-empty-file", ["generate", "--prompt-file", "{dir}/empty.txt"], "empty.txt is empty"),
    ("gen-not-utf8", ["generate", "--prompt-file", "{dir}/latin1.txt"], "latin1.txt is not UTF-8"),
    ("gen-max-new-0", GEN + ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("gen-prefill-chunk-0", GEN + ["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    ("gen-temperature-0", GEN + ["--sample", "--temperature", "0"], "--temperature must be a finite number > 0"),
    ("gen-top-p", GEN + ["--sample", "--top-p", "1.5"], "--top-p must lie in"),
    ("gen-device-garbage", GEN + ["--device", "cuda:abc"], "invalid device 'cuda:abc'"),
    ("gen-device-unknown", GEN + ["--device", "tpu"], "invalid device"),
    ("gen-device-index", GEN + ["--device", "cuda:99"], "cuda:99"),
    ("gen-dtype", GEN + ["--dtype", "fp8"], "unknown dtype 'fp8'"),
    ("fid-empty-file", FID + ["--prompt-file", "{dir}/empty.txt"], "empty.txt is empty"),
    ("fid-not-utf8", FID + ["--prompt-file", "{dir}/latin1.txt"], "latin1.txt is not UTF-8"),
    ("fid-steps-0", FID + ["--steps", "0"], "--steps must be >= 1"),
    ("fid-length-1", FID + ["--length", "1"], "--length must be >= 2"),
    ("fid-window-over-budget", ["fidelity", "--methods", "cake", "--budgets", "64,16"], "exceed the budget 16"),
    ("fid-unknown-method", ["fidelity", "--methods", "snapkv,nope"], "unknown method 'nope'"),
    ("bench-threads-neg", BENCH + ["--threads", "-1"], "--threads must be >= 1"),
    ("bench-threads-0", BENCH + ["--threads", "0"], "--threads must be >= 1"),
    (
        "bench-shape-key",
        ["bench", "--random-model", "tiny:nosuch=3", "--lengths", "48", "--out", "{out}"],
        "unknown config key nosuch",
    ),
    ("bench-shape-name", ["bench", "--random-model", "gpt9", "--lengths", "48", "--out", "{out}"], "gpt9"),
    ("bench-lengths", BENCH[:-4] + ["--lengths", "1", "--out", "{out}"], "--lengths"),
    ("bench-window-over-budget", BENCH + ["--methods", "full,cake", "--budget", "8"], "exceed the budget 8"),
    ("bench-device", BENCH + ["--device", "cuda:abc"], "invalid device"),
    ("bench-kernel-0", BENCH + ["--methods", "snapkv[kernel=0]"], "must be an odd integer"),
    ("eval-budget-0", EVAL[:-4] + ["--budgets", "0", "--out", "{out}"], "budget must be >= 1"),
    (
        "eval-unknown-method",
        ["eval", "--suite", "needle", "--methods", "nope", "--budgets", "64", "--out", "{out}"],
        "unknown method",
    ),
    ("eval-window-over-budget", EVAL[:-4] + ["--budgets", "8", "--out", "{out}"], "exceed the budget 8"),
    ("eval-max-new-0", EVAL + ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("eval-prefill-chunk-0", EVAL + ["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    ("eval-batch-0", EVAL + ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("eval-device", EVAL + ["--device", "cuda:abc"], "invalid device"),
    (
        "eval-nan-hyper",
        ["eval", "--suite", "needle", "--methods", "slake[beta=NaN]", "--budgets", "64", "--out", "{out}"],
        "beta must be a finite number",
    ),
    (
        "eval-unknown-task",
        ["eval", "--suite", "ruler", "--tasks", "nope", "--methods", "snapkv", "--budgets", "64", "--out", "{out}"],
        "unknown RULER task(s) nope",
    ),
    (
        "eval-depths-for-ruler",
        ["eval", "--suite", "ruler", "--depths", "50", "--methods", "snapkv", "--budgets", "64", "--out", "{out}"],
        "--depths",
    ),
    (
        "eval-longbench-not-utf8",
        [
            "eval",
            "--suite",
            "longbench",
            "--longbench-dir",
            "{dir}/lb_latin1",
            "--methods",
            "snapkv",
            "--budgets",
            "64",
            "--out",
            "{out}",
        ],
        "lb_latin1/qasper.jsonl, line 1: not UTF-8",
    ),
    (
        "eval-longbench-bad-json",
        [
            "eval",
            "--suite",
            "longbench",
            "--longbench-dir",
            "{dir}/lb_json",
            "--methods",
            "snapkv",
            "--budgets",
            "64",
            "--out",
            "{out}",
        ],
        "lb_json/qasper.jsonl, line 1: not a LongBench",
    ),
    (
        "make-prompt-depth",
        ["make-prompt", "--task", "needle", "--length", "64", "--depth", "120", "--out", "{out}"],
        "--depth must lie in [0, 100]",
    ),
    ("make-prompt-task", ["make-prompt", "--task", "nope", "--length", "64", "--out", "{out}"], "unknown task"),
    ("make-prompt-length", ["make-prompt", "--task", "needle", "--length", "0", "--out", "{out}"], "--length"),
]
if not CUDA:
    BAD_INPUTS += [
        ("gen-no-cuda", GEN + ["--device", "cuda"], "CUDA is not available"),
        ("bench-no-cuda", BENCH + ["--device", "cuda"], "CUDA is not available"),
        ("fid-no-cuda", FID + ["--device", "cuda"], "CUDA is not available"),
    ]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail loudly if a command gets as far as loading a model or a tokenizer."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were validated")

    import slake.engines.transformers.models
    import slake.engines.transformers.shapes

    monkeypatch.setattr(slake.engines.transformers.models, "load_model", refuse)
    monkeypatch.setattr(slake.engines.transformers.shapes, "random_model", refuse)
    monkeypatch.setattr(slake.engines.transformers.models, "load_tokenizer", refuse)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, tmp_path, capsys, no_model_load):
    _, argv, fragment = case
    files = _files(tmp_path / "in")
    out = tmp_path / "out"
    argv = [a.format(dir=files, out=out) for a in argv]
    before = sorted(p.name for p in files.iterdir())
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"slake {argv[0]}: error: ")
    assert fragment in lines[0], lines[0]
    assert not out.exists()
    assert sorted(p.name for p in files.iterdir()) == before


# ====================================================================== SlakeCache misuse (items 1 and 2)
def _gen(model, ids, cache, n=4):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **with_cache(model, cache),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )


@pytest.mark.parametrize("new_len", [40, 62, 63])
def test_reusing_a_cache_for_a_new_prompt_raises(llama_gqa, new_len):
    """A cache holding 63 tokens (60 prompt + 3 fed back) refuses an unrelated prompt that is not longer than it,
    instead of answering from the first prompt."""
    cache = SlakeCache("snapkv", 48, config=llama_gqa.config)
    _gen(llama_gqa, random_ids(60, seed=1), cache)
    assert cache.get_seq_length() == 63
    with pytest.raises(ValueError, match="already holds 63 tokens of an earlier prompt"):
        _gen(llama_gqa, random_ids(new_len, seed=2), cache)


@pytest.mark.parametrize("new_len", [1, 50, 77])
def test_a_new_prompt_less_than_half_as_long_as_the_cache_raises_the_same_error(llama_gqa, new_len):
    """transformers cut a new prompt up to half the cached length down to no token at all and the model's layers
    failed with "cannot reshape tensor of 0 elements" instead of the cache's own refusal."""
    cache = SlakeCache("cake", 48, config=llama_gqa.config)
    _gen(llama_gqa, random_ids(150, seed=1), cache, n=5)
    with pytest.raises(ValueError, match="already holds 154 tokens of an earlier prompt"):
        _gen(llama_gqa, random_ids(new_len, seed=2), cache)


def test_a_conversation_that_outgrows_an_uncompressed_cache_says_so(llama_gqa, caplog):
    """A first turn within the budget leaves the cache a full cache for every later turn: a chat on
    ``SlakeCache("slake", 64)`` held 239, 444, 649 tokens per layer, compressed: False, without a word."""
    import logging

    cache = SlakeCache("slake", 64, config=llama_gqa.config)
    out = _gen(llama_gqa, random_ids(30, seed=1), cache)
    with caplog.at_level(logging.WARNING, logger="slake"):
        out = _gen(llama_gqa, torch.cat([out, random_ids(20, seed=2)], 1), cache)  # 54 tokens: within 64
        assert not [r for r in caplog.records if "compresses nothing" in r.getMessage()]
        _gen(llama_gqa, torch.cat([out, random_ids(200, seed=3)], 1), cache)
    (record,) = [r for r in caplog.records if "compresses nothing" in r.getMessage()]
    assert "first prompt (30 tokens) was within its budget (64)" in record.getMessage()
    assert not cache.statistics()["compressed"]


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_multi_turn_continuation_equals_the_full_cache(llama_gqa, method):
    """Two turns on one SlakeCache (the second passes the whole conversation) give the same tokens as transformers'
    own cache when nothing is evicted."""
    turn1 = random_ids(40, seed=3)
    follow = random_ids(12, seed=4)

    def run(cache_factory):
        cache = cache_factory()
        first = _gen(llama_gqa, turn1, cache, 5)
        second = _gen(llama_gqa, torch.cat([first, follow], 1), cache, 6)
        return first, second

    ours = run(lambda: SlakeCache(method, 4096, config=llama_gqa.config))
    llama_gqa.set_attn_implementation("sdpa")
    try:
        ref = run(DynamicCache)
    finally:
        slake.prepare_model(llama_gqa)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.mark.parametrize("layers", [2, 4, 40])
def test_num_layers_that_do_not_match_the_model_raise_before_any_work(llama_gqa, layers):
    cache = SlakeCache("slake", 48, layers)
    with pytest.raises(ValueError, match=f"built for {layers} layers but the model has 3"):
        _gen(llama_gqa, random_ids(60, seed=1), cache)
    assert cache.get_seq_length() == 0


def test_cache_takes_the_model_config(llama_gqa):
    assert len(SlakeCache("cake", 48, config=llama_gqa.config).layers) == 3
    assert len(SlakeCache("cake", 48, llama_gqa.config).layers) == 3  # positional, as DynamicCache(config)
    assert len(SlakeCache("cake", 48, 3, config=llama_gqa.config).layers) == 3
    with pytest.raises(ValueError, match="disagrees with the config"):
        SlakeCache("cake", 48, 4, config=llama_gqa.config)
    with pytest.raises(ValueError, match="needs the model's config"):
        SlakeCache("cake", 48)
    with pytest.raises(ValueError, match="positive integer"):
        SlakeCache("cake", 48, 0)


def test_unprepared_layer_index_and_unfilled_layers_are_clear_errors():
    """Without the forward check (a direct cache call), a layer the cache lacks and layers the model never filled
    still give a clear error, not an IndexError or silent phantom layers."""
    cache = SlakeCache("full", 48, 2)
    k = torch.zeros(1, 2, 5, 16)
    with pytest.raises(ValueError, match="updated layer 2, but this SlakeCache was built for 2 layers"):
        cache.update(k, k, 2)
    cache = SlakeCache("snapkv", 48, 4)
    cache.compressor.prefill_layer(0, torch.zeros(1, 4, 5, 16), k, k, None, 0.25)
    with pytest.raises(ValueError, match="the model filled 1 layers but this SlakeCache was built for 4"):
        cache.statistics()


# ====================================================================== context length (item 5)
def test_prompt_longer_than_the_context_raises_unless_allowed():
    from test_eval_runner import TinyTokenizer

    model = tiny_model("llama-gqa", layers=2)
    model.config.max_position_embeddings = 40
    tok = TinyTokenizer()
    prompt = " ".join(f"w{i}" for i in range(60))
    with pytest.raises(ValueError, match="beyond the model's context of 40 tokens"):
        slake.generate(model, tok, prompt, method="snapkv", budget=32, max_new_tokens=2)
    res = slake.generate(model, tok, prompt, method="snapkv", budget=32, max_new_tokens=2, allow_long_context=True)
    assert res.prompt_tokens[0] > 40


# ====================================================================== honest statistics (item 7)
def test_kv_bytes_separate_growth_slack_from_padding_and_no_linear_state_without_eviction(llama_gqa):
    ids = random_ids(43, seed=5)
    cache = SlakeCache("slake", 128, config=llama_gqa.config)  # 43 tokens fit: nothing is evicted
    _gen(llama_gqa, ids, cache, 3)
    kv = cache.statistics()["kv_bytes"]
    assert cache.statistics()["compressed"] is False
    assert kv["padding"] == 0 and kv["linear_state"] == 0
    per_token = 2 * 16 * 4 * 2 * 3  # K+V, d=16, fp32, 2 KV heads, 3 layers
    assert kv["kept"] == 45 * per_token
    assert kv["slack"] > 0  # room allocated for later decode tokens, reported as such


def test_kv_bytes_padding_counts_uneven_heads_only(llama_gqa):
    ids = random_ids(120, seed=6)
    cache = SlakeCache("ada-snapkv", 48, config=llama_gqa.config)
    _gen(llama_gqa, ids, cache, 3)
    eng = cache.compressor
    kv = cache.statistics()["kv_bytes"]
    per_slot = 2 * 16 * 4
    expected_padding = sum(int((s.counts().max() - s.counts()).sum()) for s in eng.layers) * per_slot
    expected_slack = (
        sum(s.valid.shape[0] * s.valid.shape[1] * (s.capacity - int(s.counts().max())) for s in eng.layers) * per_slot
    )
    assert kv["padding"] == expected_padding > 0
    assert kv["slack"] == expected_slack


def test_linear_state_is_allocated_when_something_is_evicted(llama_gqa):
    cache = SlakeCache("slake", 48, config=llama_gqa.config)
    _gen(llama_gqa, random_ids(120, seed=7), cache, 3)
    kv = cache.statistics()["kv_bytes"]
    assert kv["linear_state"] == 3 * 2 * (16 * 16 + 2 * 16 + 1) * 4


# ====================================================================== memory over repeated calls (item 8)
def test_no_cache_survives_a_generate_call(llama_gqa, monkeypatch):
    """slake.generate keeps nothing alive between calls: no module-level reference to the cache or its layers."""
    import slake.engines.transformers.generate as gen_mod
    from slake.engines.transformers.cache import current_layer
    from test_eval_runner import TinyTokenizer

    refs = []

    class Tracked(SlakeCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            refs.append(weakref.ref(self))

    monkeypatch.setattr(gen_mod, "SlakeCache", Tracked)
    tok = TinyTokenizer()
    for method in ("slake", "h2o", "snapkv"):
        res = slake.generate(
            llama_gqa, tok, " ".join(f"w{i}" for i in range(90)), method=method, budget=40, max_new_tokens=3
        )
        del res
    gc.collect()
    assert len(refs) == 3 and all(r() is None for r in refs)
    assert current_layer() is None


# ====================================================================== fp16 on CPU (item 9)
def test_fp16_on_cpu_is_finite_and_equals_the_full_cache_at_a_full_budget():
    model = tiny_model("llama-gqa").half()
    ids = random_ids(80, seed=8)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = _gen(model, ids, DynamicCache(), 6)
    finally:
        slake.prepare_model(model)
    with torch.no_grad():
        full = _gen(model, ids, SlakeCache("slake", 4096, config=model.config), 6)
    assert torch.equal(full, ref)
    for method in ("slake", "cake", "snapkv", "h2o", "ada-snapkv", "sagekv"):
        cache = SlakeCache(method, 40, config=model.config)
        with torch.no_grad():
            out = model(ids, **with_cache(model, cache), use_cache=True)
            step = model(ids[:, -1:], **with_cache(model, cache), use_cache=True)
        assert out.logits.dtype == torch.float16
        assert torch.isfinite(out.logits).all() and torch.isfinite(step.logits).all(), method
        assert cache.statistics()["compressed"] is True
        assert all(s.keys.dtype == torch.float16 for s in cache.compressor.layers)


# ====================================================================== the results reader (item 3)
ROW = {
    "suite": "needle",
    "task": "needle",
    "sample_id": "a",
    "model": "m",
    "method": "full",
    "budget": None,
    "length": 64,
    "score": 1.0,
}


def _row(**kw):
    return json.dumps({**ROW, **kw})


def test_rows_with_missing_fields_are_skipped_and_reported_not_crashing_the_summary(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [
        _row(),
        json.dumps({k: v for k, v in ROW.items() if k != "length"}),
        "[1, 2]",
        "not json",
        _row(sample_id="b", score="high"),
        _row(sample_id="c"),
    ]
    path.write_text("\n".join(lines) + "\n")
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a", "c"]
    assert [n for n, _ in scan.skipped] == [2, 3, 4, 5]
    assert "missing length" in scan.skipped[0][1]
    note = scan.describe_skipped()
    assert note.startswith("skipped 4 lines of results.jsonl") and "line 2 (missing length)" in note
    md, _ = write_summary(tmp_path)  # used to raise KeyError: 'length'
    assert "needle" in md.read_text()
    with ResultsWriter(tmp_path) as store:
        assert not store.write(ROW)
    assert path.read_text().splitlines() == lines  # nothing deleted


def test_complete_last_row_without_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + _row(sample_id="b"))
    with ResultsWriter(tmp_path) as store:
        assert not store.write({**ROW, "sample_id": "b"})  # already done: not recomputed
        assert store.write({**ROW, "sample_id": "c"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b", "c"]


def test_partial_last_line_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + _row(sample_id="b")[:-9])
    with ResultsWriter(tmp_path) as store:
        assert store.write({**ROW, "sample_id": "b"})
    assert [r["sample_id"] for r in read_results(tmp_path)] == ["a", "b"]
    assert scan_results(tmp_path).skipped == []


def test_a_partial_last_line_is_reported_as_removed_not_as_kept(tmp_path):
    """slake eval printed "skipped 1 line ... (kept in the file): line 2 (not JSON)" for a row cut by a crash, then
    the writer removed that line: the report said the opposite of what happened."""
    path = tmp_path / "results.jsonl"
    path.write_text(_row() + "\n" + "not json\n" + _row(sample_id="b")[:-9])
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a"]
    assert [n for n, _ in scan.skipped] == [2, 3] and scan.cut_tail == 3
    note = scan.describe_skipped()
    assert "skipped 1 line of results.jsonl" in note and "(kept in the file): line 2 (not JSON)" in note
    assert "line 3) is an incomplete row" in note and "removed" in note and "line 3 (" not in note
    with ResultsWriter(tmp_path):
        pass
    assert path.read_text().splitlines() == [_row(), "not json"]  # what the report said: line 2 kept, 3 removed
    # a complete last row without its newline, or a JSON line that is not a row, is kept: not an incomplete row
    path.write_text(_row() + "\n" + json.dumps({"task": 1}))
    assert scan_results(tmp_path).cut_tail is None
    assert "(kept in the file): line 2" in scan_results(tmp_path).describe_skipped()


def test_a_second_writer_of_one_directory_is_refused_until_the_first_closes(tmp_path):
    """Two runs with one --out at once both passed the checks of the rows present, both ran every pending row and
    appended side by side, whatever their settings (a --kv-dtype int8 run beside a plain one): each summary mixed
    the other's rows. The writer now holds a lock on the directory."""
    first = ResultsWriter(tmp_path)
    with pytest.raises(ValueError, match="being written by another run"):  # before: a second writer, no word
        ResultsWriter(tmp_path)
    first.write(ROW)
    first.close()
    with ResultsWriter(tmp_path) as again:  # released by close()
        assert not again.write(ROW)
    dropped = ResultsWriter(tmp_path)
    del dropped
    gc.collect()
    with ResultsWriter(tmp_path / "sub"), ResultsWriter(tmp_path):  # released when dropped; one lock per directory
        pass


def _signal_then_wait(started, ready) -> None:
    started.set()
    ready.wait(30)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_results_directory_locked(tmp_path):
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    writer = ResultsWriter(tmp_path)
    started, ready = fork.Event(), fork.Event()
    child = fork.Process(target=_signal_then_wait, args=(started, ready))  # a worker outliving the run
    child.start()
    try:
        # once the child runs (its at-fork hook has closed its copy of the descriptor; a loaded machine may schedule
        # it after the parent's next lines, and the copy holds the lock until then)
        assert started.wait(30)
        writer.close()
        with ResultsWriter(tmp_path):  # the child's copy of the descriptor would still hold the lock
            pass
    finally:
        ready.set()
        child.join()


def test_non_utf8_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(_row().encode() + b"\n" + b'{"task": "caf\xe9"}\n' + _row(sample_id="b").encode() + b"\n")
    scan = scan_results(tmp_path)
    assert [r["sample_id"] for r in scan.rows] == ["a", "b"]
    assert scan.skipped == [(2, "not UTF-8")]
    with ResultsWriter(tmp_path) as store:
        assert store.done and store.write({**ROW, "sample_id": "c"})
    assert len(read_results(tmp_path)) == 3


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_forward_check_finds_the_cache_under_either_keyword(llama_gqa, name):
    """transformers 5.24 passes the cache as ``cache=`` (``past_key_values=`` before): the input check must see it
    under both names, or a mismatched cache goes unchecked."""
    from slake.engines.transformers.attention import _check_slake_cache

    kwargs = {name: SlakeCache("slake", 48, 2), "input_ids": random_ids(10, seed=1)}
    with pytest.raises(ValueError, match="built for 2 layers but the model has 3"):
        _check_slake_cache(llama_gqa.model, (), kwargs)


def test_the_cache_keyword_follows_the_models_forward_signature(llama_gqa):
    from slake.engines.transformers.cache_kwarg import cache_kwarg, with_cache

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids=None, cache=None):
            return cache

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    assert cache_kwarg(NewStyle()) == "cache"
    assert cache_kwarg(OldStyle()) == "past_key_values"
    marker = object()
    assert NewStyle()(**with_cache(NewStyle(), marker)) is marker
    assert OldStyle()(**with_cache(OldStyle(), marker)) is marker
    installed = "cache" if "cache" in inspect.signature(type(llama_gqa).forward).parameters else "past_key_values"
    assert cache_kwarg(llama_gqa) == installed
