"""Integration tests on the real default model, SmolLM2-135M-Instruct (packaged GGUF, CPU, fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

import slake
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import format_prompt
from slake.engines.transformers.prefill_once import capture_prefill, greedy_decode
from slake.eval.needle import needle_sample
from slake.methods.base import PrefillScores
from slake.methods.snapkv import SnapKV

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_model():
    try:
        return slake.load_model()
    except FileNotFoundError as e:  # the package is part of `make setup`; say what is missing if it is not
        pytest.fail(str(e))


def _needle_prompt(tokenizer, length, seed=0, kind="number"):
    s = needle_sample(tokenizer, length, 50.0, kind=kind, seed=seed)
    return format_prompt(tokenizer, s.context + s.question), s.answers, s.metadata["needle"]


@dataclass
class _ForcedSnapKV(SnapKV):
    """SnapKV whose scores put a bonus on given positions (the needle sentence)."""

    positions: tuple = ()

    def prefill_scores(self, inputs):
        r = super().prefill_scores(inputs)
        s = r.scores.clone()
        s[..., list(self.positions)] += 10.0
        return PrefillScores(scores=s)


def test_needle_at_2k_full_cache_and_snapkv(default_model):
    """The full cache answers a numeric needle in a ~2K-token essay document.

    SnapKV at budget 1024 runs and compresses; on this 135M model it often keeps only the first digits of the number
    (measured by hand when the test was written: 1 of 5 seeds at 2K), so its answer is reported, not asserted. What is
    asserted is that the compressed cache decodes correctly: when the needle sentence is among the kept tokens, a cache
    of 512 tokens per layer (a quarter of the prompt) gives the exact answer.
    """
    model, tok = default_model
    prompt, answers, needle = _needle_prompt(tok, 2048)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    assert 1900 < ids.shape[1] < 2200
    start = len(tok(prompt[: prompt.index(needle)], add_special_tokens=False).input_ids)
    capture = capture_prefill(model, ids)

    def answer(method, budget):
        cache = capture.replay(method, budget)
        tokens = greedy_decode(model, capture, cache, 40, eos_token_ids=[tok.eos_token_id])
        return tok.decode(tokens[0], skip_special_tokens=True), cache

    text, _ = answer("full", 1)
    assert answers[0] in text, f"full cache answered {text!r}, expected {answers}"
    text, cache = answer("snapkv", 1024)
    assert cache.statistics()["compressed"] is True and text
    print(f"snapkv@1024 answered {text!r} (expected {answers[0]})")
    forced = _ForcedSnapKV(positions=tuple(range(start - 2, start + 18)))
    text, cache = answer(forced, 512)
    assert cache.statistics()["compressed"] is True
    assert answers[0] in text, f"needle kept, budget 512: answered {text!r}, expected {answers}"


@pytest.mark.parametrize("method", ["slake", "cake", "h2o"])
def test_methods_run_on_the_default_model(default_model, method):
    model, tok = default_model
    prompt, _, _ = _needle_prompt(tok, 1024, seed=1)
    res = slake.generate(model, tok, prompt, method=method, budget=128, max_new_tokens=8, chat_template=False)
    L = model.config.num_hidden_layers
    assert res.compressed
    assert len(res.kept_tokens_per_layer) == L
    assert abs(sum(res.kept_tokens_per_layer) - 128 * L) < 1e-6  # budgets sum exactly, decode keeps the size
    assert res.kv_bytes["kept"] < res.kv_bytes["full"]
    assert (res.kv_bytes["linear_state"] > 0) == (method == "slake")
    assert res.texts[0]


def test_cli_generate_json_reports_honest_statistics(tmp_path, default_model):
    model, tok = default_model
    prompt, _, _ = _needle_prompt(tok, 1024, seed=2)
    f = tmp_path / "doc.txt"
    f.write_text(prompt.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "slake.cli",
            "generate",
            "--method",
            "snapkv",
            "--budget",
            "128",
            "--prompt-file",
            str(f),
            "--max-new-tokens",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "text",
        "prompt_tokens",
        "new_tokens",
        "method",
        "budget",
        "kv_bytes",
        "kept_tokens_per_layer",
        "prefill_s",
        "decode_ms_per_token",
    ):
        assert key in data
    assert set(data["kv_bytes"]) >= {"full", "kept", "linear_state"}
    L = model.config.num_hidden_layers
    assert data["kept_tokens_per_layer"] == [128.0] * L
    head_dim, kv_heads = 64, model.config.num_key_value_heads
    assert data["kv_bytes"]["kept"] == 128 * L * kv_heads * head_dim * 2 * 4  # fp32 K and V
    fed = data["prompt_tokens"] + data["new_tokens"] - 1  # the last new token is never fed back into a cache
    assert data["kv_bytes"]["full"] == fed * L * kv_heads * head_dim * 2 * 4
    assert data["kv_bytes"]["linear_state"] == 0
    assert data["new_tokens"] >= 1 and data["prefill_s"] > 0


def test_cli_errors_are_clear():
    out = subprocess.run(
        [sys.executable, "-m", "slake.cli", "generate", "--method", "nope", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "unknown method" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "slake.cli", "generate", "--budget", "0", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "budget" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "slake.cli", "generate", "--budget", "16", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "window" in out.stderr


@pytest.fixture(scope="module")
def needle_4k(default_model):
    """A ~4K-token needle document's prefill, captured once per process for the replays below; its answers."""
    model, tok = default_model
    prompt, answers, _ = _needle_prompt(tok, 4096, seed=3)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    return capture_prefill(model, ids), answers


