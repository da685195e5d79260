"""What makes long evaluations practical without changing their results (prefill captures kept on disk across runs,
the time left in the progress bar) and the output-level fidelity rows of ``slake eval --fidelity``; on a tiny random
model."""

from __future__ import annotations

import zipfile

import pytest
import torch

from slake.engines import make_engine
from slake.engines.base import EvalRequest
from slake.engines.transformers import TransformersEngine
from slake.engines.transformers import evaluate as engine_eval
from slake.engines.transformers.prefill_once import CaptureStore, capture_prefill
from slake.eval.needle import needle_grid
from slake.eval.progress import TimeLeft, format_duration
from slake.eval.results import row_key
from slake.eval.runner import encode_sample, run_suite
from slake.methods.base import make_method
from slake.quality.output_fidelity import Continuation, measure_outputs, prepare_reference
from test_eval_runner import ESSAYS, TinyTokenizer
from tiny_models import tiny_model

FIELDS = ("prediction", "score", "kv_bytes", "compressed", "new_tokens", "prompt_tokens", "prefill_s")


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


@pytest.fixture(scope="module")
def samples(tok):
    return needle_grid(tok, [200, 280], [0, 100], seed=1, essays=ESSAYS, max_new_tokens=4)


def _count_prefills(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = engine_eval.capture_prefill
    monkeypatch.setattr(engine_eval, "capture_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("batch_size", [1, 4])
def test_prefill_cache_gives_the_same_rows_without_prefilling_again(
    llama_gqa, tok, samples, tmp_path, monkeypatch, batch_size
):
    """A second run over the same prompts (here into a new results folder, as a new method list would) reads every
    capture from the cache: no prefill, and every row as the first run wrote it (the recorded prefill time too)."""
    calls = _count_prefills(monkeypatch)
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=4, progress=False, batch_size=batch_size)
    cache = tmp_path / "captures"
    methods = ["snapkv", "h2o", "cake", "slake"]
    first = run_suite(llama_gqa, tok, samples, methods, [40], tmp_path / "a", prefill_cache=cache, **kw)
    assert len(calls) == len(samples) and len(list(cache.glob("*.pt"))) == len(samples)
    assert not any(r["prefill_cached"] for r in first)
    calls.clear()
    second = run_suite(llama_gqa, tok, samples, methods, [40], tmp_path / "b", prefill_cache=cache, **kw)
    assert calls == [] and all(r["prefill_cached"] for r in second)
    by_key = {row_key(r): r for r in first}
    assert len(second) == len(first)
    for row in second:
        ref = by_key[row_key(row)]
        assert {f: row[f] for f in FIELDS} == {f: ref[f] for f in FIELDS}, (row["method"], row["budget"])


def _count_passes(monkeypatch) -> list[int]:
    from slake.engines.transformers import reconstruction

    calls: list[int] = []
    real = reconstruction.reconstruction_scores
    monkeypatch.setattr(reconstruction, "reconstruction_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("first_batch, second_batch", [(1, 1), (1, 2), (2, 1)])
def test_prefill_cache_keeps_kvzip_reconstruction_scores_across_runs(
    llama_gqa, tok, samples, tmp_path, monkeypatch, first_batch, second_batch
):
    """KVzip's second pass costs about a prefill: a later run on the same prompts reads each prompt's scores from the
    prefill cache (whatever batch computed them) and gives the same rows, saying so in ``second_pass_cached``."""
    passes = _count_passes(monkeypatch)
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=4, progress=False)
    cache = tmp_path / "captures"
    methods = ["kvzip", "kvzip[keep_generated=true]"]  # one pass configuration: computed once per capture
    first = run_suite(
        llama_gqa, tok, samples, methods, [40, 60], tmp_path / "a", prefill_cache=cache, batch_size=first_batch, **kw
    )
    assert len(passes) == len(samples) // first_batch
    assert len(list((cache / "second_pass").glob("*.pt"))) == len(samples)
    computed = [r for r in first if "second_pass_s" in r]
    assert computed and not any(r["second_pass_cached"] for r in computed)
    passes.clear()
    second = run_suite(
        llama_gqa, tok, samples, methods, [40, 60], tmp_path / "b", prefill_cache=cache, batch_size=second_batch, **kw
    )
    assert passes == []
    read = [r for r in second if "second_pass_s" in r]
    assert read and all(r["second_pass_cached"] for r in read)
    assert sum(r["second_pass_s"] for r in read) == pytest.approx(
        sum(r["second_pass_s"] for r in computed) * second_batch / first_batch, rel=1e-3
    )  # a batch's rows each report the batch's pass
    by_key = {row_key(r): r for r in first}
    assert len(second) == len(first)
    for row in second:
        ref = by_key[row_key(row)]
        assert {f: row[f] for f in FIELDS} == {f: ref[f] for f in FIELDS}, (row["method"], row["budget"])


def test_stored_reconstruction_scores_are_bound_to_prompt_model_and_pass(llama_gqa, tmp_path, monkeypatch):
    from slake.engines.transformers.reconstruction import ReconstructionPrompt

    passes = _count_passes(monkeypatch)
    ids = list(range(5, 70))
    store = CaptureStore(tmp_path, llama_gqa)
    capture = capture_prefill(llama_gqa, torch.tensor([ids]))
    prompt = ReconstructionPrompt.synthetic(256)
    seconds, cached = engine_eval._second_pass(llama_gqa, capture, "kvzip", prompt, store, [ids])
    assert seconds is not None and seconds > 0 and not cached and len(passes) == 1
    scores = capture.pass_scores[make_method("kvzip").second_pass_key()]

    def again(method: str, reconstruction: ReconstructionPrompt) -> bool:
        fresh = capture_prefill(llama_gqa, torch.tensor([ids]))
        _, cached = engine_eval._second_pass(llama_gqa, fresh, method, reconstruction, store, [ids])
        if cached:
            assert torch.equal(fresh.pass_scores[make_method(method).second_pass_key()], scores)
        return cached

    assert again("kvzip[keep_generated=true,window=8]", prompt)  # decode rules and window: the same pass
    assert not again("kvzip[chunk_size=16]", prompt)  # another pass configuration
    other = ReconstructionPrompt(prompt.repeat_ids[::-1], prompt.continue_ids, prompt.suffix_ids, [])
    assert not again("kvzip", other)  # another tokenizer's reconstruction prompt
    key = f"{make_method('kvzip').second_pass_key()} prompt={prompt.fingerprint()}"
    assert store.load_pass_scores(ids[:-1], key) is None  # another prompt
    assert CaptureStore(tmp_path, tiny_model("llama-gqa", seed=1)).load_pass_scores(ids, key) is None  # model
    store.pass_path(ids, key).write_bytes(b"not a tensor file")
    assert not again("kvzip", prompt)  # an unreadable file is computed again, and replaced
    assert again("kvzip", prompt)
    with pytest.raises(ValueError, match="one prompt"):
        store.save_pass_scores(ids, key, scores.expand(-1, 2, -1, -1), 1.0)


def test_stored_reconstruction_scores_are_bound_to_the_scoring_code(llama_gqa, tmp_path, monkeypatch):
    # scores stored by an older scoring (another overlap between chunks, prefix score, or a bumped format after a fix
    # of the pass) are computed again, never reused as if today's code had made them
    from slake.engines.transformers import reconstruction
    from slake.engines.transformers.reconstruction import ReconstructionPrompt

    _count_passes(monkeypatch)
    ids = list(range(5, 70))
    store = CaptureStore(tmp_path, llama_gqa)
    prompt = ReconstructionPrompt.synthetic(256)

    def cached() -> bool:
        capture = capture_prefill(llama_gqa, torch.tensor([ids]))
        return engine_eval._second_pass(llama_gqa, capture, "kvzip", prompt, store, [ids])[1]

    assert not cached() and cached()
    for name, value in (("SCORES_FORMAT", reconstruction.SCORES_FORMAT + 1), ("OVERLAP", 4), ("PREFIX_SCORE", 3.0)):
        with monkeypatch.context() as m:
            m.setattr(reconstruction, name, value)
            assert not cached(), name
    assert cached()  # today's code finds its own scores again


def test_a_stored_capture_is_bit_identical_and_bound_to_its_model_and_prompt(llama_gqa, tmp_path):
    ids = list(range(5, 70))
    capture = capture_prefill(llama_gqa, torch.tensor([ids]))
    store = CaptureStore(tmp_path, llama_gqa)
    path = store.save(ids, capture)
    # a view's whole storage is not written: the file holds about the records' own bytes
    own = sum(t.numel() * t.element_size() for r in capture.records for t in r[:3])
    assert path.stat().st_size < 1.5 * own + 200_000
    loaded = store.load(ids)
    assert loaded is not None and loaded.cached and not capture.cached
    for a, b in zip(capture.records, loaded.records):
        for x, y in zip(a, b):
            assert (x is None and y is None) or (isinstance(x, float) and x == y) or torch.equal(x, y)
    assert torch.equal(capture.last_logits, loaded.last_logits)
    assert store.load(ids[:-1]) is None  # another prompt
    other = tiny_model("llama-gqa", seed=1)
    assert CaptureStore(tmp_path, other).load(ids) is None  # same shape, other weights
    path.write_bytes(b"not a capture")
    assert store.load(ids) is None  # unreadable: prefilled again, then replaced


def test_a_stored_file_with_a_damaged_byte_is_prefilled_again_not_read(llama_gqa, tmp_path):
    """torch.load checks no CRC: one flipped byte inside a stored tensor (a disk error, a crash after the rename) was
    read back as a valid capture and replayed into every row; the archive's CRC-32s now make it count as missing."""
    ids = list(range(5, 70))
    capture = capture_prefill(llama_gqa, torch.tensor([ids]))
    store = CaptureStore(tmp_path, llama_gqa)
    path = store.save(ids, capture)
    raw = bytearray(path.read_bytes())
    keys = bytes(capture.records[1][1].untyped_storage().tolist())  # layer 1's keys, as stored
    at = bytes(raw).find(keys)
    assert at > 0
    raw[at + len(keys) // 2] ^= 0x40  # one bit of one key
    path.write_bytes(bytes(raw))
    assert store.load(ids) is None  # damaged: prefilled again, then replaced
    store.save(ids, capture)
    # a damaged central directory that marks a record a folder: torch's reader returned the tensor's memory unset
    with zipfile.ZipFile(path) as archive:
        (tensor,) = [i.filename for i in archive.infolist() if i.filename.endswith("/data/0")]
        directory = archive.start_dir
    raw = bytearray(path.read_bytes())
    entry = bytes(raw).find(b"PK\x01\x02", directory)
    while raw[entry + 46 : entry + 46 + len(tensor)] != tensor.encode():  # the central directory's entry of it
        entry = bytes(raw).find(b"PK\x01\x02", entry + 4)
    raw[entry + 38] |= 0x10  # its external attributes: MS-DOS folder
    path.write_bytes(bytes(raw))
    assert store.load(ids) is None
    store.save(ids, capture)
    loaded = store.load(ids)
    assert loaded is not None and torch.equal(loaded.records[1][1], capture.records[1][1])
    # the same for KVzip's stored scores
    scores = torch.rand(3, 1, 2, len(ids))
    pass_file = store.save_pass_scores(ids, "k", scores, 1.0)
    raw = bytearray(pass_file.read_bytes())
    at = bytes(raw).find(scores.numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0x01
    pass_file.write_bytes(bytes(raw))
    assert store.load_pass_scores(ids, "k") is None


def test_a_full_disk_warns_once_and_the_run_goes_on_with_the_same_rows(
    llama_gqa, tok, samples, tmp_path, monkeypatch, caplog
):
    """A capture that could not be written (torch's zip writer reports a full disk as a RuntimeError) stopped the
    evaluation mid-run with '[enforce fail at inline_container.cc] unexpected pos'; the stored files only save work,
    so the run goes on with the same rows, one warning says why, no partial file is left and no more is tried."""
    from slake.engines.transformers import prefill_once

    kw = dict(suite="needle", model_name="tiny", max_new_tokens=4, progress=False)
    plain = run_suite(llama_gqa, tok, samples, ["snapkv", "kvzip"], [40], tmp_path / "plain", **kw)
    tries: list[str] = []

    def full_disk(data, target):
        tries.append(str(target))
        with open(target, "wb") as f:
            f.write(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 280832 vs 280720")

    monkeypatch.setattr(prefill_once.torch, "save", full_disk)
    cache = tmp_path / "captures"
    with caplog.at_level("WARNING", logger="slake"):
        rows = run_suite(llama_gqa, tok, samples, ["snapkv", "kvzip"], [40], tmp_path / "a", prefill_cache=cache, **kw)
    assert len(tries) == 1  # no more writes after the first failure
    warned = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warned) == 1 and "disk full" in warned[0] and str(cache) in warned[0]
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # the partial file is removed
    by_key = {row_key(r): r for r in plain}
    assert len(rows) == len(plain)
    for row in rows:
        ref = by_key[row_key(row)]
        assert {f: row[f] for f in FIELDS if f != "prefill_s"} == {f: ref[f] for f in FIELDS if f != "prefill_s"}
    monkeypatch.undo()
    assert CaptureStore(cache, llama_gqa).writable  # a later run tries again


def test_fidelity_rows_equal_slake_fidelity_on_the_same_answer(llama_gqa, tok, samples, tmp_path):
    """--fidelity teacher-forces the full cache's answer through each compressed cache: the distances equal those
    ``slake fidelity``'s output level (measure_outputs) computes for the same prompt and continuation, a budget at
    the prompt length is at distance 0, and the rows keep their predictions."""
    sample = samples[0]
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=6, progress=False)
    plain = run_suite(llama_gqa, tok, [sample], ["snapkv", "slake"], [40, 4096], tmp_path / "plain", **kw)
    rows = run_suite(llama_gqa, tok, [sample], ["snapkv", "slake"], [40, 4096], tmp_path / "fid", fidelity=True, **kw)
    by_key = {row_key(r): r for r in plain}
    for r in rows:
        assert r["prediction"] == by_key[row_key(r)]["prediction"]
    full = next(r for r in rows if r["method"] == "full")
    assert "kl" not in full
    ids = encode_sample(sample, tok)[0]
    eos = TransformersEngine.from_model(llama_gqa, tok).eos_token_ids()
    capture = capture_prefill(llama_gqa, torch.tensor([ids]))
    ref_tokens = engine_eval.greedy_decode(llama_gqa, capture, capture.replay("full", len(ids)), 4, eos)[0]
    assert len(ref_tokens) == full["new_tokens"] == 4  # the sample's own cap
    ref = prepare_reference(llama_gqa, [Continuation("answer", "s", ids, ref_tokens)])
    for r in rows:
        if r["method"] == "full":
            continue
        assert r["kl_tokens"] == 3  # the first answer token comes from the exact prefill: not counted
        (expected,) = measure_outputs(llama_gqa, ref, r["method"], r["budget"])
        for key in ("kl", "delta_nll", "top1"):
            assert r[key] == pytest.approx(expected[key], abs=1e-5), (r["method"], r["budget"], key)
        if r["budget"] == 4096:
            assert r["kl"] == pytest.approx(0.0, abs=1e-6) and r["top1"] == 1.0


def test_fidelity_rows_in_batches_equal_single_rows(llama_gqa, tok, samples, tmp_path):
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=4, progress=False, fidelity=True)
    single = run_suite(llama_gqa, tok, samples, ["cake"], [40], tmp_path / "one", **kw)
    batched = run_suite(llama_gqa, tok, samples, ["cake"], [40], tmp_path / "four", batch_size=4, **kw)
    by_key = {row_key(r): r for r in single}
    for r in batched:
        ref = by_key[row_key(r)]
        assert r["prediction"] == ref["prediction"] and r.get("kl_tokens") == ref.get("kl_tokens")
        if r["method"] != "full":
            assert r["kl"] == pytest.approx(ref["kl"], rel=1e-4, abs=1e-6)


def test_fidelity_and_the_prefill_cache_are_refused_where_they_cannot_work(llama_gqa, tok, samples, tmp_path):
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="fidelity"):
        run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], tmp_path, fidelity=True, prefill_chunk=32, **kw)
    with pytest.raises(ValueError, match="fidelity"):
        run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], tmp_path, fidelity=True, query_aware=False, **kw)

    # the vLLM engine does not say it supports them: refused before anything loads
    with pytest.raises(ValueError, match="--engine vllm does not support --prefill-cache, --fidelity"):
        make_engine("vllm").check(prefill_cache="dir", fidelity=True)
    make_engine("transformers").check(prefill_cache="dir", fidelity=True)


