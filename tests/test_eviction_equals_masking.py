"""Eviction equals masking, for every method: the logits of decoding over a compressed cache equal those of one
forward of the whole sequence through plain attention in which each decoded row sees exactly the slots the cache held
when that row was decoded (per layer, KV head and query head), and the prompt's rows see everything causally (exact
prefill). Only StreamingLLM had such a test (``test_engine_decode``), whose kept set is known in closed form; here the
kept set is read off the cache at each step. Methods with a PTAA linear cache add a term no mask can express, so they
run with ``linear_cache=false`` (``test_ptaa`` checks the term)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

import slake
from slake.engines.transformers.cache_kwarg import with_cache
from slake.methods.base import available_methods, make_method
from tiny_models import prefill_for_generate, random_ids, tiny_model

N, BUDGET, STEPS = 96, 40, 12
#: (layer, query position) -> (query heads, positions) bool: what the cache let that row see
_VISIBLE: dict[tuple[int, int], torch.Tensor] = {}


def _masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain attention in float32 over the whole sequence, each row limited to what :data:`_VISIBLE` records for it
    (causal where nothing is recorded: the prompt's rows)."""
    _, Hq, S, _ = query.shape
    group = Hq // key.shape[1]
    k, v = key.repeat_interleave(group, 1).float(), value.repeat_interleave(group, 1).float()
    allowed = torch.ones(S, S, dtype=torch.bool).tril().expand(Hq, S, S).clone()
    for row in range(S):
        seen = _VISIBLE.get((module.layer_idx, row))
        if seen is not None:
            allowed[:, row] = seen[:, :S]
    logits = (query.float() @ k.transpose(-1, -2)) * scaling
    out = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("slake_test_masked", _masked_attention)


def _spec(name: str) -> str:
    return f"{name}[linear_cache=false]" if make_method(name).linear_cache else name


METHODS = [_spec(name) for name in available_methods() if name != "full"]


def _record_visibility(cache, num_heads: int, width: int) -> None:
    eng = cache.compressor
    decode = eng.decode_attention

    def recording(layer_idx, queries, scaling):
        store = eng.layers[layer_idx]
        kv_heads = store.valid.shape[1]
        group = num_heads // kv_heads
        row = int(eng.position_of(layer_idx))  # the new token's position, written inside the step
        seen = torch.zeros(num_heads, width, dtype=torch.bool)
        for h in range(kv_heads):
            for j in range(group):
                ok = store.valid[0, h].clone()
                if store.head_visible is not None:  # SAGE-KV: per query head
                    ok &= store.head_visible[0, h, j]
                seen[h * group + j, store.positions[0, h][ok]] = True
        seen[:, row] = True
        _VISIBLE[(layer_idx, row)] = seen
        return decode(layer_idx, queries, scaling)

    eng.decode_attention = recording


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-mha"])
@pytest.mark.parametrize("method", METHODS)
def test_decoding_over_the_kept_slots_equals_a_masked_full_forward(arch, method):
    if arch == "llama-mha" and method not in ("snapkv", "h2o", "kvzip", "sagekv", "ada-snapkv", "lava"):
        pytest.skip("MHA: a method of each kind of budget and decode rule")
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    ids = random_ids(N, seed=5)
    cache = slake.SlakeCache(method, BUDGET, config=model.config)
    _VISIBLE.clear()
    _record_visibility(cache, model.config.num_attention_heads, N + STEPS + 1)
    prefill_for_generate(model, cache, ids)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=STEPS, do_sample=False,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )  # fmt: skip
    assert cache.statistics()["compressed"]
    assert len(_VISIBLE) == (STEPS - 1) * model.config.num_hidden_layers
    model.set_attn_implementation("slake_test_masked")
    try:
        with torch.no_grad():
            ref = model(out.sequences[:, :-1]).logits[0]
    finally:
        slake.prepare_model(model)
    for t, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], ref[N - 1 + t], rtol=1e-4, atol=1e-4, msg=f"step {t}")
