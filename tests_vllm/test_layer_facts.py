"""The model facts the plugin reads from vLLM's modules (:mod:`slake.engines.vllm.plugin.layer_facts`) equal what the
transformers engine reads from transformers' (:mod:`slake.engines.transformers.layer_facts`): the same rotation, the
same output projection; and what cannot be expressed is refused, not approximated."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding import get_rope

from slake.budgets.budget import Budget
from slake.engines.vllm.plugin.config import parse_config
from slake.engines.vllm.plugin.layer_facts import layer_index, out_proj_weight, vllm_layer_contexts, vllm_rotary
from slake.engines.vllm.plugin.paged import CpuAttnLayout
from slake.engines.vllm.plugin.state import PluginState
from slake.methods import make_method


@pytest.fixture(autouse=True)
def _vllm_config():
    """vLLM's custom ops (its rotary embeddings) are made inside a current vLLM configuration."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _hf_rotary(rope_parameters: dict) -> torch.Tensor:
    cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=16384, rope_parameters=rope_parameters
    )
    return LlamaRotaryEmbedding(cfg).inv_freq


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ],
    ids=["plain", "llama3"],
)  # fmt: skip
def test_vllm_rotary_equals_transformers(params):
    rope = get_rope(64, 16384, True, dict(params), torch.float32)
    rot = vllm_rotary(rope)
    torch.testing.assert_close(rot.inv_freq, _hf_rotary(params), rtol=1e-6, atol=0)
    assert rot.scaling == 1.0
    # the rotation it gives equals vLLM's own (whose float32 angles drift from the float64 ones far out)
    x = torch.randn(1, 4, 64)
    pos = torch.tensor([700])
    q, _ = rope.forward_native(pos, x.reshape(1, -1).clone(), x.reshape(1, -1).clone())
    torch.testing.assert_close(rot.rotate(x[:, None], pos.view(1, 1, 1)).reshape(1, -1), q, rtol=1e-4, atol=1e-4)


def test_interleaved_or_unknown_rope_is_refused():
    with pytest.raises(ValueError, match="interleaved"):
        vllm_rotary(get_rope(64, 4096, False, {"rope_type": "default", "rope_theta": 1e4}, torch.float32))
    linear = get_rope(64, 4096, True, {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, torch.float32)
    with pytest.raises(ValueError, match="not one the plugin reads"):
        vllm_rotary(linear)


class _Attn(torch.nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.layer_name = f"model.layers.{i}.self_attn.attn"
        self.o_proj = torch.nn.Linear(8, 16, bias=False)
        self.rotary_emb = get_rope(8, 1024, True, {"rope_type": "default", "rope_theta": 1e4}, torch.float32)


def test_contexts_per_layer_and_missing_layers():
    model = torch.nn.ModuleList([_Attn(i) for i in range(3)])
    ctx = vllm_layer_contexts(model, 3, ("out_proj", "rotary"))
    assert [c.out_proj is model[i].o_proj.weight or torch.equal(c.out_proj, model[i].o_proj.weight)
            for i, c in enumerate(ctx)] == [True] * 3  # fmt: skip
    assert all(c.rotary is not None and c.rotary.rotary_dim == 8 for c in ctx)
    assert vllm_layer_contexts(model, 3, ("out_proj",))[0].rotary is None
    with pytest.raises(ValueError, match=r"layers \[3\]"):
        vllm_layer_contexts(model, 4, ("out_proj",))
    assert layer_index("model.layers.12.self_attn.attn") == 12


def test_state_reads_the_model_once_and_refuses_without_it():
    cfg = parse_config({"slake": {"method": "criticalkv", "budget": 64}})
    state = PluginState(cfg, num_layers=3, kv_heads=2, head_dim=4, block_size=16, max_rows=2, layout=CpuAttnLayout())
    assert state.needs_model
    with pytest.raises(RuntimeError, match="worker hook"):
        state.decode_pool()
    model = torch.nn.ModuleList([_Attn(i) for i in range(3)])
    state.attach_model(model)
    assert not state.needs_model and len(state.layer_context) == 3
    assert state.decode_pool().layer_context is state.layer_context
    plain = PluginState(
        parse_config({"slake": {"method": "snapkv", "budget": 64}}),
        num_layers=3, kv_heads=2, head_dim=4, block_size=16, max_rows=2, layout=CpuAttnLayout(),
    )  # fmt: skip
    assert not plain.needs_model and plain.decode_pool().layer_context is None
    assert make_method("keydiff").layer_facts() == () and Budget(64).value == 64


def test_repacked_output_projection_is_read_back_exactly():
    """vLLM's CPU GEMM dispatch may repack ``o_proj``'s weight and leave ``weight`` empty: the weight is read back
    through the layer's linear method on the identity, bit for bit (bf16 included)."""
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(16, 8).to(dtype)

        class _Method:
            def __init__(self, weight: torch.Tensor) -> None:
                self.weight = weight

            def apply(self, layer, x, bias=None):
                return torch.nn.functional.linear(x, self.weight, bias)

        proj = torch.nn.Module()
        proj.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        proj.quant_method, proj.input_size_per_partition, proj.params_dtype = _Method(w), 8, dtype
        got = out_proj_weight(proj)
        assert got.dtype == dtype and torch.equal(got, w)
    plain = torch.nn.Linear(8, 16, bias=False)
    assert out_proj_weight(plain) is not None and torch.equal(out_proj_weight(plain), plain.weight)