def test_time_left_weighs_prompts_by_their_tokens():
    now = [0.0]
    reqs = [
        EvalRequest(
            key=0, prefill_ids=[1] * 100, question_ids=[], max_new_tokens=1, group="a", pairs=(("full", None),)
        ),
        EvalRequest(
            key=1,
            prefill_ids=[1] * 300,
            question_ids=[],
            max_new_tokens=1,
            group="a",
            pairs=(("full", None), ("snapkv", 64), ("snapkv", 128)),
        ),
    ]
    left = TimeLeft(reqs, clock=lambda: now[0])
    assert left.seconds_left() is None and "after the first prompt" in left.describe()
    now[0] = 10.0
    left.update(0)  # 100 of 400 tokens in 10 s: 300 left, 30 s
    assert left.seconds_left() == pytest.approx(30.0)
    now[0] = 40.0
    left.update(1)
    left.update(1)  # 300 of 400 done in 40 s
    assert left.seconds_left() == pytest.approx(40.0 / 300 * 100)
    left.update(1)
    assert left.seconds_left() == 0.0
    assert [format_duration(x) for x in (5, 725, 11220)] == ["5s", "12m05s", "3h07m"]


def test_fidelity_refuses_to_resume_rows_written_without_it(llama_gqa, tok, samples, tmp_path):
    """A run with fidelity over a folder of rows written without it resumed them with no distance and said nothing
    (2026-11-30); rows it does not resume, and rows written with fidelity, are no obstacle."""
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False)
    out = tmp_path / "run"
    run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], out, **kw)
    with pytest.raises(ValueError, match=r"--fidelity: 1 compressed row\(s\) .* were written without --fidelity"):
        run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [40], out, fidelity=True, **kw)
    rows = run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [48], out, fidelity=True, **kw)
    assert [r["budget"] for r in rows if r["method"] != "full"] == [48] and "kl_tokens" in rows[-1]
    again = run_suite(llama_gqa, tok, samples[:1], ["snapkv"], [48], out, fidelity=True, **kw)
    assert again == []


