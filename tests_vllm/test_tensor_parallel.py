"""Tensor parallelism: each rank compresses the KV heads it holds and gives the one-rank engine's tokens.

vLLM splits a layer's KV heads across ranks with their query groups, and ``o_proj``'s input columns with them, so a
per-head method scores each KV head on its rank from everything it reads with one rank: its group's queries, the
rotary embedding (Expected Attention's statistics moved to future positions) and the columns of ``W_o`` that
multiply the head's values (CriticalKV's ``||W_o v||_1``). Two ranks on the tiny model (2 KV heads: one per rank),
each bound to its own CPU core, run in a child process (vLLM's CPU workers are spawned processes); their greedy
tokens must equal the transformers engine's, batch 1, for every prompt. The methods whose selection would need the
other ranks' heads (TOVA's layer-wide mean, CAKE/SLAKE's cascade over the model) are refused at start-up with one
rank's engine configuration (``tests_vllm/test_serve_guard_fixes.py``, and below on a real engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BUDGET, NEW_TOKENS, hf_generate

#: the child: one two-rank engine, every prompt in one batch, greedy, exactly NEW_TOKENS each
_RUN = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    model, method, budget, prompts, new = sys.argv[1:6]
    budget, prompts, new = int(budget), json.loads(prompts), int(new)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32, max_model_len=1024,
              enable_chunked_prefill=False, enable_prefix_caching=False, enforce_eager=True,
              tensor_parallel_size=2, distributed_executor_backend="mp",
              additional_config={"slake": {"method": method, "budget": budget}})
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def _two_ranks(model_dir: str, method: str, prompts: list[list[int]]) -> subprocess.CompletedProcess:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two tensor-parallel ranks need two CPU cores")
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}",  # one core per rank (one NUMA node here)
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    args = [model_dir, method, str(BUDGET), json.dumps(prompts), str(NEW_TOKENS)]
    return subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env, timeout=600)


def test_two_ranks_give_the_transformers_engines_tokens(tiny_dir, prompts):
    """CriticalKV with the Expected Attention scorer reads all three per-rank facts (queries, rotary, ``W_o``'s
    columns); the compressed prompts must also differ from the full cache somewhere, or nothing was tested."""
    method = "criticalkv[scorer=expected-attention]"
    done = _two_ranks(tiny_dir, method, prompts)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    tokens = json.loads(line[len("RESULT ") :])
    expected = [hf_generate(tiny_dir, p, method, BUDGET, NEW_TOKENS) for p in prompts]
    assert tokens == expected
    full = [hf_generate(tiny_dir, p, None, BUDGET, NEW_TOKENS) for p in prompts]
    assert any(t != f for t, f, p in zip(tokens, full, prompts) if len(p) > BUDGET)


def test_two_ranks_refuse_a_cascade(tiny_dir, prompts):
    """SLAKE's layer budgets need every rank's heads: the two-rank engine stops at start-up with the reason."""
    done = _two_ranks(tiny_dir, "slake", prompts[:1])
    assert done.returncode != 0
    assert "tensor parallelism splits across ranks" in done.stderr, done.stderr[-3000:]
