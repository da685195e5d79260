"""Tiny random models with sliding-window layers (hybrid and all-sliding), built in-process (no download)."""

from __future__ import annotations

import torch

import slake

WINDOW = 16
#: model name -> (hybrid?, refused?)
HYBRID = ["gemma3", "qwen2-swa"]
ALL_SLIDING = ["mistral-swa", "phi3-swa"]
REFUSED = ["gemma2", "gpt-oss"]


def _common(layers: int) -> dict:
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


def hybrid_model(name: str, seed: int = 0, prepare: bool = True):
    """A tiny random causal LM; ``prepare`` routes its attention through slake (refused models raise there)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = _common(4)
    if name == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
        model = tf.Gemma3ForCausalLM(cfg)
    elif name == "qwen2-swa":  # layers >= max_window_layers use the window
        model = tf.Qwen2ForCausalLM(
            tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
        )
    elif name == "mistral-swa":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=WINDOW))
    elif name == "phi3-swa":
        model = tf.Phi3ForCausalLM(
            tf.Phi3Config(**common, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        )
    elif name == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW))
    elif name == "gpt-oss":
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(
                **{**common, "intermediate_size": 64},
                head_dim=16,
                sliding_window=WINDOW,
                num_local_experts=2,
                num_experts_per_tok=1,
            )
        )
    else:
        raise ValueError(name)
    with torch.no_grad():  # peaky attention, so that methods disagree and tests can fail
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.eval()
    if prepare:
        slake.prepare_model(model)
    return model
