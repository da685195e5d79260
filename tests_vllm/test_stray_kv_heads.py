"""A config.json key that the architecture ignores (``num_key_value_heads`` in an MHA model's config): vLLM reads it
as the KV head count. A native vLLM model (GPT-2) still builds its layers MHA, so the plugin must size its state from
the cache vLLM allocated; vLLM's Transformers backend (GPT-NeoX) builds its layers with the stray count, so the keys
reach the cache write with twice the rows, which a slake engine refuses (it crashed in ``reshape_and_cache``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slake.engines.vllm.runner import run_vllm

SNAPKV = {"method": "snapkv", "budget": 16, "set": {"window": 8}}


def _save(model, path: Path, stray: int | None) -> str:
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("num_key_value_heads", None)
    if stray is not None:
        cfg["num_key_value_heads"] = stray
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _gpt2(path: Path, stray: int | None) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=512, tie_word_embeddings=False)
    return _save(GPT2LMHeadModel(cfg), path, stray)


def _neox(path: Path, stray: int | None) -> str:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    return _save(GPTNeoXForCausalLM(cfg), path, stray)


def _prompt() -> list[int]:
    return torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(1)).tolist()


def test_a_stray_kv_head_count_does_not_size_the_plugin_state(tmp_path):
    """GPT-2 with ``num_key_value_heads: 2``: compressed exactly as without the key, and its KV bytes counted from
    the 4 heads vLLM allocated (they were counted from the key's 2: half the true bytes)."""
    stray, clean = [
        run_vllm(
            _gpt2(tmp_path / name, heads),
            [_prompt()],
            slake=SNAPKV,
            max_new_tokens=6,
            ignore_eos=True,
            max_model_len=256,
        )
        for name, heads in (("stray", 2), ("clean", None))
    ]
    assert stray.tokens == clean.tokens
    assert stray.model_info == clean.model_info and clean.model_info["kv_heads"] == 4
    assert stray.kv_bytes == clean.kv_bytes


def test_a_layer_built_with_other_kv_heads_than_the_model_computes_is_refused(tmp_path):
    """GPT-NeoX (vLLM's Transformers backend) with ``num_key_value_heads: 2``: a one-line refusal, not a crash."""
    with pytest.raises(Exception, match="key rows for"):
        run_vllm(_neox(tmp_path / "neox", 2), [_prompt()], slake=SNAPKV, max_new_tokens=6, ignore_eos=True,
                 max_model_len=256)  # fmt: skip
