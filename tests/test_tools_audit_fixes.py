"""Fixes to the comparison tools outside the package: ``tools/kvpress_protocol/kvpress_side.py`` (kvpress's side of
``slake eval --protocol kvpress``) and ``tools/reference/`` (the reference fixtures). kvpress is not installed here: a
stand-in module with the names the scripts import runs them on a tiny random Llama."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, rel: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def side() -> types.ModuleType:
    mod = _load("kvpress_side_under_test", "tools/kvpress_protocol/kvpress_side.py")
    hook = mod.Capture.hook

    def renamed(self, module, args, kwargs, output):
        # the kvpress environment's transformers (5.2) hands attention layers ``past_key_values``; newer ones
        # (installed here) name it ``cache``
        if "past_key_values" not in kwargs:
            kwargs = {**kwargs, "past_key_values": kwargs["cache"]}
        return hook(self, module, args, kwargs, output)

    mod.Capture.hook = renamed
    return mod


#: seconds each stand-in press spends in ``compress`` (inside the shared prefill), on :data:`CLOCK`
SLOW = 0.15

#: the clock the script reads in the timing test (:func:`fake_clock`): it moves only when a stand-in press compresses,
#: so the test asserts which interval a time is measured over, not how fast anything ran
CLOCK = {"now": 0.0}


class _Press:
    """A stand-in ``ScorerPress``: keeps the last ``int(S * (1 - ratio))`` entries, slowly."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.compression_ratio = 0.0

    def post_init_from_model(self, model: object) -> None:
        pass

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        CLOCK["now"] += SLOW
        n = int(keys.shape[2] * (1 - self.compression_ratio))
        return keys[:, :, -n:], values[:, :, -n:]

    @contextlib.contextmanager
    def __call__(self, model):
        yield


