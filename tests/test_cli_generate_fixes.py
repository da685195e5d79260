"""``slake generate``, ``slake make-prompt``, ``slake methods`` and ``slake.generate`` say what ran: every ``--set``
counts, byte counts compare like with like, counts and timings that do not exist are not printed as numbers, and
bad input (a repeated hyperparameter, sampling options without ``--sample``, a prompt that is not UTF-8, a
misplaced ``--depth`` or ``--gguf-file``, a missing model directory) is refused with a clear message."""

from __future__ import annotations

import io
import json

import pytest

import slake
from slake.cli import main
from slake.engines.result import GenerationResult
from slake.engines.transformers import models
from tiny_models import tiny_model, word_tokenizer

#: Gemma 3 270M's kv_bytes for SLAKE at budget 64 on 1023 tokens: the sliding-window layers hold most of the cache
GEMMA_SLAKE = {"full": 22007808, "kept": 393216, "padding": 0, "slack": 6144, "metadata": 2535,
               "linear_state": 792588, "sliding": 15697920}  # fmt: skip


class FakeEngine:
    """An engine that loads nothing: it records what ``slake generate`` asked and returns a set result."""

    name = "transformers"

    def __init__(self, **result) -> None:
        self.asked: dict = {}
        self.result = {
            "texts": ["w5 w6"], "prompt_tokens": [300], "new_tokens": [2], "method": "snapkv", "budget": 64,
            "kv_bytes": dict(GEMMA_SLAKE), "kept_tokens_per_layer": [64.0], "compressed": True, "prefill_s": 0.5,
            "decode_ms_per_token": 7.0,
        } | result  # fmt: skip

    def check(self, **options) -> None:
        pass

    def check_pair(self, method, budget) -> None:
        pass

    def generate(self, prompt, **kwargs) -> GenerationResult:
        self.asked = {"prompt": prompt, **kwargs}
        return GenerationResult(**self.result)


def _engine(monkeypatch, **result) -> FakeEngine:
    engine = FakeEngine(**result)
    monkeypatch.setattr("slake.cli.generate.engine_from_args", lambda args: engine)
    return engine


def _no_engine(monkeypatch) -> None:
    def refuse(args):
        raise AssertionError("bad input must be refused before the model loads")

    monkeypatch.setattr("slake.cli.generate.engine_from_args", refuse)


GEN = ["generate", "--prompt", "w3 w4 w5", "--budget", "64"]


# 1. --set


def test_every_set_option_counts_and_names_are_read_as_in_a_method_spec(monkeypatch, capsys):
    """``--set window=16 --set sinks=4`` ran with window 32 (each ``--set`` replaced the last); ``--set WINDOW=16``
    was an unknown hyperparameter; ``--set window=16 window=8`` silently used 8 where the spec form is refused."""
    engine = _engine(monkeypatch)
    assert main([*GEN, "--set", "window=16", "--set", "SINKS=4", "--json"]) == 0
    assert engine.asked["window"] == 16 and engine.asked["sinks"] == 4
    assert json.loads(capsys.readouterr().out)["hyperparameters"]["window"] == 16
    _no_engine(monkeypatch)
    for argv in (["--set", "window=16", "window=8"], ["--set", "window=16", "--set", "Window=8"]):
        assert main([*GEN, *argv]) == 2
        assert "--set sets 'window' twice" in capsys.readouterr().err


# 2. and 5. make-prompt


def _make_prompt(tmp_path, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: word_tokenizer())
    return main(["make-prompt", "--length", "300", "--out", str(tmp_path / "doc.txt"), *argv])


def test_make_prompt_writes_the_prompt_whose_tokens_it_counts(tmp_path, monkeypatch, capsys):
    """For RULER tasks the file lacked the answer prefix that the printed count (and the evaluation's prompt)
    includes: 478 tokens written, 493 printed."""
    from slake.eval.sample import count_tokens

    assert _make_prompt(tmp_path, monkeypatch, "--task", "niah_single_1") == 0
    text = (tmp_path / "doc.txt").read_text(encoding="utf-8")
    printed = int(capsys.readouterr().err.split("(")[1].split(" tokens")[0])
    assert count_tokens(word_tokenizer(), text) == printed
    assert text.endswith("mentioned in the text above is")  # the answer prefix opens the answer


def test_make_prompt_to_standard_output_writes_the_same_text_as_to_a_file(tmp_path, monkeypatch, capsys):
    """It added a newline, which `generate --no-chat-template --prompt-file -` sent as one more token after the
    answer prefix."""
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: word_tokenizer())
    argv = ["make-prompt", "--length", "300", "--task", "niah_single_1"]
    assert main([*argv, "--out", str(tmp_path / "doc.txt")]) == 0
    capsys.readouterr()
    assert main([*argv, "--out", "-"]) == 0
    assert capsys.readouterr().out == (tmp_path / "doc.txt").read_text(encoding="utf-8")


