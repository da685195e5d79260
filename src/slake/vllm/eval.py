"""``slake eval --engine vllm``: the evaluation suites served by vLLM with the slake plugin.

The samples, prompts (chat template, query-aware), stop tokens, scoring and rows are those of the transformers runner
(:func:`slake.eval.runner.run_suite`); only generation differs: for each (method, budget) pair one vLLM engine is
started with that plugin configuration and every pending sample of the pair is submitted at once (vLLM schedules them
as a batch), greedy, stopping on the model's EOS ids. Rows carry ``"engine": "vllm"`` and vLLM's block accounting
(``kv_blocks_end``). Results of the two engines never share a directory: the resume key does not name the engine,
so a directory holding rows of the other engine is refused.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Sequence

from ..eval.sample import Sample
from ..eval.metrics import score_prediction
from ..eval.results import ResultsWriter, check_engine_dir, row_key
from ..eval.runner import (_decode_text, _pairs, check_pairs, encode_sample, parse_budgets, resolve_methods,
                           target_length)

ENGINE = "vllm"


def run_suite_vllm(
    tokenizer: Any,
    samples: Sequence[Sample],
    methods: str | Sequence[str],
    budgets: str | Sequence[int | float | str],
    out_dir: str | os.PathLike[str],
    *,
    model: str | None = None,
    gguf_file: str | None = None,
    dtype: str | None = None,
    suite: str = "custom",
    model_name: str | None = None,
    seed: int = 0,
    max_new_tokens: int | None = None,
    chat_template: bool = True,
    include_full: bool = True,
    progress: bool = True,
    block_size: int = 32,
) -> list[dict[str, Any]]:
    """Evaluate ``samples`` with vLLM for the full cache (plain vLLM) and every (method, budget) pair.

    Parameters
    ----------
    tokenizer
        The model's tokenizer (the samples were built with it; prompts are encoded as the transformers runner does).
    samples, methods, budgets, out_dir, suite, seed, max_new_tokens, chat_template, include_full, progress
        As :func:`slake.eval.runner.run_suite`. Methods must be supported by the plugin
        (:data:`slake.vllm.config.SUPPORTED_METHODS`) at token budgets; the check runs before any engine starts.
    model, gguf_file, dtype
        As ``slake eval --model/--gguf-file/--dtype``; GGUF models are converted once to safetensors
        (:func:`slake.vllm.engine.local_model_dir`).
    model_name : str, optional
        Model identifier stored in the rows (part of the resume key); ``model`` by default.
    block_size : int
        vLLM's KV block size (a multiple of 32 on CPU).

    Returns
    -------
    list of dict
        The rows written by this call; each has the transformers runner's fields plus ``engine`` and
        ``kv_blocks_end``. ``prefill_s`` and ``decode_s`` are vLLM's per-request timings (concurrent requests).
    """
    from tqdm.auto import tqdm

    from ..budget_spec import Budget
    from ..models import DEFAULT_MODEL
    from .config import plugin_config, resolve_plugin_method, vllm_dtype
    from .engine import local_model_dir, model_config, model_len, run_vllm
    from .generate import stop_token_ids

    method_names = resolve_methods(methods)
    budget_values = parse_budgets(budgets) if method_names else []
    check_pairs(method_names, budget_values)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for m in method_names:  # every method is checked before the model is converted or an engine starts
        for b in budget_values:
            resolve_plugin_method(m, Budget(b))
    dtype = vllm_dtype(dtype)
    model_dir = local_model_dir(model, gguf_file, dtype)
    config = model_config(model_dir, model)
    # the model's profile, as the transformers runner applies it
    resolved = {(m, b): resolve_plugin_method(m, Budget(b), config) for m in method_names for b in budget_values}
    name = model_name or model or DEFAULT_MODEL
    stop = stop_token_ids(model_dir, tokenizer, union=True)
    encoded = {s.sample_id: encode_sample(s, tokenizer, query_aware=True, chat_template=chat_template)[0]
               for s in samples}
    for s in samples:
        if not encoded[s.sample_id]:
            raise ValueError(f"sample {s.sample_id!r} has an empty prompt")
    caps = {s.sample_id: s.max_new_tokens if max_new_tokens is None else min(s.max_new_tokens, max_new_tokens)
            for s in samples}
    written: list[dict[str, Any]] = []
    with ResultsWriter(out_dir) as store:
        check_engine_dir(store, ENGINE)
        work = []
        for method, budget in _pairs(method_names, budget_values, include_full):
            todo = [s for s in samples if row_key({
                "task": s.task, "sample_id": s.sample_id, "method": method, "budget": budget,
                "length": target_length(s), "model": name, "prefill_chunk": None}) not in store]
            if todo:
                work.append((method, budget, todo))
        bar = tqdm(total=sum(len(t) for _, _, t in work), desc=f"eval {suite} (vllm)", unit="sample",
                   disable=not progress, dynamic_ncols=True)
        for method, budget, todo in work:
            if budget is None:
                cfg, hyper, profile = None, None, None
            else:
                built, profile = resolved[(method, budget)]
                hyper, cfg = built.hyperparameters(), plugin_config(built, Budget(budget))
            groups: dict[int, list[Sample]] = {}
            for s in todo:  # one generation length per vLLM call
                groups.setdefault(caps[s.sample_id], []).append(s)
            for cap, group in groups.items():
                bar.set_postfix_str(f"{method} {'full' if budget is None else budget} x{len(group)}", refresh=True)
                prompts = [encoded[s.sample_id] for s in group]
                start = time.perf_counter()
                run = run_vllm(model_dir, prompts, slake=cfg, max_new_tokens=cap, block_size=block_size,
                               dtype=dtype, max_model_len=model_len(max(map(len, prompts)), cap),
                               stop_token_ids=stop,
                               max_num_seqs=max(len(prompts), 1))
                wall = time.perf_counter() - start
                for i, s in enumerate(group):
                    prediction = _decode_text(tokenizer, list(run.tokens[i]), stop)
                    steps = max(len(run.tokens[i]) - 1, 0)
                    ms = run.decode_ms_per_token[i]
                    row = {
                        "suite": suite, "task": s.task, "sample_id": s.sample_id, "model": name, "method": method,
                        "budget": budget, "length": target_length(s), "prompt_tokens": len(prompts[i]),
                        "prediction": prediction, "answers": list(s.answers),
                        "score": float(score_prediction(s, prediction)),
                        "prefill_s": run.prefill_s[i],
                        "decode_s": None if math.isnan(ms) else round(ms * steps / 1000, 5),
                        "seed": seed, "query_aware": True, "compressed": bool(run.compressed[i]),
                        "new_tokens": len(run.tokens[i]), "max_new_tokens": cap, "depth": s.depth,
                        "metric": s.metric, "kv_bytes": run.kv_bytes[i], "prefill_chunk": None,
                        "batch_size": len(group), "profile": profile, "kv_dtype": None, "engine": ENGINE,
                        "hyperparameters": hyper, "kv_blocks_end": run.blocks_end[i], "engine_wall_s": round(wall, 3),
                    }
                    if store.write(row):
                        written.append(row)
                    bar.update(1)
        bar.close()
    return written
