"""What the plugin's compressed steps do not compute is refused when a slake engine starts (2026-11-29 audit): a
Gemma 2 whose layers are all full attention, with its logit soft-capping, was accepted and decoded its compressed
requests without the cap (ALiBi slopes and learned sinks the same way, where vLLM's CPU backend takes them); and the
engine runner read the KV-head count from a config field GPT-2, OPT or Falcon do not have."""

from __future__ import annotations

import types

import pytest
import torch

from slake.engines.vllm.plugin.validate import check_layer_attention
from slake.engines.vllm.runner import run_vllm


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"logits_soft_cap": 30.0}, "logit soft-capping"),
        ({"alibi_slopes": torch.ones(4)}, "ALiBi slopes"),
        ({"sinks": torch.zeros(4)}, "learned attention sinks"),
        ({"sliding_window": 128}, "a sliding window"),
        ({"attn_type": "encoder_only"}, "encoder_only attention"),
    ],
)
def test_a_layer_with_what_the_steps_drop_is_refused(fields, said):
    impl = types.SimpleNamespace(**{"logits_soft_cap": 0, "alibi_slopes": None, "sinks": None, "sliding_window": -1,
                                    "attn_type": "decoder", **fields})  # fmt: skip
    with pytest.raises(ValueError, match=f"^slake: .*{said}"):
        check_layer_attention(impl)


def test_a_plain_decoder_layer_passes():
    check_layer_attention(
        types.SimpleNamespace(logits_soft_cap=0, alibi_slopes=None, sinks=None, sliding_window=-1, attn_type="decoder")
    )


def _gemma2_all_full(path: str) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=1024,
        layer_types=["full_attention"] * 2, attn_logit_softcapping=1.0, final_logit_softcapping=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(path)


def test_a_soft_capped_model_with_every_layer_full_is_refused_at_start_up(tmp_path):
    _gemma2_all_full(str(tmp_path))
    prompt = list(range(3, 68))
    with pytest.raises(ValueError, match="soft-capping"):
        run_vllm(str(tmp_path), [prompt], slake={"method": "snapkv", "budget": 64}, max_new_tokens=2,
                 ignore_eos=True, max_model_len=512)  # fmt: skip
    plain = run_vllm(str(tmp_path), [prompt], slake=None, max_new_tokens=2, ignore_eos=True, max_model_len=512)
    assert len(plain.tokens[0]) == 2  # without slake the engine serves it (vLLM's kernel applies the cap)


def test_the_runner_reads_the_kv_heads_of_a_config_without_num_key_value_heads(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=512)).save_pretrained(
        str(tmp_path)
    )
    run = run_vllm(str(tmp_path), [list(range(3, 40))], slake=None, max_new_tokens=2, ignore_eos=True,
                   max_model_len=256)  # fmt: skip
    per_token = 2 * 2 * 4 * 32 * 4  # layers, K and V, heads, head size, fp32
    assert len(run.tokens[0]) == 2 and run.kv_bytes[0]["full"] == per_token * 38  # 37 prompt tokens + 1 new held


def test_a_model_the_method_cannot_read_stops_the_engine_while_it_starts(tmp_path):
    """Expected Attention on a linearly scaled RoPE (not one the plugin reads): refused when the engine is built,
    not at its first request (the model facts are read once the KV cache exists)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM

    from slake.engines.vllm.runner import engine_kwargs

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rope_scaling={"rope_type": "linear", "factor": 2.0},
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    kw = engine_kwargs(str(tmp_path), slake={"method": "expected-attention", "budget": 64}, block_size=32,
                       dtype="float32", max_model_len=512)  # fmt: skip
    with pytest.raises(ValueError, match="LinearScalingRotaryEmbedding"):
        LLM(**kw)
