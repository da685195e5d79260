"""The rotary embedding slake hands Expected Attention (and CriticalKV's Expected Attention scorer) is checked per layer
against slake's rotate-half convention when the cache binds the model
(:mod:`slake.engines.transformers.layer_facts`): models that rotate like Llama run as before (their keys at position
``p + 5`` equal the bound rotation of their keys at ``p``), a layer without RoPE gets the identity rotation, and a
model whose RoPE slake does not model (interleaved pairs, rope_type "dynamic") refuses those methods at the first
prefill with the reason, instead of scoring with a wrong rotation."""

from __future__ import annotations

import pytest
import torch

import slake
from hybrid_models import _common as hybrid_common
from hybrid_models import hybrid_model
from slake import SlakeCache
from slake.engines.transformers.attention import observe_attention
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.layer_facts import layer_contexts
from slake.engines.transformers.layer_layout import attention_layout
from slake.methods.rotary import RefusedRotary
from tiny_models import random_ids, tiny_model

ROTARY_METHODS = ["expected-attention", "ada-expected-attention", "criticalkv[scorer=expected-attention]"]


def _common(layers: int = 2) -> dict:
    """The hybrid tests' tiny shape (``hybrid_models._common``), with the special tokens some configs need."""
    return {**hybrid_common(layers), "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2}  # fmt: skip


def _model(name: str):
    """A tiny random causal LM (fp32, eager attention, slake-prepared) of one of the rotary conventions."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "llama":
        return tiny_model("llama-gqa", layers=2)
    if name == "gemma3":
        return hybrid_model("gemma3")
    if name == "gpt_neox":  # partial rotary: a quarter of each head's channels pass through
        cfg = tf.GPTNeoXConfig(**_common(), rotary_pct=0.5)
    elif name == "phi":  # partial rotary, the channels sliced by the attention module
        cfg = tf.PhiConfig(**_common(), partial_rotary_factor=0.5)
    elif name == "cohere":  # interleaved pairs
        cfg = tf.CohereConfig(**_common())
    elif name == "glm":  # interleaved pairs on half of the channels
        cfg = tf.GlmConfig(**_common(), head_dim=16)
    elif name == "smollm3-nope":  # layers 1 and 3 apply no RoPE
        cfg = tf.SmolLM3Config(**_common(4), no_rope_layers=[1, 0, 1, 0])
    elif name == "llama-dynamic":  # dynamic NTK: inv_freq replaced inside the forward past 32 positions
        common = {**_common(), "max_position_embeddings": 32}
        cfg = tf.LlamaConfig(**common, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    else:
        raise ValueError(name)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # peaky attention
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight", "query_key_value.weight")):
                p.mul_(4.0)
    model.eval()
    slake.prepare_model(model)
    return model


def _contexts(model):
    layout = attention_layout(model.config)
    return layout.compressed, layer_contexts(model, layout.compressed, layout.layer_types)


def _keys_at(model, offset: int, n: int = 12) -> dict[int, torch.Tensor]:
    """Every layer's post-RoPE keys of one prompt placed at positions ``offset .. offset + n - 1``."""
    keys: dict[int, torch.Tensor] = {}

    def seen(module, _q, k, _s):
        keys[module.layer_idx] = k.detach().clone()

    with observe_attention(seen), torch.no_grad():
        model(random_ids(n, seed=3), position_ids=torch.arange(n)[None] + offset, use_cache=False)
    return keys


def _assert_rotary_moves_the_models_keys(model) -> None:
    """With RoPE the model's keys at ``p + 5`` are its keys at ``p`` rotated by 5 positions (without RoPE: equal):
    the bound rotary must reproduce that on every compressed layer."""
    compressed, contexts = _contexts(model)
    at0, at5 = _keys_at(model, 0), _keys_at(model, 5)
    for i, ctx in zip(compressed, contexts):
        assert ctx.rotary is not None and not isinstance(ctx.rotary, RefusedRotary), (i, ctx.rotary)
        moved = ctx.rotary.rotate(at0[i], torch.full((12,), 5), scaled=False)
        assert float((moved - at5[i]).abs().max()) <= 1e-5 * float(at5[i].abs().max()), i


def _run(model, method: str, n: int = 40) -> SlakeCache:
    cache = SlakeCache(method, 16, config=model.config, window=4)
    with torch.no_grad():
        model(random_ids(n, seed=1), **with_cache(model, cache))
    return cache


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt_neox", "phi"])
def test_models_in_the_rotate_half_convention_keep_their_rotary(name):
    model = _model(name)
    _assert_rotary_moves_the_models_keys(model)
    compressed, contexts = _contexts(model)
    assert all(ctx.rotary.rotary_dim > 0 for ctx in contexts)
    if name == "llama":  # the model's own buffer, no copy
        assert all(ctx.rotary.inv_freq.data_ptr() == model.model.rotary_emb.inv_freq.data_ptr() for ctx in contexts)
    if name in ("gpt_neox", "phi"):
        assert all(ctx.rotary.rotary_dim == 8 for ctx in contexts)  # half of the 16 channels of a head
    cache = _run(model, "expected-attention")
    kept = cache.statistics()["kept_tokens_per_layer"]
    assert len(kept) == len(compressed) and all(k <= 16 for k in kept)


@pytest.mark.parametrize("name", ["cohere", "glm"])
@pytest.mark.parametrize("method", ROTARY_METHODS)
def test_interleaved_rotary_refuses_the_methods_that_read_it(name, method):
    model = _model(name)
    with pytest.raises(ValueError, match=rf"rotate-half convention.*{name} layer 0: .*interleaved channel pairs"):
        _run(model, method)


def test_interleaved_rotary_is_refused_only_where_it_is_read():
    """The check changes nothing for methods that do not read the rotary embedding."""
    model = _model("cohere")
    compressed, contexts = _contexts(model)
    assert all(isinstance(ctx.rotary, RefusedRotary) for ctx in contexts)
    assert all(ctx.out_proj is not None for ctx in contexts)
    for method in ("snapkv", "criticalkv"):
        kept = _run(model, method).statistics()["kept_tokens_per_layer"]
        assert len(kept) == len(compressed) and all(k <= 16 for k in kept)


def test_nope_layers_get_the_identity_rotation():
    """SmolLM3's ``no_rope_layers``: the NoPE layers' keys do not move with position; their rotary is the identity
    (rotary_dim 0), the others the model's; Expected Attention then runs."""
    model = _model("smollm3-nope")
    _assert_rotary_moves_the_models_keys(model)
    _, contexts = _contexts(model)
    assert [ctx.rotary.rotary_dim for ctx in contexts] == [16, 0, 16, 0]
    x = torch.randn(1, 2, 5, 16)
    assert torch.equal(contexts[1].rotary.rotate(x, torch.arange(5)), x)
    c, s = contexts[1].rotary.mean_rotation(40, 512)
    assert c.numel() == s.numel() == 0  # the averaged rotation matrix is the identity
    cache = _run(model, "expected-attention")
    assert all(k <= 16 for k in cache.statistics()["kept_tokens_per_layer"])


@pytest.mark.parametrize("method", ["expected-attention", "criticalkv[scorer=expected-attention]"])
def test_dynamic_rope_is_refused(method):
    """rope_type "dynamic" replaces ``inv_freq`` inside the forward once the prompt outgrows
    max_position_embeddings, after slake bound it: refused with the reason, before any score is computed."""
    model = _model("llama-dynamic")
    with pytest.raises(ValueError, match=r"llama layer 0: its rope_type 'dynamic'"):
        _run(model, method)


def test_a_rope_condition_slake_cannot_evaluate_is_refused():
    """An attention that applies RoPE under a test of something other than its own attributes (here the argument the
    decoder layer passes) cannot be checked from the module: refused, naming the condition."""
    from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

    class DecoderDecidesRope(LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            if position_embeddings is not None:
                apply_rotary_pos_emb(hidden_states, hidden_states, *position_embeddings)
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    model = tiny_model("llama-gqa", layers=2)
    model.model.layers[1].self_attn.__class__ = DecoderDecidesRope
    _, contexts = _contexts(model)
    assert not isinstance(contexts[0].rotary, RefusedRotary)
    assert isinstance(contexts[1].rotary, RefusedRotary)
    with pytest.raises(ValueError, match=r"llama layer 1: it applies RoPE only when `position_embeddings is not None`"):
        contexts[1].rotary.rotate(torch.zeros(1, 1, 2, 16), torch.arange(2))
