"""Architecture fingerprints of the three packaged models (what their shipped profiles are matched on), for tests that
need a config of the real shape without loading weights."""

from __future__ import annotations

#: SmolLM2-135M-Instruct, the default model (``model_type`` llama)
SMOLLM2 = dict(
    num_hidden_layers=30,
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
)
#: Gemma 3 270M (``model_type`` gemma3_text)
GEMMA3_270M = dict(
    num_hidden_layers=18,
    hidden_size=640,
    num_attention_heads=4,
    num_key_value_heads=1,
    intermediate_size=2048,
    vocab_size=262144,
)
#: Qwen2.5-Coder-0.5B-Instruct (``model_type`` qwen2)
QWEN_CODER_05B = dict(
    num_hidden_layers=24,
    hidden_size=896,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
)
