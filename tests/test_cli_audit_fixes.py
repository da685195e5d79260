"""Fixes from the 2026-11-30 (thirty-fourth) audit of the command line and the memory it reports.

A byte-order mark at the head of a prompt file was given to the model as text; ``slake demo --method FULL`` (or
``full[]``) got past the demo's refusal of the full cache; a seed of 2**64 or more failed after the model loaded,
without naming the option, and ``--seed -1`` was accepted by some commands; and an append-only layer (the full cache,
a prompt within the budget) grew by 256 slots whatever the generation's length, so ``slake generate`` with a short
prompt held 8.6x the full cache's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

import slake
from slake.cli.validation import read_prompt, read_text
from test_cli_input_refusals import _refused, no_model_load  # noqa: F401  (fixture)
from tiny_models import tiny_model, word_tokenizer


def test_a_byte_order_mark_is_not_prompt_text(tmp_path, monkeypatch):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfHello there")
    assert read_text(path) == "Hello there"
    assert read_prompt(None, str(path)) == "Hello there"
    import slake.cli.validation as validation

    monkeypatch.setattr(validation, "_stdin_bytes", lambda: b"\xef\xbb\xbfHello\r\nthere")
    assert read_prompt(None, "-") == "Hello\nthere"
    path.write_bytes("Hello \ufeffthere".encode())  # a mark inside the text is the text's
    assert read_text(path) == "Hello \ufeffthere"


@pytest.mark.parametrize("spelling", ["FULL", "full[]", "Full"])
def test_demo_refuses_the_full_cache_in_any_spelling(spelling, capsys, no_model_load):  # noqa: F811
    _refused(["demo", "--method", spelling, "--length", "256"], "--method full", capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--sample", "--seed", str(2**64)],
        ["generate", "--prompt", "hi", "--sample", "--seed", "-1"],
        ["eval", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "256", "--methods", "snapkv",
         "--budgets", "64", "--samples", "1", "--seed", "-1", "--out"],
        ["bench", "--random-model", "tiny", "--lengths", "64", "--methods", "full", "--seed", "-5", "--out"],
        ["make-prompt", "--task", "needle", "--length", "256", "--seed", str(10**30), "--out"],
    ],
)  # fmt: skip
def test_a_seed_outside_64_bits_is_refused_before_the_model_loads(argv, capsys, tmp_path, no_model_load):  # noqa: F811
    argv = [*argv, str(tmp_path / "out")] if argv[-1] == "--out" else argv
    _refused(argv, "--seed must be an integer from 0 to 2**64 - 1", capsys)


def test_the_python_api_refuses_a_seed_of_65_bits():
    model = tiny_model("llama-gqa", layers=2)
    with pytest.raises(ValueError, match="seed must be below 2"):
        slake.generate(model, word_tokenizer(), "w3 w4 w5", method="snapkv", budget=64, max_new_tokens=1,
                       do_sample=True, seed=2**64, chat_template=False)  # fmt: skip


@pytest.mark.parametrize("method", ["full", "snapkv"])  # snapkv: the prompt fits the budget, nothing is evicted
def test_an_uncompressed_cache_holds_room_for_the_tokens_it_decodes(method):
    model = tiny_model("llama-gqa", layers=2)
    prompt = " ".join(f"w{3 + i}" for i in range(30))
    res = slake.generate(model, word_tokenizer(), prompt, method=method, budget=64, max_new_tokens=6,
                         chat_template=False)  # fmt: skip
    kv = res.kv_bytes
    per_token = kv["kept"] / res.kept_tokens_per_layer[0]  # every layer's keys and values of one token
    assert 0 < kv["slack"] <= per_token * 6 + 1e-6  # before: 256 tokens' room


def test_expect_decode_steps_sizes_the_growth_and_checks_its_input():
    cache = slake.SlakeCache("full", 64, num_layers=2)
    assert cache.compressor.state.growth == 256  # model.generate with a cache of its own: as before
    cache.compressor.expect_decode_steps(40)
    assert cache.compressor.state.growth == 40
    cache.compressor.expect_decode_steps(10_000)
    assert cache.compressor.state.growth == 256
    cache.compressor.expect_decode_steps(np.int64(12))  # numpy integers, as max_new_tokens may be
    assert cache.compressor.state.growth == 12
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="steps must be an integer >= 1"):
            cache.compressor.expect_decode_steps(bad)
