"""Generation with vLLM and the slake plugin: the transformers engine's prompt handling and result fields."""

from __future__ import annotations

from typing import Any

from slake.budgets.budget import Budget
from slake.engines.result import GenerationResult
from slake.methods.base import Method

__all__ = ["generate_vllm", "stop_token_ids"]


def generate_vllm(
    prompt: str,
    *,
    method: Method | str,
    budget: Budget,
    model: str | None,
    gguf_file: str | None,
    dtype: str | None,
    max_new_tokens: int,
    chat_template: bool = True,
    block_size: int = 32,
    kernels: str = "auto",
    **hyperparameters: Any,
) -> GenerationResult:
    """Greedy generation of one prompt with vLLM and the slake plugin (in this process).

    The prompt is formatted and tokenized exactly as :func:`slake.engines.transformers.generate.generate` does, and
    generation stops
    on the model's EOS ids, so the text equals the transformers engine's for the same method and budget.

    Parameters
    ----------
    prompt : str
        The user prompt.
    method, budget :
        What compresses the cache (see :mod:`slake.engines.vllm.plugin.config` for what the plugin supports); ``full``
        runs plain vLLM. A name or spec goes to the plugin as ``vllm serve --additional-config`` gives it (with the
        user's ``hyperparameters`` in ``set``), and the plugin resolves it as the transformers engine does
        (:func:`slake.methods.profiles.resolve_method`: the model's profile fills what the user did not set);
        CAKE/SLAKE then get vLLM's ``max_layer_budget`` (:func:`slake.engines.vllm.plugin.config.with_layer_cap`)
        unless set. The result's ``hyperparameters`` and ``profile`` are what the plugin reports it ran.
    model, gguf_file, dtype :
        As ``slake generate --model/--gguf-file/--dtype``; GGUF models are converted once to safetensors
        (:func:`slake.engines.vllm.converted.local_model_dir`).
    max_new_tokens : int
        Upper bound of generated tokens.
    block_size : int
        vLLM's KV block size (a multiple of 32 on CPU).
    kernels : str
        The decode step's implementation (``auto``, ``torch``, ``triton``: the plugin's ``"kernels"``); the result's
        ``extra["kernels"]`` is which ran, as the plugin reports it.
    **hyperparameters
        Method hyperparameters set by the user (``--set``).

    Returns
    -------
    GenerationResult
        With ``engine="vllm"`` and ``extra`` holding ``kv_blocks_after_prefill``, ``kv_blocks_end``,
        ``kv_block_size``, ``model_dir`` and ``kernels`` (which implementation ran the plugin's decode steps:
        ``torch``, ``triton`` or ``torch (fallback: why)``; None for plain vLLM).
    """
    from transformers import AutoTokenizer

    from slake.engines.context import check_context
    from slake.engines.transformers.generate import format_prompt, uses_chat_template
    from slake.engines.vllm.plugin.config import plugin_config, resolve_plugin_method, vllm_dtype
    from slake.engines.vllm.runner import local_model_dir, model_context_limit, model_len, run_vllm

    budget = Budget(budget)
    dtype = vllm_dtype(dtype)
    built, _ = resolve_plugin_method(method, budget, **hyperparameters)  # refuse what the plugin cannot run, early
    slake_cfg = plugin_config(method, budget, kernels=kernels, **hyperparameters)
    model_dir = local_model_dir(model, gguf_file, dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = format_prompt(tokenizer, prompt, chat_template)
    ids = tokenizer(text, add_special_tokens=not uses_chat_template(tokenizer, chat_template))["input_ids"]
    limit = model_context_limit(model_dir)
    check_context(limit, len(ids), max_new_tokens)  # before vLLM starts, in slake's words
    stop = stop_token_ids(model_dir, tokenizer)
    run = run_vllm(
        model_dir,
        [ids],
        slake=slake_cfg,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        dtype=dtype,
        max_model_len=model_len(len(ids), max_new_tokens, limit),
        stop_token_ids=stop,
    )
    toks = run.tokens[0]
    ran = run.plugin or {"method": built.name, "hyperparameters": built.hyperparameters(), "profile": None}
    return GenerationResult(
        texts=[str(tokenizer.decode(toks, skip_special_tokens=True))],
        prompt_tokens=[len(ids)],
        new_tokens=[len(toks)],
        method=ran["method"],
        budget=budget.value,
        kv_bytes=run.kv_bytes[0],
        kept_tokens_per_layer=run.kept_tokens_per_layer[0] or [],
        compressed=run.compressed[0],
        prefill_s=run.prefill_s[0],
        decode_ms_per_token=run.decode_ms_per_token[0],
        layer_budgets=None,
        hyperparameters=ran["hyperparameters"],
        profile=ran["profile"],
        engine="vllm",
        extra={
            "kv_blocks_after_prefill": run.blocks_after_prefill[0],
            "kv_blocks_end": run.blocks_end[0],
            "kv_block_size": run.block_size,
            "model_dir": model_dir,
            "kernels": run.plugin["kernels"] if run.plugin else None,
        },
    )


def stop_token_ids(model_dir: str, tokenizer: Any, *, union: bool = False) -> list[int]:
    """End-of-sequence ids as the transformers engine stops on them: the generation config's (one id or several),
    else the tokenizer's, as ``model.generate`` (``slake generate``); ``union=True``: both, as the evaluation
    (:func:`slake.engines.transformers.generate.eos_token_ids`, which this calls)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from slake.engines.transformers.generate import eos_token_ids

    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        gen = None
    if not union and getattr(gen, "eos_token_id", None) is not None:
        tokenizer = None  # model.generate stops on the generation config's ids alone
    return eos_token_ids(SimpleNamespace(generation_config=gen), tokenizer)
