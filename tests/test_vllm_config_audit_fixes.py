"""Audit of the vLLM plugin's configuration parsing (:mod:`slake.engines.vllm.plugin.config`), without vLLM.

Each test failed before its fix:

* ``--dtype auto`` reached vLLM as ``"auto"``, which vLLM's CPU platform resolves to bfloat16 even for a float32
  checkpoint (``vllm.config.model._resolve_auto_dtype`` downcasts float32 to the platform's first dtype), where the
  transformers engine reads ``auto`` as the device's default, float32 on CPU: the two engines ran one command in two
  dtypes, and result rows recorded the dtype as ``"auto"``.
* :func:`plugin_config` given a ratio budget wrote ``"budget": 0`` (``int(0.25)``): the ratio was silently turned
  into a token count that the plugin then refused as "budget must be >= 1 token".
* ``SLAKE_VLLM=false`` was refused ("must be a JSON object, got False"), where ``"slake": false`` in
  ``additional_config`` states plain vLLM (docs/vllm.md, "Configuration": the variable holds "the same JSON object").
"""

from __future__ import annotations

import pytest
import torch

from slake.budgets.budget import Budget
from slake.engines.transformers.models import parse_dtype
from slake.engines.vllm.plugin.config import ENV_VAR, parse_config, plugin_config, vllm_dtype
from slake.engines.vllm.plugin.requests import slake_configured
from slake.methods.base import make_method

#: vLLM's dtype names -> the torch dtype vLLM runs (``vllm.config.model._STR_DTYPE_TO_TORCH_DTYPE``)
_VLLM_TORCH = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@pytest.mark.parametrize("spelling", ["auto", "AUTO", " Auto ", None, "fp32", "float32", "fp16", "half", "bf16"])
def test_vllm_runs_the_dtype_the_transformers_engine_runs_on_cpu(spelling):
    """Every ``--dtype`` spelling the CLI accepts names, for vLLM, the dtype the transformers engine loads on CPU
    (the only device ``--engine vllm`` runs on); ``auto`` was passed through, and vLLM's ``auto`` is bfloat16."""
    name = vllm_dtype(spelling)
    assert name in _VLLM_TORCH, name
    assert _VLLM_TORCH[name] is parse_dtype(spelling, "cpu")


def test_auto_is_named_as_the_dtype_it_runs():
    """Result rows record ``model_dtype`` from :func:`vllm_dtype`: ``auto`` is named float32, as the default is."""
    assert vllm_dtype("auto") == vllm_dtype(None) == "float32"


@pytest.mark.parametrize("method", ["snapkv", make_method("snapkv"), "slake"])
def test_plugin_config_refuses_a_ratio_budget_instead_of_writing_zero(method):
    with pytest.raises(ValueError, match="absolute budget in tokens") as exc:
        plugin_config(method, Budget(0.25))
    assert "\n" not in str(exc.value)


def test_plugin_config_keeps_a_token_budget_and_full_stays_plain():
    assert plugin_config("snapkv", Budget("128")) == {"method": "snapkv", "budget": 128}
    assert plugin_config("full", Budget(0.25)) is None  # the full cache needs no budget: plain vLLM


@pytest.mark.parametrize("value", ["false", " false ", "null"])
def test_environment_false_states_plain_vllm_as_additional_config_false_does(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    assert parse_config({}) is None
    assert parse_config({"slake": False}) is None  # the additional_config spelling it mirrors
    assert not slake_configured(type("Cfg", (), {"additional_config": {}})())


def test_environment_other_non_objects_are_still_refused(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "true")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_config({})
    monkeypatch.setenv(ENV_VAR, '{"method": "snapkv", "budget": 128}')
    assert parse_config({}).budget == 128
