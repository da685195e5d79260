"""``slake eval --engine vllm`` and ``slake bench --engine vllm`` on the default model.

The evaluation rows of vLLM with the plugin carry the transformers runner's predictions for the same samples,
methods and budgets (SLAKE with the layer cap written out, so that both engines run the same method), and the
benchmark reports the blocks each configuration holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: the real default model: the integration tier (`-m "not integration"` skips it)
pytestmark = pytest.mark.integration

#: one sample, SLAKE only (snapkv and the other uniform methods are compared through generate): every vLLM engine
#: start costs tens of seconds of CI time
EVAL = [
    "eval",
    "--suite",
    "ruler",
    "--tasks",
    "niah_single_1",
    "--lengths",
    "512",
    "--samples",
    "1",
    "--methods",
    "slake[max_layer_budget=256]",
    "--budgets",
    "128",
    "--max-new-tokens",
    "24",
    "--no-progress",
    "--no-plots",
]


def _slake(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slake.cli", *args], capture_output=True, text=True)


def _rows(folder) -> dict:
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    return {(r["sample_id"], r["method"], r["budget"]): r for r in rows}


@pytest.fixture(scope="module")
def eval_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    for engine in ("transformers", "vllm"):
        done = _slake(*EVAL, "--engine", engine, "--out", str(base / engine))
        assert done.returncode == 0, done.stderr[-3000:]
    return base


def test_eval_engine_vllm_predictions_equal_transformers(eval_dirs):
    hf, vl = _rows(eval_dirs / "transformers"), _rows(eval_dirs / "vllm")
    assert set(hf) == set(vl) and len(vl) == 2  # 1 sample x (full, slake)
    for key, row in vl.items():
        assert row["engine"] == "vllm" and hf[key]["engine"] == "transformers"  # one row builder, both engines
        assert row["prediction"] == hf[key]["prediction"], key
        assert row["score"] == hf[key]["score"] and row["prompt_tokens"] == hf[key]["prompt_tokens"]
        assert row["compressed"] == (key[1] != "full")
        if key[1].startswith("slake"):
            assert row["profile"] == hf[key]["profile"] and row["profile"] is not None  # shipped alpha, beta
            assert row["kv_blocks_end"] == 9  # ceil((256 + 1) / 32)


def test_eval_engine_directories_are_not_mixed(eval_dirs):
    done = _slake(*EVAL, "--engine", "transformers", "--out", str(eval_dirs / "vllm"))
    assert done.returncode == 2 and 'engine "vllm" where this run has "transformers" (--engine)' in done.stderr


def test_bench_engine_vllm_rows(tmp_path):
    done = _slake(
        "bench",
        "--engine",
        "vllm",
        "--methods",
        "full,snapkv",
        "--budget",
        "128",
        "--lengths",
        "512",
        "--batch",
        "1",
        "--decode-steps",
        "2",
        "--warmup",
        "0",
        "--no-progress",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(done.stdout)["rows"]}
    assert set(rows) == {"full", "snapkv"}
    assert rows["full"]["blocks_end"] == 17 and rows["snapkv"]["blocks_end"] == 5  # ceil(513 / 32), ceil(129 / 32)
    assert rows["snapkv"]["requests_per_gib"] > 3 * rows["full"]["requests_per_gib"]
    assert (tmp_path / "bench_vllm.md").is_file() and (tmp_path / "bench_vllm.jsonl").is_file()


def test_bench_engine_vllm_refuses_what_it_cannot_honour(tmp_path):
    for extra, msg in (
        (("--kv-dtype", "int8"), "--kv-dtype"),
        (("--methods", "lava"), "not supported"),
        (("--budget", "0.25"), "absolute budget in tokens"),
    ):
        done = _slake("bench", "--engine", "vllm", "--lengths", "512", "--out", str(tmp_path), *extra)
        assert done.returncode == 2 and msg in done.stderr, done.stderr[-2000:]


def test_eval_engine_vllm_refuses_lengths_beyond_the_models_context(tmp_path):
    """The default model's context is 8,192 tokens: a 9,000-token sample is refused before vLLM starts, in slake's
    words, and with --allow-long-context as an option vLLM cannot honour."""
    args = [*EVAL[:6], "9000", *EVAL[7:], "--engine", "vllm", "--out", str(tmp_path / "run")]
    done = _slake(*args)
    assert done.returncode == 2 and "beyond the model's context of 8192 tokens" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run" / "results.jsonl").exists() or not (tmp_path / "run" / "results.jsonl").read_text()
    done = _slake(*args, "--allow-long-context")
    assert done.returncode == 2 and "--allow-long-context" in done.stderr and "rotary" in done.stderr
