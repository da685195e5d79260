"""The vLLM benchmarks run each method as users get it: the model's shipped profile applied (without vLLM installed)."""

from __future__ import annotations

from transformers import LlamaConfig

from packaged_shapes import SMOLLM2
from slake.engines.vllm.bench import method_config


def _converted_default_model(tmp_path):
    """A folder named as the converted default model, with SmolLM2-135M-Instruct's architecture (no weights)."""
    d = tmp_path / "SmolLM2-135M-Instruct.Q4_1-float32"
    LlamaConfig(**SMOLLM2).save_pretrained(d)
    return str(d)


def test_benchmarks_apply_the_default_models_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAKE_PROFILE_DIR", str(tmp_path / "no-user-profiles"))
    d = _converted_default_model(tmp_path)
    cfg, profile = method_config("slake", 128, d, None)  # named after the folder
    assert profile is not None and profile["values"] == {"alpha": 1.4142, "beta": 0.0}
    assert cfg["method"] == "slake" and cfg["budget"] == 128
    assert cfg["set"]["alpha"] == 1.4142 and cfg["set"]["beta"] == 0.0 and cfg["set"]["max_layer_budget"] == 256
    cfg, profile = method_config("slake", 128, d, "smollm2")  # the packaged name finds the same profile
    assert profile is not None and profile["budget"] == 128
    cfg, profile = method_config("snapkv", 128, d, None)
    assert profile is None and cfg == {"method": "snapkv", "budget": 128, "set": {}}
    assert method_config("full", 128, d, None) == (None, None)
    cfg, profile = method_config("slake", 128, d, "some-other-model")  # no profile: the method's defaults
    assert profile is None and "alpha" not in cfg["set"]