def test_make_prompt_refuses_depth_for_a_task_without_a_needle(tmp_path, monkeypatch, capsys):
    for task in ("vt", "cwe", "fwe", "qa_1", "qa_2"):
        assert _make_prompt(tmp_path, monkeypatch, "--task", task, "--depth", "10") == 2
        assert f"--depth places a needle: task {task} has none" in capsys.readouterr().err
    assert not (tmp_path / "doc.txt").exists()
    assert _make_prompt(tmp_path, monkeypatch, "--task", "niah_single_1", "--depth", "10") == 0


# 3., 10. and 12. generate's text output


def test_generate_prints_every_byte_the_cache_holds_beside_full(monkeypatch, capsys):
    """On Gemma 3 the line read ``full 22,007,808 kept 393,216 padding 0 linear state 792,588`` (about 5%), where
    the cache holds 77% of ``full``: the sliding-window layers, slack and metadata were left out."""
    _engine(monkeypatch)
    assert main(GEN) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("KV bytes"))
    held = sum(v for k, v in GEMMA_SLAKE.items() if k != "full")
    assert line == (
        f"KV bytes: full 22,007,808  held {held:,} = kept 393,216 + padding 0 + slack 6,144 + metadata 2,535 + "
        "linear state 792,588 + sliding 15,697,920"
    )


def test_the_full_method_is_not_said_to_fit_in_the_budget(monkeypatch, capsys):
    _engine(monkeypatch, method="full", compressed=False, prompt_tokens=[419])
    assert main([*GEN, "--method", "full"]) == 0
    out = capsys.readouterr().out
    assert "(the full method keeps every token)" in out and "fits in the budget" not in out
    _engine(monkeypatch, compressed=False, prompt_tokens=[30])
    assert main(GEN) == 0
    assert "prompt fits in the budget" in capsys.readouterr().out


