"""Architectures whose attention goes through transformers' AttentionInterface but is not what slake computes are
refused when the model is prepared (or its cache built), naming the model (2026-11-29 audit of transformers 5.24's
causal LMs). Before, each was silently wrong or failed deep inside:

* learned sinks on sliding layers (GraniteSWA, MiMo-V2-Flash) and GIT's text decoder, which adds slake's boolean mask
  as a bias: off by 0.14-0.23 in the logits after ``prepare_model``, with or without a SlakeCache;
* DiffLlama (two attention calls per layer): every decode step off by 0.27-0.52;
* Doge (a value-dependent bias in the mask), multi-head latent attention (DeepSeek-V3), JetMoE, HRM, values of another
  head size, Gemma 3n's shared KV layers: shape errors or "not routed" errors that named no model;
* Llama 4 with chunked layers only: compressed as full layers, attending across chunks past the first."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import slake
from slake.engines.transformers.attention import slake_attention_forward
from slake.engines.transformers.layer_layout import attention_layout, check_supported_attention

SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip


def _config(model_type: str, **extra):
    return CONFIG_MAPPING[model_type](**{**SMALL, **extra})


@pytest.mark.parametrize(
    "model_type, extra, said",
    [
        ("diffllama", {}, "twice per layer"),
        ("doge", {}, "bias computed from its values"),
        ("jetmoe", {}, "repeats its keys and values"),
        ("hrm_text", {}, "another cache index"),
        (
            "deepseek_v3",
            {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16},
            "multi-head latent attention",
        ),  # fmt: skip
        ("mimo_v2_flash", {"v_head_dim": 8}, "values of another head size"),
        ("gemma3n_text", {"num_kv_shared_layers": 1}, "share another layer's KV cache"),
    ],
)
def test_attention_slake_does_not_model_is_refused_by_config(model_type, extra, said):
    with pytest.raises(ValueError, match=said):
        check_supported_attention(_config(model_type, **extra), "Tiny")


def test_a_model_transformers_marks_as_not_sdpa_is_refused_by_prepare_model():
    """GraniteSWA's sliding layers add learned sinks, which slake's SDPA fallback dropped."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("granite_swa"))
    with pytest.raises(ValueError, match="_supports_sdpa = False"):
        slake.prepare_model(model)


@pytest.mark.parametrize("kwarg", ["s_aux", "sinks", "softcap"])
def test_sinks_and_softcap_are_refused_before_the_sdpa_fallback(kwarg):
    """Without a SlakeCache (or on a sliding layer) the function falls back to SDPA, which computes neither."""
    q = k = v = torch.randn(1, 2, 4, 8)
    value = 30.0 if kwarg == "softcap" else torch.zeros(2)
    with pytest.raises(ValueError, match="does not support"):
        slake_attention_forward(torch.nn.Module(), q, k, v, None, **{kwarg: value})


def test_chunked_layers_only_are_refused():
    config = _config("llama4_text", attention_chunk_size=16, layer_types=["chunked_attention"] * 2)
    with pytest.raises(ValueError, match="chunked-attention layers only"):
        attention_layout(config)


def test_the_supported_architectures_still_pass():
    for model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "granite"):
        check_supported_attention(_config(model_type), model_type)
