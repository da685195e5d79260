"""The vLLM engine's evaluation: for each (method, budget) pair, every pending prompt as one vLLM batch.

One vLLM engine is started per pair with that plugin configuration (plain vLLM for the full cache), and every
pending prompt of the pair is submitted at once (vLLM schedules them as a batch; prompts with different generation
caps go in separate calls), greedy, stopping on the model's end-of-sequence ids. The plugin gets the pair as
``vllm serve`` users write it and applies the model's profile itself; outputs carry vLLM's block accounting
(``kv_blocks_end``) and the hyperparameters and profile the plugin reports it ran with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

from slake.budgets.budget import Budget
from slake.engines.base import EvalOutput, EvalRequest

__all__ = ["evaluate"]


def evaluate(
    requests: Sequence[EvalRequest],
    *,
    model_dir: str,
    dtype: str,
    stop: list[int],
    block_size: int = 32,
) -> Iterator[EvalOutput]:
    """Every pending pair of every request (see the module docstring); one :class:`EvalOutput` each.

    ``model_dir`` is the folder vLLM loads, ``dtype`` its dtype, ``stop`` the end-of-sequence ids."""
    from slake.engines.vllm.plugin.config import plugin_config
    from slake.engines.vllm.runner import model_context_limit, model_len, run_vllm

    by_pair: dict[tuple, list[EvalRequest]] = {}
    for req in requests:
        for pair in req.pairs:
            by_pair.setdefault(pair, []).append(req)
    if not by_pair:
        return
    limit = model_context_limit(model_dir)
    for (method, budget), todo in by_pair.items():
        cfg = None if budget is None else plugin_config(method, Budget(budget))
        groups: dict[int, list[EvalRequest]] = {}
        for req in todo:  # one generation length per vLLM call
            groups.setdefault(req.max_new_tokens, []).append(req)
        for cap, group in groups.items():
            prompts = [req.prefill_ids for req in group]
            start = time.perf_counter()
            run = run_vllm(
                model_dir,
                prompts,
                slake=cfg,
                max_new_tokens=cap,
                block_size=block_size,
                dtype=dtype,
                max_model_len=model_len(max(map(len, prompts)), cap, limit),
                stop_token_ids=stop,
                max_num_seqs=max(len(prompts), 1),
            )
            wall = time.perf_counter() - start
            ran = run.plugin or {}
            for i, req in enumerate(group):
                steps = max(len(run.tokens[i]) - 1, 0)
                ms = run.decode_ms_per_token[i]
                yield EvalOutput(
                    key=req.key,
                    method=method,
                    budget=budget,
                    tokens=list(run.tokens[i]),
                    prompt_tokens=len(prompts[i]),
                    prefill_s=run.prefill_s[i],
                    decode_s=None if math.isnan(ms) else round(ms * steps / 1000, 5),
                    compressed=bool(run.compressed[i]),
                    kv_bytes=run.kv_bytes[i],
                    max_new_tokens=cap,
                    batch_size=len(group),
                    profile=ran.get("profile"),
                    hyperparameters=ran.get("hyperparameters"),
                    extra={"kv_blocks_end": run.blocks_end[i], "engine_wall_s": round(wall, 3)},
                )
