"""Throughput and KV memory of vLLM with and without the plugin: ``slake bench --engine vllm``.

A batch of ``--requests`` prompts of ``--prompt-len`` random tokens is submitted at once (offline ``vllm.LLM``, as
``vllm bench throughput`` does) and each request generates exactly ``--new-tokens`` tokens. For each configuration
(plain vLLM, then each ``--methods`` at ``--budget``) it prints wall time, output tokens/s, total tokens/s, the KV
blocks one request holds after prefill and at the end, and how many such requests one GiB of KV cache holds at
once (blocks per GiB divided by the blocks a request holds at the end).
"""

from __future__ import annotations

import json
import math
import sys

from slake.engines.base import BenchPlan, BenchReport, load_avg


def bench(
    model_dir: str,
    *,
    requests: int,
    prompt_len: int,
    new_tokens: int,
    methods: list[str],
    budget: int,
    block_size: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    include_plain: bool = True,
) -> list[dict]:
    """One row per configuration (``"full"`` = plain vLLM, first when ``include_plain``); see the module docstring
    for the columns. Every configuration gets the same random prompts."""
    import torch

    from slake.engines.vllm.runner import run_vllm

    g = torch.Generator().manual_seed(seed)
    vocab_hi = 1000  # token ids every tokenizer of interest has
    prompts = [torch.randint(10, vocab_hi, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    rows = []
    for method in (["full"] if include_plain else []) + list(methods):
        cfg = None if method == "full" else {"method": method, "budget": budget}
        run = run_vllm(
            model_dir,
            prompts,
            slake=cfg,
            max_new_tokens=new_tokens,
            ignore_eos=True,
            block_size=block_size,
            dtype=dtype,
            max_model_len=prompt_len + new_tokens + block_size,
            max_num_seqs=max(requests, 1),
        )
        info = run.model_info
        block_bytes = (
            block_size * info["layers"] * 2 * info["kv_heads"] * info["head_dim"] * (4 if dtype == "float32" else 2)
        )
        end = max(b for b in run.blocks_end if b is not None)
        generated = sum(len(t) for t in run.tokens)
        rows.append(
            {
                "method": method,
                "budget": None if cfg is None else budget,
                "requests": requests,
                "prompt_len": prompt_len,
                "new_tokens": new_tokens,
                "wall_s": round(run.wall_s, 2),
                "output_tok_s": round(generated / run.wall_s, 2),
                "total_tok_s": round((generated + requests * prompt_len) / run.wall_s, 1),
                "blocks_after_prefill": max(b for b in run.blocks_after_prefill if b is not None),
                "blocks_end": end,
                "block_mib": round(block_bytes / 2**20, 3),
                "requests_per_gib": math.floor((2**30 // block_bytes) / end),
                "decode_ms_per_step": round(sum(run.decode_ms_per_token) / len(run.decode_ms_per_token), 1),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows of :func:`bench` as a markdown table (the columns of the first row)."""
    if not rows:
        return ""
    cols = [c for c in rows[0] if c not in ("engine", "model", "load_avg_1m")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def run_bench(plan: BenchPlan, model_dir: str, dtype: str, model_name: str) -> BenchReport:
    """:func:`bench` per length and budget (plain vLLM once per length) on the model in ``model_dir``; rows appended
    to ``OUT/bench_vllm.jsonl``, this run's table in ``OUT/bench_vllm.md``. Each request generates
    ``warmup + decode_steps`` tokens."""
    methods = [m for m in plan.methods if m != "full"]  # plain vLLM is always measured
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out / "bench_vllm.jsonl", "a", encoding="utf-8") as f:
        for n in plan.lengths:
            for i, b in enumerate(plan.budgets):
                print(f"slake bench (vllm): length {n}, budget {int(b.value)}", file=sys.stderr)
                for row in bench(
                    model_dir,
                    requests=plan.batch,
                    prompt_len=n,
                    new_tokens=plan.warmup + plan.decode_steps,
                    methods=methods,
                    budget=int(b.value),
                    dtype=dtype,
                    seed=plan.seed,
                    include_plain=i == 0,
                ):
                    row.update({"engine": "vllm", "model": model_name, "load_avg_1m": load_avg()})
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
    table = markdown(rows)
    (out / "bench_vllm.md").write_text("# slake bench --engine vllm\n\n" + table + "\n", encoding="utf-8")
    return BenchReport(rows=rows, table=table, files=[out / "bench_vllm.jsonl", out / "bench_vllm.md"])
