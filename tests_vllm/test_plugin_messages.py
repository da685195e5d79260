"""What the vLLM plugin logs when an engine starts: the scheduler's count of KV slots a compressed request keeps is the
one the attention backend sizes its decode pool with (bounded by ``max_model_len``), and a budget no request can
exceed is said once per engine, not once by the scheduler and again by each attention metadata builder. No engine
starts here: vLLM's configuration, ``Scheduler.__init__`` and the CPU metadata builder's ``__init__`` are stubbed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slake.engines.vllm.plugin import scheduler as plugin_scheduler
from test_serve_guard_fixes import vllm_config


class Said:
    """Records what a logger is asked to log, as the formatted lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args) -> None:
        self.lines.append(msg % args)

    warning = info


def start_scheduler(monkeypatch, config) -> Said:
    """Run the plugin's ``Scheduler.__init__`` wrapper over a stub of vLLM's; returns what its logger said."""
    said = Said()
    monkeypatch.setattr(plugin_scheduler, "logger", said)

    def vllm_init(self, vllm_config, *args, **kwargs):
        self.kv_cache_manager = SimpleNamespace()

    plugin_scheduler._wrap_init(vllm_init)(SimpleNamespace(), config)
    return said


def start_builder(monkeypatch, config):
    """The plugin's metadata builder made over a stub of vLLM's CPU builder ``__init__``."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from slake.engines.vllm.plugin.backend import SlakeCPUAttentionMetadataBuilder

    def fake_init(self, kv_cache_spec, layer_names, vllm_config, device):
        self.isa, self.block_size = "vec", 16

    monkeypatch.setattr(CPUAttentionMetadataBuilder, "__init__", fake_init)
    spec = SimpleNamespace(num_kv_heads=2, head_size=16)
    return SlakeCPUAttentionMetadataBuilder(spec, [], config, torch.device("cpu"))


@pytest.mark.parametrize(
    ("slake", "max_model_len", "slots"),
    [
        ({"method": "slake", "budget": 128}, 200, 201),  # the default cap 2 * 128 above max_model_len
        ({"method": "cake", "budget": 64, "set": {"max_layer_budget": 4096}}, 512, 513),
        ({"method": "cake", "budget": 64}, 512, 129),  # the cap binds below max_model_len, as before
        ({"method": "snapkv", "budget": 64}, 512, 65),
    ],
)
def test_scheduler_logs_the_slots_the_backend_keeps(monkeypatch, slake, max_model_len, slots):
    """The scheduler's start-up line counts the slots bounded by ``max_model_len``, as the backend's decode pool."""
    config = vllm_config(slake, max_model_len=max_model_len)
    said = start_scheduler(monkeypatch, config)
    (line,) = [line for line in said.lines if "KV slots per layer and head" in line]
    assert line.startswith(f"slake: compressed requests keep {slots} KV slots"), line
    assert start_builder(monkeypatch, config).slake_state.config.slots() == slots  # the backend's count


def uncompressed_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compresses nothing" in r.getMessage()]


def test_budget_over_max_model_len_warned_once_per_engine(monkeypatch, caplog):
    """An engine builds one scheduler and an attention metadata builder per KV-cache group and worker: one warning,
    from the scheduler (before, one from each of them)."""
    config = vllm_config({"method": "snapkv", "budget": 600}, max_model_len=512)
    with caplog.at_level("WARNING", logger="slake"):
        for _ in range(2):  # two builders (two KV-cache groups, or two workers of one process)
            assert start_builder(monkeypatch, config).slake_state is not None
        start_scheduler(monkeypatch, config)
    (line,) = uncompressed_warnings(caplog)
    assert line.startswith("slake: budget 600 >= max_model_len 512"), line


def test_each_engine_of_a_process_warns_for_its_own_configuration(monkeypatch, caplog):
    """Several engines in one process (a bench's engines, each its own configuration): one warning each."""
    engines = [
        vllm_config({"method": "snapkv", "budget": 600}, max_model_len=512),
        vllm_config({"method": "h2o", "budget": 300}, max_model_len=256),
        vllm_config({"method": "snapkv", "budget": 600}, max_model_len=512),  # a second engine like the first
        vllm_config({"method": "snapkv", "budget": 100}, max_model_len=512),  # compresses: nothing to say
    ]
    with caplog.at_level("WARNING", logger="slake"):
        for config in engines:
            start_builder(monkeypatch, config)
            start_scheduler(monkeypatch, config)
    said = uncompressed_warnings(caplog)
    assert [line.split(":")[1].strip() for line in said] == [
        "budget 600 >= max_model_len 512",
        "budget 300 >= max_model_len 256",
        "budget 600 >= max_model_len 512",
    ]
