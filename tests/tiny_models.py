"""Tiny random models of every supported architecture, built in-process (no download)."""

from __future__ import annotations

import torch

import slake

ARCHS = ["llama-mha", "llama-gqa", "mistral", "qwen2", "qwen3"]


def tiny_model(arch: str, layers: int = 3, seed: int = 0, **config):
    """A randomly initialised causal LM of the given architecture, fp32, eval mode, slake attention; ``config``
    overrides the small default sizes (e.g. ``intermediate_size``)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    common.update(config)
    torch.manual_seed(seed)
    if arch == "llama-mha":
        model = LlamaForCausalLM(LlamaConfig(**{**common, "num_key_value_heads": 4}))
    elif arch == "llama-gqa":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    else:
        raise ValueError(arch)
    # larger weights than the default init give peaky attention, so methods disagree and tests can fail
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.eval()
    slake.prepare_model(model)
    return model


def save_tiny_model(path, arch: str = "llama-gqa"):
    """:func:`tiny_model` saved to the directory ``path`` with a word-level tokenizer of its 256 ids (``w0`` ..
    ``w255``; ``w1`` ends a sequence), as a local model directory the loaders and the ``slake`` command take; returns
    the model."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    model = tiny_model(arch)
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(256)}
    tk = Tokenizer(tok_models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w1").save_pretrained(path)
    return model


def random_ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (batch, n), generator=g)


def word_tokenizer():
    """A tokenizer for tiny models: the words ``w3`` .. ``w255`` are ids 3-255, ``<unk>``, ``<eos>`` and ``<pad>``
    ids 0-2 (special tokens named unlike the words, which they would otherwise split: ``w10`` read as ``w1`` + ``0``);
    no BOS and no chat template, so a prompt of n words is n tokens."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2} | {f"w{i}": i for i in range(3, 256)}
    tk = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def second_pass_ready(model, cache) -> bool:
    """Give a cache whose method has a second pass (KVzip) a reconstruction prompt of fixed token ids (tiny models
    have no tokenizer); True when the method has one."""
    if cache.method.second_pass is None:
        return False
    from slake.engines.transformers.reconstruction import ReconstructionPrompt

    cache.reconstruction = ReconstructionPrompt.synthetic(int(model.config.vocab_size))
    return True


def prefill_for_generate(model, cache, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
    """What ``slake.generate`` does before ``model.generate`` for a second-pass method: prefill the prompt through
    slake's prefill (exact prefill, second pass, compression), which leaves its logits for ``model.generate`` to
    continue from. Nothing for other methods. Generate under ``torch.inference_mode``."""
    if not second_pass_ready(model, cache):
        return
    from slake.engines.transformers.generate import prefill

    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    with torch.inference_mode():
        prefill(model, cache, ids, mask)