@pytest.fixture
def fake_kvpress(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("kvpress")
    for name in (
        "AdaKVPress",
        "CriticalAdaKVPress",
        "CriticalKVPress",
        "ExpectedAttentionPress",
        "KeyDiffPress",
        "KnormPress",
        "KVzipPress",
        "PyramidKVPress",
        "SnapKVPress",
        "StreamingLLMPress",
        "TOVAPress",
    ):
        setattr(mod, name, type(name, (_Press,), {}))
    monkeypatch.setitem(sys.modules, "kvpress", mod)
    return mod


def _tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{i}" for i in ids)


def _request(sample_id: str = "niah_single_1-4096-0", task: str = "niah_single_1") -> dict:
    return {
        "task": task,
        "sample_id": sample_id,
        "length": 4096,
        "prefill_ids": list(range(1, 41)),
        "question_ids": [5, 6, 7],
        "max_new_tokens": 4,
        "answers": ["t1"],
        "metric": "kvpress:all",
        "depth": None,
        "sample_digest": "0123456789abcdef",
    }


# ------------------------------------------------------------------------------------------------- kvpress_side.py


@pytest.fixture
def fake_clock(side: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> dict:
    CLOCK["now"] = 0.0
    monkeypatch.setattr(side, "time", types.SimpleNamespace(perf_counter=lambda: CLOCK["now"]))
    return CLOCK


def test_prefill_seconds_exclude_the_presses_compression(side, fake_kvpress, fake_clock):
    """One prefill serves every (press, ratio): its wall time holds every press's ``compress`` call, which each row
    reports as its own ``compress_s``; ``prefill_s`` must be the prefill alone, not the prefill plus every press's
    compression at every ratio (before: ``prefill_s`` >= 4 ratios x SLOW for every row, ``no_press`` included)."""
    ratios = [0.25, 0.5, 0.75, 0.875]
    rows = side.run_request(_tiny_model(), _Tok(), _request(), ["no_press", "knorm"], ratios, eos={0})
    assert [(r["press"], r["compression_ratio"]) for r in rows] == [("no_press", None)] + [("knorm", r) for r in ratios]
    layers = 2  # _tiny_model's: a press compresses each layer inside the one prefill
    assert fake_clock["now"] == pytest.approx(layers * len(ratios) * SLOW)
    for r in rows:
        assert r["prefill_s"] == pytest.approx(0.0, abs=1e-9), r
    for r in rows[1:]:
        assert r["compress_s"] == pytest.approx(layers * SLOW), r


def test_outputs_merge_as_library_rows(side, fake_kvpress):
    """What ``run_request`` writes is what :func:`slake.eval.protocol_outputs.kvpress_rows` merges: every output is
    taken (none skipped as answering another request), at budget ``1 - ratio``, and the kept count is the one the
    stand-in press keeps."""
    from slake.eval.protocol_outputs import kvpress_rows

    req = _request()
    rows = side.run_request(_tiny_model(), _Tok(), req, ["no_press", "knorm"], [0.5], eos={0})
    requests = {"protocol": "kvpress", "model": "tiny", "compression_ratios": [0.5], "seed": 0, "requests": [req]}
    skipped: list[str] = []
    merged = kvpress_rows(requests, rows, skipped=skipped)
    assert skipped == []
    assert [(m["method"], m["budget"]) for m in merged] == [("kvpress:no_press", None), ("kvpress:knorm", 0.5)]
    assert [r["kept"] for r in rows] == [40, 20]


def _write_requests(tmp_path: Path, requests: list[dict]) -> Path:
    payload = {
        "protocol": "kvpress",
        "model": "tiny",
        "model_path": "/nowhere",
        "gguf_file": None,
        "eos_token_ids": [0],
        "compression_ratios": [0.5],
        "seed": 0,
        "requests": requests,
    }
    (tmp_path / "kvpress_requests.json").write_text(json.dumps(payload), encoding="utf-8")
    return tmp_path


class _ModelLoaded(Exception):
    pass


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "niah_single_9"], "niah_single_9"),  # a task the file does not hold
        (["--samples", "0"], "--samples"),
        (["--presses", " , "], "--presses"),
    ],
)
def test_bad_selection_is_refused_before_the_model_loads(side, fake_kvpress, monkeypatch, tmp_path, extra, message):
    """Before: an unknown ``--tasks`` name, ``--samples 0`` or an empty ``--presses`` loaded the model and then ran
    nothing, without a word."""
    d = _write_requests(tmp_path, [_request(), _request("vt-4096-0", "vt")])

    def fake_load(requests, hf_dir):
        raise _ModelLoaded

    monkeypatch.setattr(side, "load_model", fake_load)
    monkeypatch.setattr(sys, "argv", ["kvpress_side.py", "--dir", str(d), *extra])
    with pytest.raises(SystemExit) as e:
        side.main()
    assert message in str(e.value)


def test_tasks_are_split_as_slake_eval_splits_them(side, fake_kvpress, monkeypatch, tmp_path):
    """Before: ``--tasks "niah_single_1, vt"`` looked for a task named `` vt`` and silently ran niah_single_1 only."""
    import importlib.metadata

    d = _write_requests(tmp_path, [_request(), _request("vt-4096-0", "vt")])
    ran: list[str] = []

    def fake_run(model, tok, req, names, ratios, eos):
        ran.append(req["task"])
        return []

    monkeypatch.setattr(side, "load_model", lambda requests, hf_dir: (None, None))
    monkeypatch.setattr(side, "run_request", fake_run)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0")
    monkeypatch.setattr(sys, "argv", ["kvpress_side.py", "--dir", str(d), "--tasks", "niah_single_1, vt"])
    side.main()
    assert ran == ["niah_single_1", "vt"]


