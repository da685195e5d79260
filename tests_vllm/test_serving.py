"""Serving behaviour of the batched decode: compressed and uncompressed requests decoding in one step, state
released when requests finish, and a preempted compressed request that vLLM recomputes continuing with exactly
the tokens of an unpreempted run."""

from __future__ import annotations

import pytest
import torch

from conftest import BUDGET, hf_generate, preempting_run
from slake.engines.vllm.runner import run_vllm

BLOCK = 32


@pytest.fixture(scope="module")
def mixed_prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (200, 40, 300, 150)]


def test_compressed_and_uncompressed_requests_decode_in_one_step(tiny_dir, mixed_prompts):
    cfg = {"method": "snapkv", "budget": BUDGET}
    run = run_vllm(
        tiny_dir, mixed_prompts, slake=cfg, max_new_tokens=16, ignore_eos=True, block_size=BLOCK, timing=True
    )
    steps = run.step_times
    plain = run_vllm(tiny_dir, [mixed_prompts[1]], slake=None, max_new_tokens=16, ignore_eos=True, block_size=BLOCK)
    # one batched computation per layer held the three compressed requests while the short one decoded beside them
    assert any(r == 3 and n == 4 for r, n, _, _ in steps), steps
    assert run.compressed == [True, False, True, True]
    for i in (0, 2, 3):
        assert run.tokens[i] == hf_generate(tiny_dir, mixed_prompts[i], "snapkv", BUDGET, 16), i
    assert run.tokens[1] == plain.tokens[0]


def test_finished_requests_release_their_rows(tiny_dir, mixed_prompts):
    # 8 compressed requests through 2 running slots: rows are reused, never more than the running requests
    prompts = [mixed_prompts[0], mixed_prompts[2], mixed_prompts[3]] * 2 + [mixed_prompts[0][::-1]] * 2
    run = run_vllm(
        tiny_dir,
        prompts,
        slake={"method": "h2o", "budget": BUDGET},
        max_new_tokens=6,
        ignore_eos=True,
        block_size=BLOCK,
        max_num_seqs=2,
    )
    assert all(run.compressed)
    assert run.plugin is not None and run.plugin["pool_rows"] == 2  # never grew past max_num_seqs
    assert run.plugin["running"] <= 2 and run.plugin["saved"] == 0
    assert run.tokens[0] == run.tokens[3] and run.tokens[1] == run.tokens[4]  # a reused row carries nothing over
    assert all(k == [float(BUDGET)] * 3 for k in run.kept_tokens_per_layer)


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_preempted_compressed_request_gives_the_unpreempted_tokens(tiny_dir, method):
    """B, preempted and recomputed (conftest.preempting_run), must continue as if nothing happened."""
    b, small = preempting_run(tiny_dir, method, BLOCK)
    cfg = {"method": method, "budget": BUDGET}
    assert small.preemptions[1] >= 1, "the KV memory was not small enough to preempt the compressed request"
    assert small.plugin is not None
    assert small.plugin["counters"]["restored"] >= 1  # its kept cache was saved and written back, not recompressed
    alone = run_vllm(tiny_dir, [b], slake=cfg, max_new_tokens=150, ignore_eos=True, block_size=BLOCK, max_model_len=256)
    assert small.preemptions[0] == 0 and alone.preemptions == [0]
    assert len(small.tokens[1]) == 150
    assert small.tokens[1] == alone.tokens[0]
    assert small.tokens[1] == hf_generate(tiny_dir, b, method, BUDGET, 150)