def _requests(n_prompts: int, n_pairs: int) -> list:
    pairs = tuple(("snapkv", 64 * (i + 1)) for i in range(n_pairs))
    return [
        EvalRequest(key=k, prefill_ids=[1] * 100, question_ids=[], max_new_tokens=1, group="a", pairs=pairs)
        for k in range(n_prompts)
    ]


def test_time_left_waits_for_a_whole_prompt_when_a_prompt_is_replayed_pair_by_pair():
    """The transformers engine prefills a prompt once, then replays every pair: the first output carries the prompt's
    prefill but was credited one pair's share, and the estimate was several times the time left (a KVzip run showed
    ~8h20m left after its first output and ~1h27m after its seventh). Now the estimate waits for the first whole
    prompt."""
    now = [0.0]
    left = TimeLeft(_requests(3, 4), clock=lambda: now[0])
    now[0] = 9.0  # prefill 8 s + one pair 1 s
    left.update(0)
    assert left.seconds_left() is None and "after the first prompt" in left.describe()
    now[0] = 12.0  # the other three pairs, 1 s each: one prompt costs 12 s
    for _ in range(3):
        left.update(0)
    assert left.seconds_left() == pytest.approx(24.0)  # two prompts left


def test_time_left_starts_once_every_prompt_has_an_output_when_pairs_run_over_all_prompts():
    """An engine that runs each pair over every prompt at once (vLLM) completes no prompt until its last pair: the
    estimate starts once each prompt has one output."""
    now = [0.0]
    left = TimeLeft(_requests(2, 3), clock=lambda: now[0])
    now[0] = 5.0
    left.update(0)
    assert left.seconds_left() is None
    now[0] = 10.0
    left.update(1)
    assert left.seconds_left() == pytest.approx(20.0)  # one pair of three done for both prompts in 10 s