def test_a_resumed_run_passes_over_lines_that_are_not_outputs(side, fake_kvpress, monkeypatch, tmp_path, capsys):
    """Before: a line of valid JSON without an output's keys (a list, a record without ``sample_id``) stopped the
    resumed run with a TypeError or KeyError, and the rows of a run resumed after one cut mid-line were appended to
    that partial line, where no reader could parse them."""
    import importlib.metadata

    d = _write_requests(tmp_path, [_request(), _request("vt-4096-0", "vt")])
    done = {"sample_id": _request()["sample_id"], "sample_digest": _request().get("sample_digest"), "press": "knorm"}
    out = d / side.OUTPUTS_FILE
    out.write_text("[1, 2]\n" + '{"press": "knorm"}\n' + json.dumps(done) + '\n{"sample_id": "vt-4', encoding="utf-8")
    ran: list[str] = []

    def fake_run(model, tok, req, names, ratios, eos):
        ran.append(req["task"])
        return [{"sample_id": req["sample_id"], "press": n, "compression_ratio": 0.5, "text": "x"} for n in names]

    monkeypatch.setattr(side, "load_model", lambda requests, hf_dir: (None, None))
    monkeypatch.setattr(side, "run_request", fake_run)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0")
    monkeypatch.setattr(sys, "argv", ["kvpress_side.py", "--dir", str(d), "--presses", "knorm"])
    side.main()
    assert ran == ["vt"]  # the first sample's knorm output was there
    assert "3 line(s) are not outputs" in capsys.readouterr().err
    last = json.loads(out.read_text(encoding="utf-8").splitlines()[-1])
    assert (last["sample_id"], last["press"]) == ("vt-4096-0", "knorm")


def test_converted_model_of_another_gguf_file_is_not_reused(side, monkeypatch, tmp_path):
    """Before: the de-quantised model's default directory was named after the GGUF file's stem only, and any
    directory with a ``config.json`` was taken as done: another model whose file has the same name (``model.gguf``
    of another checkpoint), or a conversion cut before its tokenizer was saved, was loaded silently in its place."""
    import transformers

    converted: list[tuple[str, str]] = []
    loaded: list[str] = []

    class FakeModel:
        def __init__(self, src: str) -> None:
            self.src = src

        def save_pretrained(self, d: Path) -> None:
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "config.json").write_text(json.dumps({"src": self.src}))

        def eval(self) -> FakeModel:
            return self

    class FakeAuto:
        @staticmethod
        def from_pretrained(path, gguf_file=None, **kw):
            if gguf_file is not None:
                converted.append((str(path), gguf_file))
                return FakeModel(f"{path}/{gguf_file}")
            loaded.append(json.loads((Path(path) / "config.json").read_text())["src"])
            return FakeModel(str(path))

    class FakeTok:
        @staticmethod
        def from_pretrained(path, gguf_file=None, **kw):
            return types.SimpleNamespace(save_pretrained=lambda d: None)

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", FakeAuto)
    monkeypatch.setattr(transformers, "AutoTokenizer", FakeTok)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    side.load_model({"model_path": "/ckpt/a", "gguf_file": "model.gguf"}, None)
    side.load_model({"model_path": "/ckpt/b", "gguf_file": "model.gguf"}, None)
    assert loaded == ["/ckpt/a/model.gguf", "/ckpt/b/model.gguf"]
    side.load_model({"model_path": "/ckpt/a", "gguf_file": "model.gguf"}, None)  # made once, then reused
    assert converted == [("/ckpt/a", "model.gguf"), ("/ckpt/b", "model.gguf")]
    # an explicit --hf-dir holding another file's conversion is refused, not loaded
    hf = tmp_path / "hf"
    side.load_model({"model_path": "/ckpt/a", "gguf_file": "model.gguf"}, hf)
    with pytest.raises(SystemExit, match="another --hf-dir"):
        side.load_model({"model_path": "/ckpt/b", "gguf_file": "model.gguf"}, hf)


# ---------------------------------------------------------------------------------------------- reference/compare.py


@pytest.fixture
def compare() -> types.ModuleType:
    return _load("reference_compare_under_test", "tools/reference/compare.py")


def _case(S: int = 24) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "queries": torch.randn(1, 4, S, 16, generator=g),
        "keys": torch.randn(1, 2, S, 16, generator=g),
        "values": torch.randn(1, 2, S, 16, generator=g),
        "scaling": 0.25,
        "source": "test",
    }