def test_no_decode_time_is_printed_when_no_decode_step_was_timed(monkeypatch, capsys):
    """``--max-new-tokens 1`` printed ``decode 0.0 ms/token``."""
    _engine(monkeypatch, new_tokens=[1], decode_ms_per_token=0.0)
    assert main([*GEN, "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("decode n/a")
    assert main([*GEN, "--max-new-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_ms_per_token"] is None
    _engine(monkeypatch, decode_ms_per_token=7.0)
    assert main(GEN) == 0
    assert "decode 7.0 ms/token" in capsys.readouterr().out


# 4. and 15. models


def test_gguf_file_is_refused_where_the_model_names_its_own_file(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for name in ("smollm2", None, str(gguf)):
        with pytest.raises(ValueError, match="names its own file: drop it"):
            models.resolve_model(name, "other.gguf")
    assert models.resolve_model(str(tmp_path), "m.gguf") == (str(tmp_path), "m.gguf")


def test_a_missing_local_model_directory_is_named_as_such(tmp_path, monkeypatch):
    """It gave huggingface_hub's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    monkeypatch.chdir(tmp_path)
    for name in (str(tmp_path / "nope"), "./nope", "../nope", "~/surely-no-such-slake-model", "runs/a/nope"):
        with pytest.raises(FileNotFoundError, match="no such model directory: "):
            models.resolve_model(name)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        models.load_tokenizer("./nope")
    assert models.resolve_model("org/model") == ("org/model", None)  # a hub id


def test_a_prompt_file_that_is_a_directory_is_named_as_such(tmp_path, monkeypatch, capsys):
    _no_engine(monkeypatch)
    assert main(["generate", "--prompt-file", str(tmp_path)]) == 2
    assert f"prompt file {tmp_path} is a directory" in capsys.readouterr().err


# 6. prompts that are not UTF-8


def test_a_prompt_that_is_not_utf8_is_refused_before_the_model_loads(monkeypatch, capsys):
    """Standard input read under the C locale (surrogateescape) and an argument of non-UTF-8 bytes became text with
    lone surrogates, and the tokenizer then failed with a TypeError traceback."""
    _no_engine(monkeypatch)
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe abc"), encoding="ascii", errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["generate", "--prompt-file", "-"]) == 2
    assert "the prompt on standard input is not UTF-8 text (byte 0" in capsys.readouterr().err
    assert main(["generate", "--prompt", "w2 \udcff w3"]) == 2
    assert "the prompt given with --prompt is not UTF-8 text" in capsys.readouterr().err


def test_a_utf8_prompt_on_standard_input_is_read(monkeypatch):
    engine = _engine(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("café\r\nw3".encode()), encoding="ascii"))
    assert main(["generate", "--prompt-file", "-", "--budget", "64", "--json"]) == 0
    assert engine.asked["prompt"] == "café\nw3"


# 9. and 11. sampling options


def test_sampling_options_without_sample_are_refused(monkeypatch, capsys):
    """``--temperature -3 --top-p 7`` without ``--sample`` ran greedy and exited 0."""
    _no_engine(monkeypatch)
    assert main([*GEN, "--temperature", "-3", "--top-p", "7"]) == 2
    assert "--temperature and --top-p only apply with --sample" in capsys.readouterr().err
    assert main([*GEN, "--top-p", "0.9"]) == 2
    assert "--top-p only applies with --sample" in capsys.readouterr().err
    engine = _engine(monkeypatch)
    assert main([*GEN, "--sample", "--json"]) == 0  # the documented defaults under --sample
    assert (engine.asked["do_sample"], engine.asked["temperature"], engine.asked["top_p"]) == (True, 1.0, 1.0)


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_a_temperature_that_is_not_a_finite_positive_number_says_so(monkeypatch, capsys, value):
    """``--temperature inf`` said it "must lie in (0.0, inf]"."""
    _no_engine(monkeypatch)
    assert main([*GEN, "--sample", "--temperature", value]) == 2
    assert "--temperature must be a finite number > 0, got " in capsys.readouterr().err


# 14. PyramidKV's beta


@pytest.mark.parametrize("method", ["pyramidkv", "ada-pyramidkv"])
@pytest.mark.parametrize("beta", ["0", "-2", "0.5"])
def test_pyramid_beta_is_checked_when_the_method_is_built(monkeypatch, capsys, method, beta):
    """``beta <= 0`` was accepted until the budgets were computed, after the model loaded ("invalid pyramid
    arguments"); ``beta <= 0.5`` gives the largest layer no budget (or a negative one)."""
    _no_engine(monkeypatch)
    assert main([*GEN, "--method", method, "--set", f"beta={beta}"]) == 2
    assert f"{method}: beta must be > 0.5" in capsys.readouterr().err
    assert slake.make_method(method, beta=0.6).beta == 0.6


# 13. slake methods


def test_methods_lists_every_hyperparameter_with_its_default(capsys):
    assert main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["methods"]
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 * len(rows)
    for row, hyper in zip(rows, lines[2::3]):
        values = dict(item.split("=", 1) for item in hyper.split("hyperparameters: ")[1].split())
        assert values == {k: v if isinstance(v, str) else json.dumps(v) for k, v in row["hyperparameters"].items()}
    assert "window=32" in lines[2] and "linear_cache=false" in lines[2]


# 7. and 8. slake.generate


def _prompts() -> list[str]:
    return [" ".join(f"w{3 + i % 200}" for i in range(40)), " ".join(f"w{5 + (7 * i) % 100}" for i in range(25))]


def test_full_bytes_count_the_tokens_an_uncompressed_cache_holds():
    """``full`` counted the last generated token, which is never fed back: with the full method it exceeded
    ``kept`` by one token per sequence."""
    model, tok = tiny_model("llama-gqa", layers=2), word_tokenizer()
    for prompts in (_prompts()[:1], _prompts()):
        res = slake.generate(model, tok, prompts, method="full", budget=1024, max_new_tokens=3)
        assert res.kv_bytes["full"] == res.kv_bytes["kept"]
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V, layers, KV heads, head dim, fp32
    assert res.kv_bytes["full"] == bytes_per_token * (40 + 25 + 2 * 2)


def test_new_tokens_stop_at_an_end_token_of_the_generation_config():
    """Rows ending on an end token that only the model's generation config lists were counted to the end of the
    batch's padding (``[171, 205, 1, 1, 1, 1]`` counted 3 with end tokens ``[1, 205]``)."""
    model, tok = tiny_model("llama-gqa", layers=2), word_tokenizer()
    free = slake.generate(model, tok, _prompts(), method="full", budget=1024, max_new_tokens=6)
    row0, row1 = free.sequences[:, -6:].tolist()
    end = row0[1]
    assert end not in (row0[0], *row1, tok.eos_token_id, tok.pad_token_id)  # the greedy rows this test relies on
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    res = slake.generate(model, tok, _prompts(), method="full", budget=1024, max_new_tokens=6)
    assert res.sequences[0, -4:].tolist() == [tok.pad_token_id] * 4  # padding after row 0's end: not counted
    assert res.new_tokens == [2, 6]
    assert res.texts[0] == tok.decode(row0[:2], skip_special_tokens=True).strip()
