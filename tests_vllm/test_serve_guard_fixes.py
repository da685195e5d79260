"""Start-up guards of the vLLM plugin (audit of the serving path, findings 2, 4, 5, 8, 10): what the plugin cannot
honour stops the engine when it starts, in one ``slake:`` line. No engine starts here: vLLM's configuration and the
CPU metadata builder's own ``__init__`` are stubbed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slake.engines.vllm.plugin.config import SlakeVllmConfig, parse_config
from slake.engines.vllm.plugin.validate import validate_engine_config


def vllm_config(slake: dict | str | None, *, max_model_len: int = 512, pp: int = 1, tp: int = 1):
    """A stand-in for vLLM's ``VllmConfig`` with what the plugin's start-up reads (a 2-layer model, 2 KV heads)."""
    text = SimpleNamespace(num_hidden_layers=2, layer_types=None, sliding_window=None)
    model = SimpleNamespace(
        max_model_len=max_model_len,
        hf_config=None,  # no profile applies
        hf_text_config=text,
        is_attention_free=False,
        use_mla=False,
        dtype=torch.float32,
        get_total_num_kv_heads=lambda: 2,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 16,
    )
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_seqs=4, async_scheduling=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        speculative_config=None,
        additional_config={"slake": slake},
    )


def one_slake_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg.startswith("slake:") and "\n" not in msg, msg
    return msg


def builder(monkeypatch, isa: str, slake: dict, **kw):
    """The plugin's metadata builder made over a stub of vLLM's CPU builder ``__init__`` that sets what vLLM's sets
    and the plugin reads (``isa``, ``block_size``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from slake.engines.vllm.plugin.backend import SlakeCPUAttentionMetadataBuilder

    def fake_init(self, kv_cache_spec, layer_names, vllm_config, device):
        self.isa, self.block_size = isa, 32

    monkeypatch.setattr(CPUAttentionMetadataBuilder, "__init__", fake_init)
    spec = SimpleNamespace(num_kv_heads=2, head_size=16)  # the KV-cache spec vLLM passes (the heads it allocated)
    return SlakeCPUAttentionMetadataBuilder(spec, [], vllm_config(slake, **kw), torch.device("cpu"))


SNAPKV = {"method": "snapkv", "budget": 64}


# --- 2: the KV-layout guard decides at start-up ---------------------------------------------------------------------


def test_builder_refuses_an_isa_the_layout_cannot_read(monkeypatch):
    """vLLM picks ``amx`` for bfloat16 at a block size that is a multiple of 32 on an AMX CPU: refused when the
    engine starts, not at the first compressed request (where the failure killed the engine)."""
    with pytest.raises(ValueError) as exc:
        builder(monkeypatch, "amx", SNAPKV)
    msg = one_slake_line(exc)
    assert "'amx'" in msg and "float32" in msg
    # never run with the plugin (ARM's neon): a warning, the first compressed write's read-back check still guards
    assert builder(monkeypatch, "neon", SNAPKV).slake_state is not None


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_builder_accepts_the_isas_the_layout_reads(monkeypatch, isa):
    b = builder(monkeypatch, isa, SNAPKV)
    assert b.slake_state is not None


def test_plain_vllm_builder_ignores_the_isa(monkeypatch):
    """Without a slake configuration nothing of the plugin runs, so any ISA is fine."""
    assert builder(monkeypatch, "amx", None).slake_state is None  # type: ignore[arg-type]


# --- 4: the decode pool's width is bounded by what a request can hold ----------------------------------------------


def test_pool_width_clamped_to_max_model_len(monkeypatch):
    """A CAKE/SLAKE layer cap above ``max_model_len`` no longer widens every pool row: W = min(cap, len) + 1."""
    cfg = {"method": "cake", "budget": 64, "set": {"max_layer_budget": 4096}}
    b = builder(monkeypatch, "vec", cfg, max_model_len=512)
    assert b.slake_state.config.slots() == 513
    assert b.slake_state.decode_pool().width == 513
    # a request's own bound is unchanged (its prompt is shorter than max_model_len)
    assert b.slake_state.config.slots(300) == 301
    # below max_model_len the cap binds, as before
    assert builder(monkeypatch, "vec", {**cfg, "set": {"max_layer_budget": 128}}).slake_state.config.slots() == 129


def test_slots_without_engine_bound_unchanged():
    parsed = parse_config({"slake": {"method": "slake", "budget": 64, "set": {"max_layer_budget": 4096}}})
    assert isinstance(parsed, SlakeVllmConfig) and parsed.slots() == 4097
    assert parsed.for_engine(1024).slots() == 1025 and parsed.for_engine(None).slots() == 4097


# --- 5: a budget no request can exceed ------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [512, 4096])
def test_budget_at_or_above_max_model_len_is_said_at_start_up(budget, caplog):
    """Logged, not refused: slake's own drivers size max_model_len to their prompts, and a run whose prompts all fit
    the budget is uncompressed by design (before, the engine logged "compressing" and said nothing else)."""
    cfg = parse_config({"slake": {"method": "snapkv", "budget": budget}})
    with caplog.at_level("WARNING", logger="slake"):
        validate_engine_config(cfg, vllm_config(None, max_model_len=512))
    said = [r.getMessage() for r in caplog.records if "max_model_len 512" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("slake: budget") and "compresses nothing" in said[0]


def test_budget_below_max_model_len_accepted(caplog):
    cfg = parse_config({"slake": {"method": "snapkv", "budget": 511}})
    with caplog.at_level("WARNING", logger="slake"):
        validate_engine_config(cfg, vllm_config(None, max_model_len=512))
    assert not any("max_model_len" in r.getMessage() for r in caplog.records)


# --- 8: pipeline parallelism refused for every method -------------------------------------------------------------


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streamingllm", "cake", "slake"])
def test_pipeline_parallelism_refused_for_every_method(method):
    cfg = parse_config({"slake": {"method": method, "budget": 64}})
    with pytest.raises(ValueError) as exc:
        validate_engine_config(cfg, vllm_config(None, pp=2))
    assert "pipeline" in one_slake_line(exc)


# --- 10: error messages --------------------------------------------------------------------------------------------


def test_full_method_refused_as_plain_vllm():
    with pytest.raises(ValueError) as exc:
        parse_config({"slake": {"method": "full", "budget": 128}})
    msg = one_slake_line(exc)
    assert "plain vLLM" in msg and "per-layer or per-head" not in msg


def test_bad_json_string_is_one_slake_line():
    with pytest.raises(ValueError) as exc:
        parse_config({"slake": '{"method": "snapkv", "budget": 128'})
    assert "not valid JSON" in one_slake_line(exc)


def test_sample_refusal_gives_the_real_reason():
    """vLLM's sampler runs after the plugin and works (audit: seeded sampling on a compressed prompt is
    reproducible); what is missing is slake's driver passing sampling options."""
    from slake.engines.vllm.engine import VllmEngine

    with pytest.raises(ValueError) as exc:
        VllmEngine().check(sample=True)
    msg = str(exc.value)
    assert "--sample" in msg and "not wired" not in msg and "greedily" in msg