def _run_compare(compare, monkeypatch, tmp_path: Path, ref: dict, cases: dict[str, dict], *extra: str) -> Path:
    for stem, case in cases.items():
        torch.save(case, tmp_path / f"{stem}.pt")
    torch.save(ref, tmp_path / "ref.pt")
    out = tmp_path / "fixtures"
    argv = ["compare.py", "--cases", str(tmp_path), "--ref", str(tmp_path / "ref.pt"), "--out", str(out), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    compare.main()
    return out


def _ref(stem: str, failures: dict | None = None) -> dict:
    res = {"window": 4, "budget": 8, "num_layers": 1, "layers": {}}
    return {"versions": {}, "failures": failures or {}, "cases": {f"{stem}/b8": res}}


def test_compare_refuses_a_reference_run_with_failures(compare, monkeypatch, tmp_path):
    """Before: ``reference_side.py`` records a reference that fails (kvpress not importable, a CAKE or LAVa error) and
    goes on; ``compare.py`` then rewrote the committed fixtures and ``summary.json`` without that reference's
    comparisons, and said nothing."""
    failures = {"kvpress": "ModuleNotFoundError(\"No module named 'kvpress'\")"}
    with pytest.raises(SystemExit) as e:
        _run_compare(compare, monkeypatch, tmp_path, _ref("random_gqa_24", failures), {"random_gqa_24": _case()})
    assert "kvpress" in str(e.value) and "--allow-failures" in str(e.value)
    assert not (tmp_path / "fixtures" / "summary.json").exists()
    # asked for explicitly, the fixtures are written without those comparisons
    out = _run_compare(
        compare, monkeypatch, tmp_path, _ref("random_gqa_24", failures), {"random_gqa_24": _case()}, "--allow-failures"
    )
    assert json.loads((out / "summary.json").read_text())["failures"] == failures


def test_compare_refuses_a_model_capture_other_than_the_fixtures(compare, monkeypatch, tmp_path):
    """Before: the default model's fixture is written only for the capture named in ``FIXTURE_MODEL``
    (``model_731``); a capture of another length (another tokenizer or chat template) gave a ``summary.json`` of the
    new capture while the committed ``model_731`` fixture stayed as it was, and its tests kept passing on it."""
    with pytest.raises(SystemExit) as e:
        _run_compare(compare, monkeypatch, tmp_path, _ref("model_24"), {"model_24": _case()})
    assert "model_24" in str(e.value) and compare.FIXTURE_MODEL[0] in str(e.value)


# ----------------------------------------------------------------------------------------------- reference/tokens.py


@pytest.fixture
def tokens() -> types.ModuleType:
    return _load("reference_tokens_under_test", "tools/reference/tokens.py")


class _Started(Exception):
    pass


@pytest.mark.parametrize(
    "argv",
    [["run", "--prompts", "p.txt"], ["run", "--kvpress-venv", "V"], ["prepare"]],
)
def test_tokens_refuses_missing_options_before_starting(tokens, monkeypatch, tmp_path, argv):
    """Before: ``run`` without ``--kvpress-venv`` ran the ``prepare`` step (loading the model) and then failed with
    ``TypeError: unsupported operand type(s) for /: 'NoneType' and 'str'``; without ``--prompts``, ``run`` and
    ``prepare`` failed with ``TypeError: 'NoneType' object is not iterable``."""

    def started(*a: object, **k: object) -> None:
        raise _Started

    monkeypatch.setattr(tokens.subprocess, "run", started)
    monkeypatch.setattr(tokens, "prepare", started)
    monkeypatch.setattr(sys, "argv", ["tokens.py", *argv, "--work", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        tokens.main()
    assert e.value.code == 2


def test_tokens_ours_refuses_an_unknown_case_before_loading_the_model(tokens, monkeypatch, tmp_path):
    """Before: ``ours --cases NAME`` with a name ``cases.json`` lacks loaded the model, then stopped with a bare
    ``StopIteration``."""
    import slake

    (tmp_path / "cases.json").write_text(json.dumps({"max_new_tokens": 4, "cases": [{"name": "needle"}]}))

    def started(*a: object, **k: object) -> None:
        raise _Started

    monkeypatch.setattr(slake, "load_model", started)
    with pytest.raises(SystemExit, match="nedle"):
        tokens.ours_side(tmp_path, ["nedle"])
