"""Fixes of the plugin and the vLLM engine's drivers, in vLLM: a preempted request whose prompt fits the budget is
recomputed uncompressed; the offline benchmark's plain rows ignore ``SLAKE_VLLM``, draw token ids inside a small
vocabulary and time the decode steps after the warm-up; ``--no-linear-cache`` reaches the plugin.
(``tests/test_vllm_engine_fixes.py`` has the parts that need no vLLM.)"""

from __future__ import annotations

import math

import torch

from conftest import BUDGET, hf_generate
from slake.engines.vllm.plugin.config import ENV_VAR
from slake.engines.vllm.runner import run_vllm

BLOCK = 32


def test_preempted_prompt_within_the_budget_is_recomputed_uncompressed(tiny_dir):
    """8 usable KV blocks: B (100-token prompt, compressed, 3 blocks) runs beside A (40-token prompt, within the
    budget, never compressed) until A needs a block that is not there; vLLM preempts A and recomputes it from its
    prompt plus the tokens it had generated. The worker decided on that longer sequence (``prompt + generated >
    budget``) and compressed A, whose tokens then left those of its unpreempted run; the decision is the prompt's."""
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, 500, (40,), generator=g).tolist()
    b = torch.randint(3, 500, (100,), generator=g).tolist()
    cfg = {"method": "snapkv", "budget": BUDGET}
    common = dict(slake=cfg, ignore_eos=True, block_size=BLOCK, max_model_len=256)
    small = run_vllm(tiny_dir, [b, a], max_new_tokens=150, max_tokens=[150, 130], num_blocks=9, **common)
    assert small.preemptions[1] >= 1, "the KV memory was not small enough to preempt the short request"
    assert small.compressed == [True, False]
    assert small.kept_tokens_per_layer[1] == [float(40 + 130 - 1)] * 3
    alone = run_vllm(tiny_dir, [a], max_new_tokens=130, **common)
    assert alone.preemptions == [0] and alone.compressed == [False]
    # vLLM's recomputation: the request continues as if it had not been preempted (serving.md)
    assert small.tokens[1] == alone.tokens[0]


def test_bench_plain_row_ignores_slake_vllm_on_a_small_vocabulary(tiny_dir, monkeypatch):
    """The tiny model's vocabulary has 512 ids: the benchmark drew ids up to 999 (IndexError in the embedding);
    its plain row ran with ``SLAKE_VLLM``'s method; and the warm-up's tokens were timed with the decode."""
    from slake.engines.vllm.bench import bench

    monkeypatch.setenv(ENV_VAR, '{"method": "streamingllm", "budget": 32}')
    rows = bench(tiny_dir, requests=2, prompt_len=100, decode_steps=3, warmup=2, methods=[], budget=BUDGET)
    assert [r["method"] for r in rows] == ["full"]
    row = rows[0]
    assert row["new_tokens"] == 1 + 2 + 3 and row["decode_steps_timed"] == 3 and row["decode_ms_per_step"] > 0
    # plain vLLM's blocks (streamingllm@32 would hold ceil(33 / 32) = 2)
    assert row["blocks_after_prefill"] == math.ceil(101 / BLOCK) and row["blocks_end"] == math.ceil(105 / BLOCK)


def test_slake_without_its_linear_state(tiny_dir, prompts):
    """``--no-linear-cache`` (``set: {"linear_cache": false}``) reaches the plugin: SLAKE runs without its linear
    state, with the transformers engine's tokens for ``slake[linear_cache=false]``."""
    ids = prompts[0]
    run = run_vllm(
        tiny_dir,
        [ids],
        slake={"method": "slake", "budget": BUDGET, "set": {"linear_cache": False}},
        max_new_tokens=16,
        ignore_eos=True,
        block_size=BLOCK,
    )
    assert run.compressed == [True] and run.plugin is not None
    assert run.plugin["hyperparameters"]["linear_cache"] is False and run.kv_bytes[0]["linear_state"] == 0
    assert run.tokens[0] == hf_generate(tiny_dir, ids, "slake[linear_cache=false]", BUDGET, 16)