@pytest.mark.parametrize("name", [n for n in slake.available_methods() if n != "full"])
def test_every_method_with_and_without_linear_cache_at_4k(default_model, needle_4k, name):
    """Every registered method, with and without the PTAA linear cache, at budget 1024 on a ~4K needle document.

    Asserted: each one compresses, decodes and keeps its budget; the linear state exists exactly when switched on.
    Whether each answers is measured and reported in the README (docs/results/needle_4k), not asserted: on this
    135M model most eviction methods keep only the first digits of the number at 1024 of 4K tokens. One test per
    method, so that the integration tier's processes share them out.
    """
    from slake.engines.transformers.reconstruction import ReconstructionPrompt, run_second_pass

    model, tok = default_model
    capture, answers = needle_4k
    L = model.config.num_hidden_layers
    # KVzip: its reconstruction pass on the capture, once (the replays below read it)
    run_second_pass(model, capture, slake.make_method(name), ReconstructionPrompt.from_tokenizer(tok))
    for linear in (False, True):
        cache = capture.replay(name, 1024, linear_cache=linear)
        tokens = greedy_decode(model, capture, cache, 12, eos_token_ids=[tok.eos_token_id])
        stats = cache.statistics()
        assert stats["compressed"] and tokens[0]
        assert (stats["kv_bytes"]["linear_state"] > 0) == linear
        assert sum(stats["kept_tokens_per_layer"]) <= 1024 * L + 1e-6
        print(name, linear, repr(tok.decode(tokens[0], skip_special_tokens=True)), answers)


def test_reused_cache_and_prompt_beyond_the_context_are_refused(default_model):
    """Issue 14 on the real model: a used cache given a different 330-token document raises instead of answering
    about the first one, and a prompt beyond the 8K context raises before any forward (unless allowed)."""
    import torch

    model, tok = default_model
    first, _, _ = _needle_prompt(tok, 400, seed=1)
    second, _, _ = _needle_prompt(tok, 330, seed=2)
    cache = slake.SlakeCache("slake", 64, config=model.config)
    kw = dict(**with_cache(model, cache), max_new_tokens=2, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        model.generate(**tok(first, return_tensors="pt", add_special_tokens=False), **kw)
        with pytest.raises(ValueError, match="of an earlier prompt"):
            model.generate(**tok(second, return_tensors="pt", add_special_tokens=False), **kw)
    s = needle_sample(tok, 600, 50.0, seed=3)
    long_prompt = (s.context + "\n") * 16 + s.question  # about 9.6K tokens
    with pytest.raises(ValueError, match="beyond the model's context of 8192 tokens"):
        slake.generate(model, tok, long_prompt, method="slake", budget=128, max_new_tokens=4)
