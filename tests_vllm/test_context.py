"""The model's context on the vLLM engine (``slake.engines.context``): a prompt that fills it exactly runs, one beyond
it is vLLM's own refusal, never a silent cut."""

from __future__ import annotations

import pytest
import torch

from slake.engines.vllm.runner import model_context_limit, model_len, run_vllm

NEW = 8


def test_a_prompt_that_fills_the_context_exactly_runs(tiny_dir):
    """``model_len`` rounded the prompt, its new tokens and one more up to 256, past a context the prompt fits in:
    vLLM refused the run (its ``max_model_len`` beyond the model's ``max_position_embeddings``)."""
    limit = model_context_limit(tiny_dir)
    assert limit == 4096
    ids = torch.randint(3, 500, (limit - NEW,), generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.raises(ValueError, match="max_model_len"):  # what the unbounded length asks of vLLM
        unbounded = model_len(len(ids), NEW)
        run_vllm(tiny_dir, [ids], slake=None, max_new_tokens=NEW, ignore_eos=True, max_model_len=unbounded)
    run = run_vllm(
        tiny_dir,
        [ids],
        slake={"method": "snapkv", "budget": 64},
        max_new_tokens=NEW,
        ignore_eos=True,
        max_model_len=model_len(len(ids), NEW, limit),
    )
    assert len(run.tokens[0]) == NEW and run.compressed[0]
