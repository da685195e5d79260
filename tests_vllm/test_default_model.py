"""The default model (SmolLM2-135M-Instruct; its GGUF converted once to safetensors): vLLM with the plugin prints
the transformers engine's text for every supported method, with fewer KV blocks held than plain vLLM, and
``slake generate --engine vllm --json`` does the same from the command line.

The prompt is a generated ~512-token needle document (4x the budget) run with the chat template, generation stopping on
EOS, as ``slake generate`` does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slake.budgets.budget import Budget
from slake.engines.vllm.generate import generate_vllm
from slake.engines.vllm.plugin.config import PREFERENCE_METHODS, SUPPORTED_METHODS
from slake.methods import make_method

#: the real default model: the integration tier (`-m "not integration"` skips it)
pytestmark = pytest.mark.integration

BUDGET = 128
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def prompt(tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("prompt") / "doc.txt"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "slake.cli",
            "make-prompt",
            "--task",
            "needle",
            "--length",
            "512",
            "--seed",
            "3",
            "--out",
            str(path),
        ],
        check=True,
        capture_output=True,
    )
    return str(path), path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def transformers_results(prompt) -> dict:
    """The transformers engine's result per method (and the full cache), one model load."""
    from slake.engines.transformers.generate import generate
    from slake.engines.transformers.models import load_model

    model, tokenizer = load_model(None, device="cpu", dtype="float32")
    cap = {
        "max_layer_budget": 2 * BUDGET
    }  # the layer cap vLLM gives CAKE/SLAKE (slake.engines.vllm.plugin.config.with_layer_cap)
    return {
        m: generate(
            model,
            tokenizer,
            prompt[1],
            method=m,
            budget=BUDGET,
            max_new_tokens=NEW_TOKENS,
            **(cap if m in PREFERENCE_METHODS else {}),
        )
        for m in ("full", *SUPPORTED_METHODS)
    }


@pytest.fixture(scope="module")
def plain(prompt):
    return generate_vllm(
        prompt[1],
        method=make_method("full"),
        budget=Budget(BUDGET),
        model=None,
        gguf_file=None,
        dtype="float32",
        max_new_tokens=NEW_TOKENS,
    )


def test_plain_vllm_equals_full_cache(plain, transformers_results):
    assert plain.text == transformers_results["full"].text
    assert not plain.compressed


@pytest.fixture(scope="module")
def vllm_result(prompt):
    """``slake generate --engine vllm``'s result per method (made once per module)."""
    done: dict = {}

    def result(method: str):
        if method not in done:
            # a name, as `slake generate` passes it: the default model's profile applies (slake's alpha/beta)
            done[method] = generate_vllm(
                prompt[1],
                method=method,
                budget=Budget(BUDGET),
                model=None,
                gguf_file=None,
                dtype="float32",
                max_new_tokens=NEW_TOKENS,
            )
        return done[method]

    return result


@pytest.mark.parametrize("method", [m for m in SUPPORTED_METHODS if m != "snapkv"])  # snapkv: the CLI test below
def test_default_model_vllm_text_equals_transformers(method, plain, transformers_results, vllm_result):
    hf = transformers_results[method]
    vl = vllm_result(method)
    assert vl.hyperparameters == hf.hyperparameters and vl.profile == hf.profile
    assert vl.text == hf.text
    assert vl.prompt_tokens == hf.prompt_tokens and vl.prompt_tokens[0] > BUDGET
    assert vl.compressed and vl.kept_tokens_per_layer == hf.kept_tokens_per_layer
    extra = vl.extra
    slots = (2 * BUDGET if method in PREFERENCE_METHODS else BUDGET) + 1
    assert extra["kv_blocks_after_prefill"] == extra["kv_blocks_end"] == -(-slots // extra["kv_block_size"])
    assert extra["kv_blocks_end"] < plain.extra["kv_blocks_after_prefill"]
    assert (vl.kv_bytes["linear_state"] > 0) == (method == "slake")
    assert vl.kv_bytes["linear_state"] == hf.kv_bytes["linear_state"]


def test_a_bare_plugin_configuration_runs_what_slake_generate_runs(prompt, transformers_results, vllm_result):
    """``vllm serve --additional-config '{"slake": {"method": "slake", "budget": 128}}'`` gives the plugin a bare
    configuration: the plugin applies the default model's profile itself (the shipped SLAKE alpha and beta), so its
    tokens are ``slake generate --engine vllm``'s and the transformers engine's for the same method and budget."""
    from transformers import AutoTokenizer

    from slake.engines.transformers.generate import format_prompt
    from slake.engines.vllm.generate import stop_token_ids
    from slake.engines.vllm.runner import local_model_dir, model_len, run_vllm

    model_dir = local_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(format_prompt(tokenizer, prompt[1], True), add_special_tokens=False)["input_ids"]
    run = run_vllm(
        model_dir,
        [ids],
        slake={"method": "slake", "budget": BUDGET},
        max_new_tokens=NEW_TOKENS,
        max_model_len=model_len(len(ids), NEW_TOKENS),
        stop_token_ids=stop_token_ids(model_dir, tokenizer),
    )
    hf, cli = transformers_results["slake"], vllm_result("slake")
    assert run.plugin is not None and run.plugin["profile"] is not None
    assert run.plugin["profile"]["values"] == {"alpha": 1.4142, "beta": 0.0}  # the shipped profile's entry
    assert run.plugin["profile"] == hf.profile == cli.profile
    assert run.plugin["hyperparameters"] == hf.hyperparameters == cli.hyperparameters
    assert run.compressed == [True]
    assert str(tokenizer.decode(run.tokens[0], skip_special_tokens=True)) == cli.text == hf.text


def test_cli_generate_engine_vllm_json(prompt, transformers_results):
    cmd = [
        sys.executable,
        "-m",
        "slake.cli",
        "generate",
        "--engine",
        "vllm",
        "--method",
        "snapkv",
        "--budget",
        str(BUDGET),
        "--prompt-file",
        prompt[0],
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)  # stdout holds the JSON object only (vLLM logs go to stderr)
    assert out["text"] == transformers_results["snapkv"].text
    for key in (
        "kv_bytes",
        "kept_tokens_per_layer",
        "prefill_s",
        "decode_ms_per_token",
        "kv_blocks_after_prefill",
        "kv_blocks_end",
    ):
        assert key in out
    assert out["engine"] == "vllm" and out["kv_blocks_end"] == 5


def test_cli_refuses_what_vllm_cannot_honour(prompt):
    cmd = [
        sys.executable,
        "-m",
        "slake.cli",
        "generate",
        "--engine",
        "vllm",
        "--method",
        "pyramidkv",
        "--budget",
        "128",
        "--prompt-file",
        prompt[0],
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2
    assert "slake: method 'pyramidkv' is not supported by the vLLM plugin" in done.stderr
